#pragma once
// Lending storages to a peer process. A memfd storage crosses a conversation with its descriptor
// only the first time; the peer keeps it mapped, under the lender's id for it, until the lender
// releases the storage and says so. A tensor sent again therefore costs neither side a descriptor,
// an mmap or a munmap, and the memory still lives exactly as long as some process holds it (the
// borrower's copy is dropped as soon as the lender's release reaches it).
//
//   lender (a pool's parent)                      borrower (a worker)
//   MessageLoan: the storages one message lends    BorrowedStorages: lender id -> mapped storage,
//   PeerLoans:   which ids one peer holds, and       and which ids the message being served lent
//                the ids released here since
//
// A borrower's reply may name a storage lent by the message it answers by its id alone: the lender
// holds every storage of a message until the reply is decoded (MessageLoan), so the id is live.

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include <forkpool/runtime/internal/unique_fd.hpp>
#include <forkpool/shm/internal/storage.hpp>
#include <forkpool/pool/internal/message_loan.hpp>
#include <forkpool/shm/internal/storage_conversation.hpp>

namespace forkpool::detail {

// The lender's record of what one peer holds. Thread-safe: a storage may be released on any thread.
class PeerLoans final : public StorageReleaseListener, public std::enable_shared_from_this<PeerLoans> {
 public:
  PeerLoans();

  // What a message must carry for the peer to hold all of `loan`: the descriptors of the
  // storages the peer does not hold yet (in loan order), and their ids. The peer is recorded as
  // holding them from now on; call unlend() if the message is not delivered.
  struct Handover {
    std::vector<int> fds;
    std::vector<std::uint64_t> new_ids;
  };
  Handover lend(const MessageLoan& loan);
  void unlend(std::span<const std::uint64_t> ids);

  // Ids of storages released here since the last call, which the peer should drop.
  std::vector<std::uint64_t> take_released();
  // Puts back ids that could not be sent now, to go with the next take_released().
  void keep_released(std::span<const std::uint64_t> ids);
  // Runs, on the releasing thread, whenever a storage the peer holds is released here.
  void on_release(std::function<void(PeerLoans&)> callback);

  void storage_released(std::uint64_t id) override;

 private:

  pid_t owner_;  // a forked child inherits this object, but its releases are not the owner's
  std::mutex mutex_;
  std::unordered_set<std::uint64_t> held_;
  std::vector<std::uint64_t> released_;
  std::function<void(PeerLoans&)> on_release_;
};

// The borrower's side: storages a peer lent, kept mapped until the peer releases them.
class BorrowedStorages final : public StorageConversation {
 public:
  // Starts serving a message that lends `ids`; the storages new here arrive as the first of
  // `fds`, in order. Returns how many descriptors that took. Throws ProtocolError when a new id
  // has no descriptor or the descriptor is not a valid storage.
  std::size_t begin_message(std::span<const std::uint64_t> ids, std::span<UniqueFd> fds);
  // The storage the current message lent under `id`, or null.
  std::shared_ptr<Storage> find(std::uint64_t id) const;
  // The lender's id for `storage` if the current message lent it: a reply names it by that id.
  std::optional<std::uint64_t> lent_id_of(const Storage& storage) const;
  // Drops the storages the lender released. Throws ProtocolError for an id not held.
  void release(std::span<const std::uint64_t> ids);

  // A reply names what the current message lent by the lender's id (returned).
  std::optional<StorageReference> reference(const std::shared_ptr<Storage>& storage) override;
  // The current message may name what it lends; nothing else.
  std::shared_ptr<Storage> resolve(StorageReference ref) const override;

 private:
  std::unordered_map<std::uint64_t, std::shared_ptr<Storage>> held_;
  std::unordered_map<const Storage*, std::uint64_t> current_;  // lent by the current message
};

}  // namespace forkpool::detail
