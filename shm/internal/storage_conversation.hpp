#pragma once
// What one conversation between two processes remembers about storages, for codec<Tensor>: a
// storage the peer already maps crosses as an id instead of a descriptor. shm/ defines the
// interface; the pool implements both sides of it (pool/internal/loans.hpp).

#include <cstdint>
#include <memory>
#include <optional>

#include <forkpool/ipc/codec.hpp>
#include <forkpool/shm/internal/storage.hpp>

namespace forkpool::detail {

// How a storage is named by id in a message.
struct StorageReference {
  std::uint64_t id;
  // False: lent by the sender (this message or an earlier one of the conversation). True: the
  // receiver's own storage, which it lent to the message this one answers.
  bool returned;
};

class StorageConversation : public CodecContext {
 public:
  // Writing: the reference `storage` crosses under, or nullopt when it must carry its
  // descriptor or name.
  virtual std::optional<StorageReference> reference(const std::shared_ptr<Storage>& storage) = 0;
  // Reading: the storage `ref` names in this conversation, or null when it names none.
  virtual std::shared_ptr<Storage> resolve(StorageReference ref) const = 0;
};

}  // namespace forkpool::detail
