#include <forkpool/shm/private/queue_memory.hpp>

#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include <forkpool/runtime/error.hpp>
#include <forkpool/runtime/private/errno.hpp>
#include <forkpool/runtime/private/process.hpp>
#include <forkpool/shm/internal/slab.hpp>

namespace forkpool::detail {
namespace {

// Recently borrowed slabs stay mapped up to this much, so that the next block of a slab that
// came before costs no mmap and no page faults.
constexpr std::size_t kKeptBytes = 256 << 20;

[[noreturn]] void broken(const std::string& what) { throw ProtocolError("forkpool: queue item: " + what); }

}  // namespace

std::shared_ptr<QueueMemory> QueueMemory::instance() {
  static std::mutex mutex;
  static std::shared_ptr<QueueMemory> memory;
  static pid_t owner = 0;
  std::lock_guard lock(mutex);
  if (!memory || owner != current_pid()) {
    if (memory) new std::shared_ptr<QueueMemory>(std::move(memory));  // the parent's: never touched here
    memory = std::make_shared<QueueMemory>();
    owner = current_pid();
  }
  return memory;
}

QueueMemory::QueueMemory() {
  int ends[2];
  if (socketpair(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0, ends) != 0)
    throw_last_errno("forkpool: queue release socket");
  releases_in_ = UniqueFd(ends[0]);
  releases_out_ = UniqueFd(ends[1]);
}

void QueueMemory::collect_releases(DroppedStorages& dropped) {
  std::vector<ReleaseEntry> entries(256);
  for (;;) {
    ssize_t n = recv(releases_in_.get(), entries.data(), entries.size() * sizeof(ReleaseEntry), MSG_DONTWAIT);
    if (n < 0) {
      if (errno == EINTR) continue;
      return;  // EAGAIN: nothing more
    }
    for (std::size_t i = 0; i < static_cast<std::size_t>(n) / sizeof(ReleaseEntry); ++i)
      lent_.came_home(entries[i].slab, entries[i].offset, entries[i].count, dropped);  // false: a confused consumer
  }
}

void QueueMemory::lend(Writer& item, const OutgoingBlocks& blocks) {
  DroppedStorages dropped;  // destroyed after the lock is let go
  std::lock_guard lock(mutex_);
  collect_releases(dropped);
  const auto& storages = blocks.storages();
  if (!storages.empty()) {
    for (const auto& storage : storages) {
      Slab* slab = storage->slab();
      item.write_fd(slab->fd(), slab->shared_from_this());
      lent_.lend(storage);
    }
    item.write_fd(releases_out_.get());
  }
  blocks.write_table(item);
}

std::shared_ptr<UniqueFd> QueueMemory::owner_socket(UniqueFd fd) {
  struct stat st {};
  int type = 0;
  socklen_t size = sizeof type;
  if (fstat(fd.get(), &st) != 0 || getsockopt(fd.get(), SOL_SOCKET, SO_TYPE, &type, &size) != 0 || type != SOCK_DGRAM)
    broken("the owner's release descriptor is not a datagram socket");
  InodeKey key{st.st_dev, st.st_ino};
  if (auto known = owners_.find(key)) return known;
  auto socket = std::make_shared<UniqueFd>(std::move(fd));
  owners_.remember(key, socket);
  return socket;
}

void QueueMemory::keep_mapped(const std::shared_ptr<Slab>& slab) {
  auto it = std::find(kept_.begin(), kept_.end(), slab);
  if (it != kept_.end()) {
    kept_.erase(it);  // most recent last
  } else {
    kept_bytes_ += slab->size();
  }
  kept_.push_back(slab);
  while (kept_bytes_ > kKeptBytes && kept_.size() > 1) {
    kept_bytes_ -= kept_.front()->size();
    kept_.erase(kept_.begin());
  }
}

IncomingBlocks QueueMemory::borrow(std::span<const std::byte>& payload, std::vector<UniqueFd>& fds) {
  TabledPayload split = split_block_table(payload);
  payload = split.body;
  if (split.table.empty()) return IncomingBlocks({});
  std::size_t indices = (split.table.size() + 1) * sizeof(std::uint32_t);
  if (payload.size() < indices) broken("its descriptor indices do not fit");
  std::vector<std::uint32_t> index(split.table.size() + 1);
  std::memcpy(index.data(), payload.data() + payload.size() - indices, indices);
  payload = payload.first(payload.size() - indices);
  auto take = [&](std::uint32_t at) {
    if (at >= fds.size() || !fds[at]) broken("a descriptor index that is not attached");
    return std::move(fds[at]);
  };

  // Destroyed after the lock is let go, on a throw too: a storage's release takes mutex_.
  std::vector<std::shared_ptr<Storage>> storages;
  std::lock_guard lock(mutex_);
  send_pending();
  std::shared_ptr<UniqueFd> owner = owner_socket(take(index.back()));
  for (std::size_t i = 0; i < split.table.size(); ++i) {
    const BlockEntry& entry = split.table[i];
    if (entry.offset > SIZE_MAX - entry.bytes) broken("a block past the end of memory");
    std::shared_ptr<Slab> slab = Slab::adopt(take(index[i]), entry.offset + entry.bytes);
    std::shared_ptr<Storage> storage = slab->receive_block(entry.offset, entry.bytes);
    if (!storage) broken("a block that is not valid in its slab");
    if (slab->owned()) {
      // Our own block, back through the queue: we hold it already, so the putter's hold on it
      // (its own lending, whoever put it) ends at once.
      send_home(owner, {entry.slab, entry.offset, 1});
    } else {
      if (borrowed_.borrow(storage->id(), owner, entry.slab, entry.offset))
        storage->notify_on_release(shared_from_this());
      keep_mapped(slab);
    }
    storages.push_back(std::move(storage));
  }
  return IncomingBlocks(std::move(storages));
}

void QueueMemory::send_pending() {
  std::erase_if(pending_, [](auto& release) {
    ssize_t n = send(release.first->get(), release.second.data(), release.second.size(), MSG_DONTWAIT | MSG_NOSIGNAL);
    return n >= 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != ENOBUFS);  // sent, or the owner is gone
  });
}

void QueueMemory::storage_released(std::uint64_t storage_id) {
  std::lock_guard lock(mutex_);
  auto home = borrowed_.released(storage_id);
  if (!home) return;
  send_home(std::move(home->home), {home->slab, home->offset, home->count});
}

void QueueMemory::send_home(OwnerSocket owner, const ReleaseEntry& entry) {
  std::vector<std::byte> bytes(sizeof entry);
  std::memcpy(bytes.data(), &entry, sizeof entry);
  pending_.emplace_back(std::move(owner), std::move(bytes));
  send_pending();
}

}  // namespace forkpool::detail
