#include <forkpool/shm/private/peer_memory.hpp>

#include <cstring>
#include <string>

#include <forkpool/runtime/error.hpp>
#include <forkpool/runtime/private/process.hpp>

namespace forkpool::detail {
namespace {

// How an introduction names a slab: by descriptor, or as the receiver's own.
enum IntroductionKind : std::uint64_t { kNewSlab = 0, kYourSlab = 1 };

[[noreturn]] void broken(const std::string& what) { throw ProtocolError("forkpool: " + what); }

// The most slabs one peer may have mapped here at once (each holds a descriptor and a mapping).
// Slabs are recycled and grow with demand, so honest peers stay far below; a worker past it is
// breaking the protocol.
constexpr std::size_t kMaxPeerSlabs = 1024;

}  // namespace

PeerMemory::PeerMemory() : owner_(current_pid()) {}

std::optional<PeerMemory::Introduction> PeerMemory::lend(const OutgoingBlocks& blocks) {
  if (blocks.storages().empty()) return std::nullopt;  // most small tasks: no lock taken
  Introduction introduction;
  std::vector<std::uint64_t> entries;  // (slab id, kind, size or the peer's id)...
  std::vector<Slab*> watched;
  {
    std::lock_guard lock(mutex_);
    for (const auto& storage : blocks.storages()) {
      Slab& slab = *storage->slab();
      auto peer_name = peer_name_.find(slab.id());
      bool theirs = peer_name != peer_name_.end();
      auto [known, fresh] = introduced_.try_emplace(slab.id(), Introduced{slab.weak_from_this(), !theirs});
      if (fresh) {
        introduction.slab_ids.push_back(slab.id());
        watched.push_back(&slab);
        if (theirs) {
          entries.insert(entries.end(), {slab.id(), kYourSlab, peer_name->second});
        } else {
          entries.insert(entries.end(), {slab.id(), kNewSlab, slab.size()});
          introduction.fds.push_back(slab.fd());
        }
      }
      if (!known->second.lends) continue;  // the peer's own block: it holds it already
      lent_.lend(storage);
    }
  }
  // Outside the lock: the slab takes its own, and its release calls back into ours.
  for (Slab* slab : watched) slab->notify_on_release(shared_from_this());
  if (entries.empty()) return std::nullopt;
  introduction.payload.write(entries);
  return introduction;
}

void PeerMemory::unlend(const OutgoingBlocks& blocks, const std::optional<Introduction>& introduction) {
  DroppedStorages dropped;  // destroyed after the lock is let go
  std::lock_guard lock(mutex_);
  if (introduction)
    for (std::uint64_t id : introduction->slab_ids) introduced_.erase(id);
  for (const auto& storage : blocks.storages())  // a block of the peer's own was never lent: no-op
    lent_.came_home(storage->slab()->id(), storage->slab_offset(), 1, dropped);
}

void PeerMemory::accept_introduction(std::span<const std::byte> payload, std::span<UniqueFd> fds) {
  auto entries = decode<std::vector<std::uint64_t>>(payload);
  if (entries.size() % 3 != 0) broken("a slab introduction of " + std::to_string(entries.size()) + " numbers");
  std::size_t next_fd = 0;
  for (std::size_t i = 0; i < entries.size(); i += 3) {
    std::uint64_t peer_id = entries[i], kind = entries[i + 1], value = entries[i + 2];
    PeerSlab known;
    {
      std::lock_guard lock(mutex_);  // before mapping anything: each slab costs us a descriptor
      if (from_peer_.size() >= kMaxPeerSlabs)
        broken("the peer would have us map more than " + std::to_string(kMaxPeerSlabs) + " of its slabs at once");
    }
    if (kind == kNewSlab) {
      if (next_fd == fds.size()) broken("a slab introduction names more new slabs than it carries descriptors");
      known.theirs = Slab::adopt(std::move(fds[next_fd++]), value);
    } else if (kind != kYourSlab) {
      broken("a slab introduction of unknown kind " + std::to_string(kind));
    }
    std::lock_guard lock(mutex_);
    if (from_peer_.contains(peer_id)) broken("the peer introduces its slab " + std::to_string(peer_id) + " twice");
    if (known.theirs && known.theirs->owned()) {
      // Our own slab, which the peer had from elsewhere (a queue): its blocks are ours, lent.
      known.ours = std::exchange(known.theirs, nullptr);
      known.lent_by_peer = true;
    } else if (known.theirs) {
      peer_name_[known.theirs->id()] = peer_id;
    } else {
      // Only a slab we gave the peer can come back as ours.
      auto it = introduced_.find(value);
      if (it == introduced_.end() || it->second.slab.expired())
        broken("the peer names slab " + std::to_string(value) + " as ours, which we did not give it");
      known.ours = it->second.slab;
    }
    from_peer_.emplace(peer_id, std::move(known));
  }
  if (next_fd != fds.size()) broken("a slab introduction carries descriptors it does not name");
}

IncomingBlocks PeerMemory::accept_blocks(std::span<const BlockEntry> table) {
  std::vector<std::shared_ptr<Storage>> storages;
  storages.reserve(table.size());
  std::vector<std::uint64_t> give_back;  // (peer's slab id, offset, 1)... of our blocks it lent us
  for (const BlockEntry& entry : table) {
    std::shared_ptr<Slab> slab;
    bool ours = false;
    {
      std::lock_guard lock(mutex_);
      auto it = from_peer_.find(entry.slab);
      if (it == from_peer_.end())
        broken("a message names slab " + std::to_string(entry.slab) + ", which was never introduced");
      ours = !it->second.theirs;
      slab = ours ? it->second.ours.lock() : it->second.theirs;
      if (it->second.lent_by_peer) give_back.insert(give_back.end(), {entry.slab, entry.offset, 1});
    }
    std::shared_ptr<Storage> storage;
    if (ours) {
      // A block of ours coming home: one we lent, still held for the peer.
      storage = slab ? slab->live_block(entry.offset) : nullptr;
      if (!storage || storage->size() != entry.bytes)
        broken("a message returns block " + std::to_string(entry.offset) + " of slab " + std::to_string(entry.slab) +
               ", which is not one lent to it");
    } else {
      storage = slab->receive_block(entry.offset, entry.bytes);
      if (!storage)
        broken("a message names block [" + std::to_string(entry.offset) + ", +" + std::to_string(entry.bytes) +
               ") of a slab of " + std::to_string(slab->size()) + " bytes, which is not a block there");
      bool first;
      {
        std::lock_guard lock(mutex_);
        first = borrowed_.borrow(storage->id(), {}, entry.slab, entry.offset);
      }
      if (first) storage->notify_on_release(shared_from_this());
    }
    storages.push_back(std::move(storage));
  }
  if (!give_back.empty()) {  // we hold our own blocks already: the peer's hold ends at once
    std::unique_lock lock(mutex_);
    due_.blocks.insert(due_.blocks.end(), give_back.begin(), give_back.end());
    release_due(lock);
  }
  return IncomingBlocks(std::move(storages));
}

void PeerMemory::accept_release(std::span<const std::byte> payload) {
  ReleaseView release = ReleaseView::read(payload);
  if (release.empty()) return;  // most results: no lock taken
  // Destroyed after the lock is let go (a storage's release calls back into us); the vector is
  // kept for the next release, which this conversation's thread alone reads.
  DroppedStorages dropped_blocks = std::move(dropped_scratch_);
  std::vector<std::shared_ptr<Slab>> dropped_slabs;
  {
    std::lock_guard lock(mutex_);
    for (std::size_t i = 0; i < release.block_count(); ++i) {
      auto [slab, offset, count] = release.block(i);
      if (!lent_.came_home(slab, offset, count, dropped_blocks))
        broken("the peer releases block " + std::to_string(offset) + " of slab " + std::to_string(slab) +
               " more often than it was lent");
    }
    for (std::size_t i = 0; i < release.slab_count(); ++i) {
      auto it = from_peer_.find(release.slab(i));
      if (it == from_peer_.end()) continue;  // a slab we were never told of: nothing to forget
      if (it->second.theirs) {
        peer_name_.erase(it->second.theirs->id());
        dropped_slabs.push_back(std::move(it->second.theirs));
      }
      from_peer_.erase(it);
    }
  }
  dropped_blocks.clear();
  dropped_scratch_ = std::move(dropped_blocks);
}

PeerMemory::Release PeerMemory::take_release() {
  if (!release_pending_.load(std::memory_order_acquire)) return {};  // most calls: no lock taken
  std::lock_guard lock(mutex_);
  release_pending_.store(false, std::memory_order_relaxed);
  return std::exchange(due_, {});
}

void PeerMemory::restore(Release release) {
  std::lock_guard lock(mutex_);
  due_.blocks.insert(due_.blocks.end(), release.blocks.begin(), release.blocks.end());
  due_.slabs.insert(due_.slabs.end(), release.slabs.begin(), release.slabs.end());
  release_pending_.store(!due_.empty(), std::memory_order_release);
}

void PeerMemory::on_release_due(std::function<void(PeerMemory&)> callback) {
  std::lock_guard lock(mutex_);
  on_release_due_ = std::make_shared<const std::function<void(PeerMemory&)>>(std::move(callback));
}

void PeerMemory::peer_gone() {
  DroppedStorages lent;  // destroyed after the lock is let go
  std::unordered_map<std::uint64_t, PeerSlab> from_peer;
  std::lock_guard lock(mutex_);
  lent_.clear(lent);
  from_peer.swap(from_peer_);
  introduced_.clear();
  peer_name_.clear();
  borrowed_.clear();
  due_ = {};
  release_pending_.store(false, std::memory_order_relaxed);
}

void PeerMemory::storage_released(std::uint64_t storage_id) {
  if (current_pid() != owner_) return;
  std::unique_lock lock(mutex_);
  auto home = borrowed_.released(storage_id);
  if (!home) return;
  due_.blocks.insert(due_.blocks.end(), {home->slab, home->offset, home->count});
  release_due(lock);
}

void PeerMemory::slab_released(std::uint64_t slab_id) {
  if (current_pid() != owner_) return;
  std::unique_lock lock(mutex_);
  peer_name_.erase(slab_id);
  if (introduced_.erase(slab_id) == 0) return;
  due_.slabs.push_back(slab_id);
  release_due(lock);
}

void PeerMemory::release_due(std::unique_lock<std::mutex>& lock) {
  release_pending_.store(true, std::memory_order_release);
  std::shared_ptr<const std::function<void(PeerMemory&)>> callback = on_release_due_;  // no copy of the function
  lock.unlock();
  if (callback) (*callback)(*this);
}

}  // namespace forkpool::detail
