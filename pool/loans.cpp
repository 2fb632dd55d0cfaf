#include <forkpool/pool/internal/loans.hpp>

#include <unistd.h>

#include <string>

#include <forkpool/runtime/error.hpp>
#include <forkpool/runtime/internal/process.hpp>

namespace forkpool::detail {

std::uint64_t MessageLoan::lend(const std::shared_ptr<Storage>& storage) {
  if (index_.try_emplace(storage->id(), storages_.size()).second) storages_.push_back(storage);
  return storage->id();
}

std::shared_ptr<Storage> MessageLoan::find(std::uint64_t id) const {
  auto it = index_.find(id);
  return it == index_.end() ? nullptr : storages_[it->second];
}

std::optional<StorageReference> MessageLoan::reference(const std::shared_ptr<Storage>& storage) {
  if (storage->strategy() != SharingStrategy::file_descriptor) return std::nullopt;
  return StorageReference{lend(storage), false};
}

std::shared_ptr<Storage> MessageLoan::resolve(StorageReference ref) const {
  return ref.returned ? find(ref.id) : nullptr;
}

PeerLoans::PeerLoans() : owner_(current_pid()) {}

PeerLoans::Handover PeerLoans::lend(const MessageLoan& loan) {
  Handover handover;
  std::vector<const std::shared_ptr<Storage>*> fresh;
  {
    std::lock_guard lock(mutex_);
    for (const auto& storage : loan.storages()) {
      if (!held_.insert(storage->id()).second) continue;
      handover.fds.push_back(storage->fd());
      handover.new_ids.push_back(storage->id());
      fresh.push_back(&storage);
    }
  }
  // Outside the lock: the storage takes its own lock, and its release calls back into ours.
  for (const auto* storage : fresh) (*storage)->notify_on_release(shared_from_this());
  return handover;
}

void PeerLoans::unlend(std::span<const std::uint64_t> ids) {
  std::lock_guard lock(mutex_);
  for (std::uint64_t id : ids) held_.erase(id);
}

std::vector<std::uint64_t> PeerLoans::take_released() {
  std::lock_guard lock(mutex_);
  return std::exchange(released_, {});
}

void PeerLoans::keep_released(std::span<const std::uint64_t> ids) {
  std::lock_guard lock(mutex_);
  released_.insert(released_.end(), ids.begin(), ids.end());
}

void PeerLoans::on_release(std::function<void(PeerLoans&)> callback) {
  std::lock_guard lock(mutex_);
  on_release_ = std::move(callback);
}

void PeerLoans::storage_released(std::uint64_t id) {
  if (current_pid() != owner_) return;
  std::function<void(PeerLoans&)> callback;
  {
    std::lock_guard lock(mutex_);
    if (held_.erase(id) == 0) return;
    released_.push_back(id);
    callback = on_release_;
  }
  if (callback) callback(*this);
}

std::size_t BorrowedStorages::begin_message(std::span<const std::uint64_t> ids, std::span<UniqueFd> fds) {
  current_.clear();
  std::size_t taken = 0;
  for (std::uint64_t id : ids) {
    auto it = held_.find(id);
    if (it == held_.end()) {
      if (taken == fds.size())
        throw ProtocolError("forkpool: a message lends storage " + std::to_string(id) +
                            " without its descriptor, and it is not held here");
      it = held_.emplace(id, Storage::adopt_memfd(std::move(fds[taken++]), 0)).first;
    }
    current_.emplace(it->second.get(), id);
  }
  return taken;
}

std::shared_ptr<Storage> BorrowedStorages::find(std::uint64_t id) const {
  auto it = held_.find(id);
  if (it == held_.end() || !current_.contains(it->second.get())) return nullptr;
  return it->second;
}

std::optional<std::uint64_t> BorrowedStorages::lent_id_of(const Storage& storage) const {
  auto it = current_.find(&storage);
  return it == current_.end() ? std::nullopt : std::optional(it->second);
}

std::optional<StorageReference> BorrowedStorages::reference(const std::shared_ptr<Storage>& storage) {
  if (auto id = lent_id_of(*storage)) return StorageReference{*id, true};
  return std::nullopt;
}

std::shared_ptr<Storage> BorrowedStorages::resolve(StorageReference ref) const {
  return ref.returned ? nullptr : find(ref.id);
}

void BorrowedStorages::release(std::span<const std::uint64_t> ids) {
  for (std::uint64_t id : ids)
    if (held_.erase(id) == 0)
      throw ProtocolError("forkpool: the lender released storage " + std::to_string(id) + ", which is not held here");
}

}  // namespace forkpool::detail
