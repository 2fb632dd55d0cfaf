#include <forkpool/shm/private/lending.hpp>

#include <forkpool/shm/internal/slab.hpp>

namespace forkpool::detail {

void LentBlocks::lend(const std::shared_ptr<Storage>& storage) {
  std::pair<std::uint64_t, std::uint64_t> key{storage->slab()->id(), storage->slab_offset()};
  auto it = lent_.find(key);
  if (it == lent_.end()) it = insert_reusing(lent_, spare_, key, Lent{storage, 0});
  ++it->second.count;
}

bool LentBlocks::came_home(std::uint64_t slab, std::uint64_t offset, std::uint64_t count, DroppedStorages& dropped) {
  auto it = lent_.find({slab, offset});
  if (it == lent_.end() || count == 0 || count > it->second.count) return false;
  if ((it->second.count -= count) > 0) return true;
  dropped.push_back(std::move(it->second.storage));
  spare_ = lent_.extract(it);
  return true;
}

void LentBlocks::clear(DroppedStorages& dropped) {
  for (auto& [key, lent] : lent_) dropped.push_back(std::move(lent.storage));
  lent_.clear();
}

}  // namespace forkpool::detail
