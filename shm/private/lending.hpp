#pragma once
// Lending's bookkeeping, the same for every way a block goes home (a pool's conversation with a
// worker: peer_memory.hpp; a queue's release socket: queue_memory.hpp).
//
// The lender holds each block it sent (a reference to its storage), counting the messages that
// carried it, until the borrowers say they let go: only then may the block return to its free
// list. The borrower counts the messages that brought each block and, when its last holder here
// drops it, sends that count home. Neither class locks: their owner does.

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <unordered_map>
#include <utility>
#include <vector>

#include <forkpool/shm/internal/storage.hpp>
#include <forkpool/shm/private/spare_node.hpp>

namespace forkpool::detail {

// Storages whose hold ended while a lock was held: the caller lets go of them after unlocking
// (a storage's release may call back into the lender).
using DroppedStorages = std::vector<std::shared_ptr<Storage>>;

// The lender's side.
class LentBlocks {
 public:
  // One more message carries `storage`.
  void lend(const std::shared_ptr<Storage>& storage);
  // `count` of the messages that carried the block at (`slab`, `offset`) let go of it. When
  // none is out any more, the hold ends: its storage moves to `dropped`. False (and nothing
  // changes) when that block was not lent that often: a confused or hostile borrower.
  bool came_home(std::uint64_t slab, std::uint64_t offset, std::uint64_t count, DroppedStorages& dropped);
  // The borrowers are gone: every hold ends.
  void clear(DroppedStorages& dropped);

 private:
  struct Lent {
    std::shared_ptr<Storage> storage;
    std::uint64_t count = 0;
  };
  using Map = std::map<std::pair<std::uint64_t, std::uint64_t>, Lent>;  // by (our slab id, offset)
  Map lent_;
  Map::node_type spare_;  // the last entry to come home, reused by the next lend: no allocation
};

// The borrower's side. `Home` says where a block's release goes (nothing, for a conversation
// with one peer; the owner's socket, for a queue).
template <class Home>
class BorrowedBlocks {
 public:
  // What goes home when the last holder here lets go: (the lender's slab id, offset, count).
  struct Return {
    Home home;
    std::uint64_t slab = 0;
    std::uint64_t offset = 0;
    std::uint64_t count = 0;
  };
  // One more message brought storage `storage_id`, the lender's (`slab`, `offset`). True the
  // first time: the caller then asks the storage to tell it when it is let go.
  bool borrow(std::uint64_t storage_id, Home home, std::uint64_t slab, std::uint64_t offset) {
    auto it = borrowed_.find(storage_id);
    bool first = it == borrowed_.end();
    if (first) it = insert_reusing(borrowed_, spare_, storage_id, Return{std::move(home), slab, offset, 0});
    ++it->second.count;
    return first;
  }
  // The last holder here let go of `storage_id`: what to send home (nothing if it was not borrowed).
  std::optional<Return> released(std::uint64_t storage_id) {
    auto it = borrowed_.find(storage_id);
    if (it == borrowed_.end()) return std::nullopt;
    Return r = std::move(it->second);
    spare_ = borrowed_.extract(it);
    return r;
  }
  void clear() { borrowed_.clear(); }

 private:
  using Map = std::unordered_map<std::uint64_t, Return>;  // by our storage id
  Map borrowed_;
  typename Map::node_type spare_;  // the last entry let go of, reused by the next borrow: no allocation
};

}  // namespace forkpool::detail
