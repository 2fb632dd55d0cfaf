#pragma once
// Shared memory between two processes of a conversation (the parent and one worker): each side
// has one PeerMemory for the other, and the protocol is the same in both directions.
//
// Slabs cross once. A message's tensors name their storages by place in the message's table of
// blocks, each entry (sender's slab id, offset, bytes). Before a message whose table names a slab
// the peer does not know, the sender sends an introduction: the slab's descriptor ("new"), or,
// for a slab that came from the peer, the peer's own id for it ("yours"). The receiver keeps a
// slab it was given mapped until the sender says the slab is gone ("forget"), so a block of it
// crossing later costs no descriptor, mmap or munmap on either side.
//
// Blocks are lent and come home. The sender holds each block it sent (a reference to its
// storage) until the peer says it let go: the receiver counts the messages that carried the block
// and, when its last holder drops it, releases it with that count. A block goes back to its
// owner's free list only when no process holds it any more, however many hops it took. Blocks
// of the peer's own slabs are not lent back: the peer holds them already.
//
//   A sends block b of slab s to B:   [introduce s: new, fd] [message, table: (s, b)]
//   B drops its last tensor of b:     [release (s, b, 1)]         -> A's hold on b ends
//   A frees its last slab block:      [forget s]                  -> B unmaps s
//
// When a peer dies, its PeerMemory is dropped: what it held is released here, and what it lent
// stays valid for as long as this process holds it (the mapping keeps the memory).
//
// Thread safety: lend, accept_* and take_release are called on the conversation's thread;
// storages and slabs may be released on any thread.

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <unordered_map>
#include <utility>
#include <vector>

#include <forkpool/ipc/codec.hpp>
#include <forkpool/runtime/unique_fd.hpp>
#include <forkpool/shm/internal/slab.hpp>
#include <forkpool/shm/internal/storage.hpp>
#include <forkpool/shm/internal/block_table.hpp>
#include <forkpool/shm/private/lending.hpp>

namespace forkpool::detail {

class PeerMemory final : public ReleaseListener, public std::enable_shared_from_this<PeerMemory> {
 public:
  PeerMemory();

  // Sending a message that carries `blocks`: the introduction to send first (nullopt when the peer
  // knows every slab), and the peer is recorded as holding each block once more. If the message
  // is not sent after all, unlend() undoes it.
  struct Introduction {
    Writer payload;
    std::vector<int> fds;                 // of the new slabs, in the payload's order
    std::vector<std::uint64_t> slab_ids;  // introduced
  };
  std::optional<Introduction> lend(const OutgoingBlocks& blocks);
  void unlend(const OutgoingBlocks& blocks, const std::optional<Introduction>& introduction);

  // Receiving. Each throws ProtocolError for what the peer had no right to send: the conversation
  // is then broken.
  void accept_introduction(std::span<const std::byte> payload, std::span<UniqueFd> fds);
  IncomingBlocks accept_blocks(std::span<const BlockEntry> table);
  void accept_release(std::span<const std::byte> payload);

  // What a release message says: blocks let go here and our slabs gone here since the last
  // take_release(). Never blocks. A release that could not be sent is given back with restore().
  using Release = BlockRelease;
  Release take_release();
  void restore(Release release);
  // Runs, on the releasing thread, whenever a release becomes due.
  void on_release_due(std::function<void(PeerMemory&)> callback);

  // The peer is gone: what it held of ours is let go, and its slabs stay mapped here only as long
  // as blocks of them are held here.
  void peer_gone();

  void storage_released(std::uint64_t storage_id) override;
  void slab_released(std::uint64_t slab_id) override;

 private:
  struct PeerSlab {
    std::shared_ptr<Slab> theirs;  // kept mapped until the peer forgets it
    std::weak_ptr<Slab> ours;      // a slab of ours the peer names under its own id
    // A slab of ours that reached the peer another way (a queue) and that it introduced as new:
    // it lends us its blocks as it would its own, so each comes back to it at once.
    bool lent_by_peer = false;
  };
  // A slab of ours (or one we map) that the peer knows. Whether we lend its blocks is fixed by
  // how we introduced it, so that both sides agree on every message: as new (we lend them), or
  // as the peer's own (we do not).
  struct Introduced {
    std::weak_ptr<Slab> slab;
    bool lends = true;
  };
  // A block borrowed from the peer goes home over the conversation: no address needed.
  struct OverTheConversation {};
  void release_due(std::unique_lock<std::mutex>& lock);

  pid_t owner_;  // a forked child inherits this object, but what it releases is not the owner's
  std::mutex mutex_;
  std::unordered_map<std::uint64_t, Introduced> introduced_;    // our slabs the peer knows, by id
  std::unordered_map<std::uint64_t, std::uint64_t> peer_name_;  // our slab id -> the peer's, for its slabs
  std::unordered_map<std::uint64_t, PeerSlab> from_peer_;       // by the peer's slab id
  LentBlocks lent_;
  BorrowedBlocks<OverTheConversation> borrowed_;
  DroppedStorages dropped_scratch_;  // accept_release's, kept for its capacity
  Release due_;
  // due_ is not empty: read without the lock, so that the common call finds nothing cheaply.
  std::atomic<bool> release_pending_{false};
  std::shared_ptr<const std::function<void(PeerMemory&)>> on_release_due_;  // called without the lock
};

}  // namespace forkpool::detail
