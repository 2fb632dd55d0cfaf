#include <forkpool/shm/internal/storage.hpp>

#include <fcntl.h>
#include <pthread.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <mutex>
#include <random>
#include <unordered_map>
#include <string>
#include <system_error>

#include <forkpool/ipc/private/memfd.hpp>
#include <forkpool/runtime/error.hpp>
#include <forkpool/shm/private/name_tracker.hpp>
#include <forkpool/shm/private/inode_key.hpp>
#include <forkpool/shm/private/slab_allocator.hpp>
#include <forkpool/runtime/private/errno.hpp>
#include <forkpool/runtime/private/memory_limit.hpp>

namespace forkpool::detail {
namespace {

// A named segment starts with this header; the tensor bytes follow it.
struct SegmentHeader {
  std::atomic<std::int64_t> holders;  // processes (and messages in flight) holding the segment
  char padding[56];
};
static_assert(sizeof(SegmentHeader) == 64);
constexpr std::size_t kSegmentDataOffset = sizeof(SegmentHeader);

// The storages this process maps, by inode: receiving one again reuses the mapping. Tensors
// may be released on any thread; the lock is held across fork() so a child never inherits it
// taken.
struct MappedStorages {
  std::mutex mutex;
  InodeCache<Storage> by_inode;

  MappedStorages() {
    pthread_atfork([] { instance().mutex.lock(); }, [] { instance().mutex.unlock(); },
                   [] { instance().mutex.unlock(); });
  }
  static MappedStorages& instance() {
    static auto* storages = new MappedStorages();
    return *storages;
  }
};

std::string random_segment_name() {
  // Fresh entropy each time: a generator's state would be copied into forked children.
  std::random_device entropy;
  auto bits = (static_cast<unsigned long long>(entropy()) << 32) | entropy();
  char suffix[17];
  std::snprintf(suffix, sizeof suffix, "%016llx", bits);
  return std::string(kSegmentPrefix) + std::to_string(getpid()) + "-" + suffix;
}

struct stat stat_of(int fd, const char* what) {
  struct stat st {};
  if (fstat(fd, &st) < 0) throw ProtocolError(std::string(what) + ": fstat failed: " + strerror(errno));
  return st;
}

}  // namespace

Storage::Storage(Key) {
  static std::atomic<std::uint64_t> next_id{0};
  id_ = ++next_id;
}

void Storage::allocate_named(Storage& storage, std::size_t bytes) {
  start_name_tracker();  // first: no segment is made that no tracker would clean up
  for (int attempt = 0; !storage.fd_; ++attempt) {
    storage.name_ = random_segment_name();
    int fd = open(segment_path(storage.name_).c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd >= 0)
      storage.fd_.reset(fd);
    else if (errno != EEXIST || attempt > 8)
      throw_last_errno("forkpool: creating a /dev/shm segment");
  }
  try {
    track_segment_name(storage.name_);
    // Reserved now, or an exception now: a sparse segment larger than /dev/shm's free space
    // would "succeed" here and SIGBUS on first touch.
    std::size_t total = kSegmentDataOffset + bytes;
    if (int error = posix_fallocate(storage.fd_.get(), 0, static_cast<off_t>(total)); error != 0)
      throw std::system_error(error, std::generic_category(),
                              "forkpool: reserving " + std::to_string(total) + " bytes in /dev/shm");
    storage.mapping_ = Mapping::map(storage.fd_.get(), total, PROT_READ | PROT_WRITE);
  } catch (...) {
    unlink(segment_path(storage.name_).c_str());
    untrack_segment_name(storage.name_);
    throw;
  }
  storage.kind_ = Kind::named;
  storage.data_ = storage.mapping_.data() + kSegmentDataOffset;
  storage.holders()->store(1);
  mapped_counters().add(0, static_cast<std::int64_t>(storage.mapping_.size()), 1);
}

bool Storage::segment_intact() const noexcept {
  struct stat st {};
  return mapping_.data() != nullptr && fstat(fd_.get(), &st) == 0 &&
         static_cast<std::size_t>(st.st_size) >= mapping_.size();
}

std::shared_ptr<Storage> Storage::allocate(std::size_t bytes) {
  check_memory_could_hold(bytes, "forkpool: shared memory for a tensor");
  if (get_sharing_strategy() == SharingStrategy::file_descriptor) return SlabAllocator::instance().allocate(bytes);
  std::shared_ptr<Storage> storage = std::make_shared<Storage>(Key());
  allocate_named(*storage, bytes);
  storage->size_ = bytes;
  struct stat st = stat_of(storage->fd_.get(), "forkpool: new storage");
  remember(storage, st.st_dev, st.st_ino);
  return storage;
}

std::shared_ptr<Storage> Storage::block(std::shared_ptr<Slab> slab, std::size_t offset, std::size_t bytes) {
  std::shared_ptr<Storage> storage = std::make_shared<Storage>(Key());
  storage->kind_ = Kind::block;
  storage->data_ = slab->data() + offset;
  storage->size_ = bytes;
  storage->slab_offset_ = offset;
  storage->slab_ = std::move(slab);
  return storage;
}

int Storage::fd() const noexcept { return slab_ ? slab_->fd() : fd_.get(); }

std::shared_ptr<Storage> Storage::external(std::byte* data, std::size_t bytes, std::function<void()> release) {
  std::shared_ptr<Storage> storage = std::make_shared<Storage>(Key());
  storage->kind_ = Kind::external;
  storage->data_ = data;
  storage->size_ = bytes;
  storage->release_ = std::move(release);
  return storage;
}

std::shared_ptr<Storage> Storage::adopt_memfd(UniqueFd fd, std::size_t min_bytes) {
  // A storage this process already maps was validated when it was first mapped.
  struct stat st = stat_of(fd.get(), "forkpool: tensor storage");
  if (auto known = cached(st.st_dev, st.st_ino); known && known->kind_ == Kind::memfd) {
    if (known->size() < min_bytes) throw ProtocolError("forkpool: tensor storage is shorter than claimed");
    return known;
  }
  std::size_t size = check_sealed_memfd(fd.get(), st, min_bytes, "forkpool: tensor storage");
  std::shared_ptr<Storage> storage = std::make_shared<Storage>(Key());
  storage->mapping_ = Mapping::map(fd.get(), size, PROT_READ | PROT_WRITE);
  storage->data_ = storage->mapping_.data();
  storage->size_ = size;
  storage->fd_ = std::move(fd);
  remember(storage, st.st_dev, st.st_ino);
  mapped_counters().add(0, static_cast<std::int64_t>(size), 1);
  return storage;
}

std::shared_ptr<Storage> Storage::adopt_named(const std::string& name, std::size_t min_bytes) {
  if (!is_segment_name(name)) throw ProtocolError("forkpool: \"" + name + "\" is not a forkpool segment name");
  UniqueFd fd(open(segment_path(name).c_str(), O_RDWR | O_CLOEXEC | O_NOFOLLOW));
  if (!fd) throw ProtocolError("forkpool: cannot open segment " + name + ": " + strerror(errno));
  struct stat st = stat_of(fd.get(), "forkpool: segment");
  if (!S_ISREG(st.st_mode)) throw ProtocolError("forkpool: segment " + name + " is not a regular file");
  if (st.st_uid != geteuid()) throw ProtocolError("forkpool: segment " + name + " belongs to another user");
  auto size = static_cast<std::size_t>(st.st_size);
  if (size < kSegmentDataOffset || size - kSegmentDataOffset < min_bytes)
    throw ProtocolError("forkpool: segment " + name + " is shorter than claimed");
  if (auto known = cached(st.st_dev, st.st_ino)) {
    known->holders()->fetch_sub(1);  // we hold it already: the message's reference is not needed
    return known;
  }
  std::shared_ptr<Storage> storage = std::make_shared<Storage>(Key());
  storage->kind_ = Kind::named;
  storage->name_ = name;
  track_segment_name(name);
  storage->mapping_ = Mapping::map(fd.get(), size, PROT_READ | PROT_WRITE);
  mapped_counters().add(0, static_cast<std::int64_t>(size), 1);
  storage->data_ = storage->mapping_.data() + kSegmentDataOffset;
  storage->size_ = size - kSegmentDataOffset;
  storage->fd_ = std::move(fd);
  remember(storage, st.st_dev, st.st_ino);
  return storage;
}

Storage::~Storage() {
  if (binding_.release) binding_.release(binding_.object);
  for (auto& weak : listeners_)
    if (auto listener = weak.lock()) listener->storage_released(id_);
  if (kind_ == Kind::block) {
    slab_->block_released(slab_offset_);
    return;
  }
  if (mapping_.data()) mapped_counters().add(0, -static_cast<std::int64_t>(mapping_.size()), -1);
  if (cached_) {
    auto& cache = MappedStorages::instance();
    std::lock_guard lock(cache.mutex);
    cache.by_inode.forget_expired(InodeKey{device_, inode_});
  }
  // A segment another process shrank would fault where we touch its header: it is unlinked
  // instead, and nobody can count on it any more.
  if (kind_ == Kind::named && (!segment_intact() || holders()->fetch_sub(1) == 1)) {
    // The last holder anywhere: the name is no longer needed by any process. (Otherwise a
    // message may still carry it: this process stays registered, so that its death dooms the
    // name unless a receiver registers in time.)
    unlink(segment_path(name_).c_str());
    untrack_segment_name(name_);
  }
  if (release_) release_();
}

void Storage::notify_on_release(const std::shared_ptr<ReleaseListener>& listener) {
  std::lock_guard lock(mutex_);
  std::erase_if(listeners_, [](const auto& weak) { return weak.expired(); });
  listeners_.push_back(listener);
}

void Storage::add_message_reference() {
  if (kind_ != Kind::named) return;
  if (!segment_intact())
    throw Error("forkpool: segment " + name_ + " was shrunk by another process: it cannot be sent");
  holders()->fetch_add(1);
}

std::atomic<std::int64_t>* Storage::holders() const noexcept {
  return &reinterpret_cast<SegmentHeader*>(mapping_.data())->holders;
}

void Storage::forget_inherited() noexcept {
  {
    auto& cache = MappedStorages::instance();
    std::lock_guard lock(cache.mutex);
    cache.by_inode.clear();  // only weak references: the parent's storages are left as they are
  }
  Slab::forget_inherited();
}

std::shared_ptr<Storage> Storage::cached(dev_t device, ino_t inode) {
  auto& cache = MappedStorages::instance();
  std::lock_guard lock(cache.mutex);
  return cache.by_inode.find(InodeKey{device, inode});
}

void Storage::remember(const std::shared_ptr<Storage>& storage, dev_t device, ino_t inode) {
  storage->device_ = device;
  storage->inode_ = inode;
  storage->cached_ = true;
  auto& cache = MappedStorages::instance();
  std::lock_guard lock(cache.mutex);
  cache.by_inode.remember(InodeKey{device, inode}, storage);
}

}  // namespace forkpool::detail
