#include "shm/storage_loans.hpp"

#include <unistd.h>

#include <algorithm>
#include <string>

#include "runtime/error.hpp"

namespace forkpool {

std::uint64_t MessageLoan::lend(const std::shared_ptr<Storage>& storage) {
  if (std::find(storages_.begin(), storages_.end(), storage) == storages_.end()) storages_.push_back(storage);
  return storage->id();
}

std::shared_ptr<Storage> MessageLoan::find(std::uint64_t id) const {
  for (const auto& storage : storages_)
    if (storage->id() == id) return storage;
  return nullptr;
}

PeerLoans::PeerLoans() : owner_(getpid()) {}

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

void PeerLoans::on_release(std::function<void()> callback) {
  std::lock_guard lock(mutex_);
  on_release_ = std::move(callback);
}

void PeerLoans::released(std::uint64_t id) {
  if (getpid() != owner_) return;
  std::function<void()> callback;
  {
    std::lock_guard lock(mutex_);
    if (held_.erase(id) == 0) return;
    released_.push_back(id);
    callback = on_release_;
  }
  if (callback) callback();
}

std::size_t BorrowedStorages::begin_message(std::span<const std::uint64_t> ids, std::span<UniqueFd> fds) {
  std::size_t taken = 0;
  for (std::uint64_t id : ids) {
    if (held_.contains(id)) continue;
    if (taken == fds.size())
      throw ProtocolError("forkpool: a message lends storage " + std::to_string(id) +
                          " without its descriptor, and it is not held here");
    held_.emplace(id, Storage::adopt_memfd(std::move(fds[taken++]), 0));
  }
  current_.assign(ids.begin(), ids.end());
  return taken;
}

std::shared_ptr<Storage> BorrowedStorages::find(std::uint64_t id) const {
  if (std::find(current_.begin(), current_.end(), id) == current_.end()) return nullptr;
  auto it = held_.find(id);
  return it == held_.end() ? nullptr : it->second;
}

std::optional<std::uint64_t> BorrowedStorages::lent_id_of(const Storage& storage) const {
  for (std::uint64_t id : current_)
    if (auto it = held_.find(id); it != held_.end() && it->second.get() == &storage) return id;
  return std::nullopt;
}

void BorrowedStorages::release(std::span<const std::uint64_t> ids) {
  for (std::uint64_t id : ids)
    if (held_.erase(id) == 0)
      throw ProtocolError("forkpool: the lender released storage " + std::to_string(id) + ", which is not held here");
}

}  // namespace forkpool
