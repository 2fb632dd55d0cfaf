#include <forkpool/shm/internal/slab.hpp>

#include <fcntl.h>
#include <pthread.h>
#include <sys/mman.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <string>
#include <system_error>

#include <forkpool/ipc/private/memfd.hpp>
#include <forkpool/runtime/error.hpp>
#include <forkpool/runtime/private/errno.hpp>
#include <forkpool/runtime/private/process.hpp>
#include <forkpool/shm/private/inode_key.hpp>
#include <forkpool/shm/private/slab_allocator.hpp>
#include <forkpool/shm/private/spare_node.hpp>
#include <forkpool/shm/internal/storage.hpp>

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

namespace forkpool::detail {
namespace {

// The slabs this process maps, by inode: a slab received again is the same Slab. Under slab_lock().
InodeCache<Slab>& slabs_by_inode() {
  static auto* slabs = new InodeCache<Slab>();
  return *slabs;
}

// Asks for transparent huge pages (where shmem_enabled allows them) and pages the mapping in
// now, so that no 20 µs fault is paid per page later. Pages in a fresh slab were reserved by
// fallocate, so a kernel without MADV_POPULATE_WRITE only pays the faults, never SIGBUS.
void page_in(const Mapping& mapping) {
  madvise(mapping.data(), mapping.size(), MADV_HUGEPAGE);
  if (madvise(mapping.data(), mapping.size(), MADV_POPULATE_WRITE) < 0 && errno != EINVAL)
    throw_last_errno("forkpool: paging in a shared memory slab");
}

}  // namespace

std::mutex& slab_lock() {
  static auto* lock = [] {
    auto* mutex = new std::mutex();
    pthread_atfork([] { slab_lock().lock(); }, [] { slab_lock().unlock(); }, [] { slab_lock().unlock(); });
    return mutex;
  }();
  return *lock;
}

MappedCounters& mapped_counters() {
  static auto* counters = new MappedCounters();
  return *counters;
}

Slab::Slab() {
  static std::atomic<std::uint64_t> next_id{0};
  id_ = ++next_id;
}

std::shared_ptr<Slab> Slab::create(std::size_t bytes) {
  std::shared_ptr<Slab> slab(new Slab());
  slab->fd_ = create_memfd("forkpool-slab", bytes);
  // Reserved now, or an exception now: memory short later would be SIGBUS at first touch.
  if (int error = posix_fallocate(slab->fd_.get(), 0, static_cast<off_t>(bytes)); error != 0) {
    if (error == ENOMEM || error == ENOSPC) throw std::bad_alloc();
    throw std::system_error(error, std::generic_category(), "forkpool: reserving a shared memory slab");
  }
  seal_size(slab->fd_.get());
  slab->mapping_ = Mapping::map(slab->fd_.get(), bytes, PROT_READ | PROT_WRITE);
  page_in(slab->mapping_);
  slab->owner_ = current_pid();
  struct stat st {};
  if (fstat(slab->fd_.get(), &st) < 0) throw_last_errno("forkpool: fstat of a new slab");
  remember(slab, st);
  return slab;
}

std::shared_ptr<Slab> Slab::adopt(UniqueFd fd, std::size_t min_bytes) {
  struct stat st {};
  if (fstat(fd.get(), &st) < 0) throw ProtocolError(std::string("forkpool: slab: fstat failed: ") + strerror(errno));
  {
    std::lock_guard lock(slab_lock());
    if (auto known = slabs_by_inode().find(InodeKey{st.st_dev, st.st_ino})) {
      if (known->size() < min_bytes) throw ProtocolError("forkpool: a slab is shorter than claimed");
      return known;
    }
  }
  std::size_t size = check_sealed_memfd(fd.get(), st, min_bytes, "forkpool: slab");
  // Its owner reserved every byte (create()); a sparse file would be allocated here by page_in,
  // at the sender's word: one small message could make us commit gigabytes.
  if (allocated_bytes(st) < size)
    throw ProtocolError("forkpool: a slab of " + std::to_string(size) + " bytes of which only " +
                        std::to_string(allocated_bytes(st)) + " are allocated");
  std::shared_ptr<Slab> slab(new Slab());
  slab->mapping_ = Mapping::map(fd.get(), size, PROT_READ | PROT_WRITE);
  page_in(slab->mapping_);
  slab->fd_ = std::move(fd);
  remember(slab, st);
  return slab;
}

void Slab::remember(const std::shared_ptr<Slab>& slab, const struct stat& st) {
  std::lock_guard lock(slab_lock());
  slab->device_ = st.st_dev;
  slab->inode_ = st.st_ino;
  slabs_by_inode().remember(InodeKey{st.st_dev, st.st_ino}, slab);
  mapped_counters().add(1, static_cast<std::int64_t>(slab->size()), 1);
}

void Slab::forget_inherited() noexcept {
  std::lock_guard lock(slab_lock());
  slabs_by_inode().clear();  // only weak references: the inherited slabs are left as they are
  mapped_counters().slabs = 0;
  mapped_counters().bytes = 0;
  mapped_counters().descriptors = 0;
}

void Slab::unmap_inherited() noexcept {
  {
    std::lock_guard lock(slab_lock());
    // The objects themselves are never destroyed here.
    slabs_by_inode().for_each_alive([](Slab& slab) { munmap(slab.data(), slab.size()); });
  }
  forget_inherited();
}

Slab::~Slab() {
  std::vector<std::weak_ptr<ReleaseListener>> listeners;
  {
    std::lock_guard lock(slab_lock());
    slabs_by_inode().forget_expired(InodeKey{device_, inode_});
    listeners = std::move(listeners_);
    mapped_counters().add(-1, -static_cast<std::int64_t>(size()), -1);
  }
  for (auto& weak : listeners)
    if (auto listener = weak.lock()) listener->slab_released(id_);
}

bool Slab::owned() const noexcept { return owner_ != 0 && owner_ == current_pid(); }

std::shared_ptr<Storage> Slab::live_block(std::size_t offset) {
  std::lock_guard lock(slab_lock());
  auto it = live_.find(offset);
  return it == live_.end() ? nullptr : it->second.lock();
}

std::shared_ptr<Storage> Slab::receive_block(std::size_t offset, std::size_t bytes) {
  if (offset > size() || bytes > size() - offset) return nullptr;
  std::lock_guard lock(slab_lock());
  if (auto it = live_.find(offset); it != live_.end())
    if (auto held = it->second.lock()) return held->size() == bytes ? held : nullptr;
  if (owned()) return nullptr;  // our own block must be one we handed out
  return make_block(offset, bytes);
}

std::shared_ptr<Storage> Slab::make_block(std::size_t offset, std::size_t bytes) {
  std::shared_ptr<Storage> storage = Storage::block(shared_from_this(), offset, bytes);  // keeps the slab mapped
  if (auto it = live_.find(offset); it != live_.end())
    it->second = storage;
  else
    insert_reusing(live_, spare_live_, offset, storage);
  return storage;
}

void Slab::block_released(std::size_t offset) noexcept {
  bool ours;
  {
    std::lock_guard lock(slab_lock());
    auto it = live_.find(offset);
    // Another storage may have been made for the offset since this one's count reached zero.
    if (it != live_.end() && it->second.expired()) spare_live_ = live_.extract(it);
    ours = owned();
  }
  if (ours) SlabAllocator::instance().give_back(*this, offset);
}

void Slab::notify_on_release(const std::shared_ptr<ReleaseListener>& listener) {
  std::lock_guard lock(slab_lock());
  std::erase_if(listeners_, [](const auto& weak) { return weak.expired(); });
  listeners_.push_back(listener);
}

}  // namespace forkpool::detail
