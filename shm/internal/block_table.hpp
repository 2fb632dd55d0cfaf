#pragma once
// The table of blocks a message carries: its tensors name their storages by place in it, each
// entry (the sender's slab id, offset, bytes). The same for every way a message crosses (a
// pool's conversation with a worker, a queue, mpi); what the names mean on arrival is the
// lending's (peer_memory.hpp, queue_memory.hpp).
//
//   message:  [body][entry]...[u32 number of entries]
//   and a release may ride at its end: [message][release][u32 its length]

#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <span>
#include <unordered_map>
#include <utility>
#include <vector>

#include <forkpool/ipc/codec.hpp>
#include <forkpool/shm/internal/storage.hpp>
#include <forkpool/shm/internal/storage_conversation.hpp>

namespace forkpool::detail {

// One entry of a message's table of blocks, in the sender's terms.
struct BlockEntry {
  std::uint64_t slab;
  std::uint64_t offset;
  std::uint64_t bytes;
};

// The blocks one outgoing message carries, in the order first named. The Writer's context; holds
// the storages until it is dropped (a job keeps it until its result is decoded).
class OutgoingBlocks final : public StorageConversation {
 public:
  std::optional<std::uint32_t> block_index(const std::shared_ptr<Storage>& storage) override;
  std::shared_ptr<Storage> block_at(std::uint32_t) const override { return nullptr; }

  const std::vector<std::shared_ptr<Storage>>& storages() const noexcept { return storages_; }
  // Lets go of the storages (once the table is written and the blocks lent).
  void clear() noexcept {
    storages_.clear();
    index_.clear();
  }
  // Appends the table to a message: [slab, offset, bytes]... [u32 number of entries].
  void write_table(Writer& w) const;
  // Bytes write_table() appends.
  std::size_t table_bytes() const noexcept;

 private:
  // A message of a few blocks finds a repeated one by a scan (a hash table would cost its
  // allocations on every message); from this many on it indexes them.
  static constexpr std::size_t kIndexedFrom = 16;

  std::vector<std::shared_ptr<Storage>> storages_;
  std::unordered_map<const Storage*, std::uint32_t> index_;  // empty below kIndexedFrom
};

// The blocks a received message carries, resolved here: the Reader's context.
class IncomingBlocks final : public StorageConversation {
 public:
  explicit IncomingBlocks(std::vector<std::shared_ptr<Storage>> storages) : storages_(std::move(storages)) {}
  std::optional<std::uint32_t> block_index(const std::shared_ptr<Storage>&) override { return std::nullopt; }
  std::shared_ptr<Storage> block_at(std::uint32_t index) const override {
    return index < storages_.size() ? storages_[index] : nullptr;
  }
  const std::vector<std::shared_ptr<Storage>>& storages() const noexcept { return storages_; }

 private:
  std::vector<std::shared_ptr<Storage>> storages_;
};

// A message's payload split from its table of blocks. Throws ProtocolError when the table does not fit.
struct TabledPayload {
  std::span<const std::byte> body;
  std::vector<BlockEntry> table;
};
TabledPayload split_block_table(std::span<const std::byte> payload);

// What a release says: blocks let go here and the sender's slabs gone here (PeerMemory).
struct BlockRelease {
  std::vector<std::uint64_t> blocks;  // (peer's slab id, offset, count)...
  std::vector<std::uint64_t> slabs;   // the sender's slab ids
  bool empty() const noexcept { return blocks.empty() && slabs.empty(); }
  void encode_to(Writer& w) const;  // as encode(std::pair(blocks, slabs))
  Writer encode() const;            // a release message's payload
};

// A release read where it lies, as BlockRelease::encode_to wrote it: reading one costs no
// vectors (a release per tensor). read() throws ProtocolError when the payload is not one release.
class ReleaseView {
 public:
  struct Block {
    std::uint64_t slab, offset, count;
  };
  static ReleaseView read(std::span<const std::byte> payload);
  bool empty() const noexcept { return blocks_.empty() && slabs_.empty(); }
  std::size_t block_count() const noexcept { return blocks_.size() / (3 * sizeof(std::uint64_t)); }
  Block block(std::size_t i) const noexcept {
    return {word(blocks_, 3 * i), word(blocks_, 3 * i + 1), word(blocks_, 3 * i + 2)};
  }
  std::size_t slab_count() const noexcept { return slabs_.size() / sizeof(std::uint64_t); }
  std::uint64_t slab(std::size_t i) const noexcept { return word(slabs_, i); }

 private:
  static std::uint64_t word(std::span<const std::byte> words, std::size_t i) noexcept {
    std::uint64_t value;
    std::memcpy(&value, words.data() + i * sizeof value, sizeof value);
    return value;
  }
  std::span<const std::byte> blocks_, slabs_;  // unaligned: read with memcpy
};

// A release may ride at the end of another message (a worker's result: what its task let go of
// costs no message of its own): [release][u32 its length]. Appends it, written in place (a task
// that let go of nothing costs no allocation); and splits it off again (the release, then the
// rest), throwing ProtocolError when it does not fit.
void append_release(Writer& w, const BlockRelease& release);
std::pair<std::span<const std::byte>, std::span<const std::byte>> split_release(std::span<const std::byte> payload);

}  // namespace forkpool::detail
