#include <forkpool/shm/private/lending.hpp>

#include <forkpool/shm/internal/slab.hpp>

namespace forkpool::detail {

void LentBlocks::lend(const std::shared_ptr<Storage>& storage) {
  Lent& lent = lent_[{storage->slab()->id(), storage->slab_offset()}];
  if (!lent.storage) lent.storage = storage;
  ++lent.count;
}

bool LentBlocks::came_home(std::uint64_t slab, std::uint64_t offset, std::uint64_t count, DroppedStorages& dropped) {
  auto it = lent_.find({slab, offset});
  if (it == lent_.end() || count == 0 || count > it->second.count) return false;
  if ((it->second.count -= count) > 0) return true;
  dropped.push_back(std::move(it->second.storage));
  lent_.erase(it);
  return true;
}

void LentBlocks::clear(DroppedStorages& dropped) {
  for (auto& [key, lent] : lent_) dropped.push_back(std::move(lent.storage));
  lent_.clear();
}

}  // namespace forkpool::detail
