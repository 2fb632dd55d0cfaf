#pragma once
// MessageLoan: the storages one task message lends to a worker (see loans.hpp for the protocol).

#include <cstdint>
#include <memory>
#include <optional>
#include <unordered_map>
#include <vector>

#include <forkpool/shm/internal/storage_conversation.hpp>

namespace forkpool::detail {

// The storages one message lends, in the order first lent. The Writer context for encoding the
// message (codec<Tensor> lends memfd storages to it) and the Reader context for decoding the reply.
class MessageLoan final : public StorageConversation {
 public:
  // Adds `storage` (once) and returns the id it is lent under.
  std::uint64_t lend(const std::shared_ptr<Storage>& storage);
  // The storage this message lent under `id`, or null.
  std::shared_ptr<Storage> find(std::uint64_t id) const;

  // Only memfds are lent: the kernel frees them whoever dies. A borrower of a named segment
  // would add to its count of holders, which a killed borrower never gives back.
  std::optional<StorageReference> reference(const std::shared_ptr<Storage>& storage) override;
  // The reply may name what this message lent (returned); nothing else.
  std::shared_ptr<Storage> resolve(StorageReference ref) const override;
  const std::vector<std::shared_ptr<Storage>>& storages() const noexcept { return storages_; }

 private:
  std::vector<std::shared_ptr<Storage>> storages_;
  std::unordered_map<std::uint64_t, std::size_t> index_;  // id -> position in storages_
};

}  // namespace forkpool::detail
