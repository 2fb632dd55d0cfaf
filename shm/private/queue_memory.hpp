#pragma once
// Tensors on queues, recycled: the blocks of a queue item are lent by the process that put it
// and come home when the process that got it lets go, as between a pool's parent and workers
// (peer_memory.hpp, lending.hpp), but between processes that know nothing of each other.
//
// An item is self-contained, since any consumer may take it: its table names each block by
// (the owner's slab id, offset, bytes) and carries the slab's descriptor, and the owner's
// release socket (a datagram socket only the owner reads). The consumer maps the slab (once:
// the same inode is the same mapping) and, when it drops the block, sends (slab id, offset,
// count) to the owner, which then lets go of its hold: the block returns to its free list,
// mapped and paged in, for the next batch. Recently used slabs stay mapped in the consumer.
//
//   item:  [body][slab fd index]... [owner socket fd index][table: (slab, offset, bytes)...][u32 n]
//
// A consumer that dies holding blocks leaves them held by their owner for good (they are in no
// one's way but the owner's cache); an owner that dies leaves its blocks valid where they are
// mapped. Any thread.

#include <sys/types.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <unordered_map>
#include <vector>

#include <forkpool/ipc/codec.hpp>
#include <forkpool/ipc/internal/frame.hpp>
#include <forkpool/shm/internal/block_table.hpp>
#include <forkpool/shm/private/inode_key.hpp>
#include <forkpool/shm/private/lending.hpp>
#include <forkpool/runtime/unique_fd.hpp>

namespace forkpool::detail {

class QueueMemory final : public ReleaseListener, public std::enable_shared_from_this<QueueMemory> {
 public:
  // This process's (a forked child gets its own).
  static std::shared_ptr<QueueMemory> instance();

  // Putting: takes back what consumers let go of, then appends `blocks`' table, descriptors and
  // our release socket to `item`, and holds each block until it comes home.
  void lend(Writer& item, const OutgoingBlocks& blocks);
  // Getting: splits the table off `payload` and resolves its blocks (the body is the rest).
  // Throws ProtocolError for a table that does not fit or a block that is not valid.
  IncomingBlocks borrow(std::span<const std::byte>& payload, std::vector<UniqueFd>& fds);

  void storage_released(std::uint64_t storage_id) override;

  QueueMemory();  // for instance()

 private:
  using OwnerSocket = std::shared_ptr<UniqueFd>;  // where a borrowed block goes home
  struct ReleaseEntry {
    std::uint64_t slab, offset, count;  // the owner's slab id
  };
  void send_home(OwnerSocket owner, const ReleaseEntry& entry);  // mutex_ held
  void collect_releases(DroppedStorages& dropped);               // mutex_ held
  void send_pending();                                           // mutex_ held
  std::shared_ptr<UniqueFd> owner_socket(UniqueFd fd);           // mutex_ held
  void keep_mapped(const std::shared_ptr<Slab>& slab);           // mutex_ held

  std::mutex mutex_;
  UniqueFd releases_in_, releases_out_;  // consumers send to out (attached to items); we read in
  LentBlocks lent_;
  BorrowedBlocks<OwnerSocket> borrowed_;
  InodeCache<UniqueFd> owners_;                                                        // owners' sockets
  std::vector<std::pair<std::shared_ptr<UniqueFd>, std::vector<std::byte>>> pending_;  // releases not yet sent
  std::vector<std::shared_ptr<Slab>> kept_;  // recently borrowed slabs, oldest first
  std::size_t kept_bytes_ = 0;
};

}  // namespace forkpool::detail
