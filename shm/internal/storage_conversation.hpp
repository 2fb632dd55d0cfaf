#pragma once
// What codec<Tensor> needs from a conversation between two processes that carries blocks of
// slabs: each message has a table of the blocks it carries, and a tensor names its storage by
// its place in that table. shm/ defines the interface; the pool implements it
// (shm/private/peer_memory.hpp).

#include <cstdint>
#include <memory>
#include <optional>

#include <forkpool/ipc/codec.hpp>
#include <forkpool/shm/internal/storage.hpp>

namespace forkpool::detail {

class StorageConversation : public CodecContext {
 public:
  StorageConversation() noexcept : CodecContext(&kKind) {}
  // The context's own conversation, or null when it is none (or there is no context).
  static StorageConversation* of(CodecContext* context) noexcept {
    return context && context->kind() == &kKind ? static_cast<StorageConversation*>(context) : nullptr;
  }

  // Writing: the index in the message's table under which `storage` (a block of a slab)
  // crosses; nullopt when this conversation carries no blocks.
  virtual std::optional<std::uint32_t> block_index(const std::shared_ptr<Storage>& storage) = 0;
  // Reading: the storage at `index` of the message's table, or null when there is none.
  virtual std::shared_ptr<Storage> block_at(std::uint32_t index) const = 0;

 private:
  static const char kKind;  // its address is the kind (one definition, in libforkpool)
};

}  // namespace forkpool::detail
