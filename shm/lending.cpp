#include <forkpool/shm/private/lending.hpp>

#include <forkpool/shm/internal/slab.hpp>

namespace forkpool::detail {

void LentBlocks::lend(const std::shared_ptr<Storage>& storage) {
  std::pair<std::uint64_t, std::uint64_t> key{storage->slab()->id(), storage->slab_offset()};
  auto it = lent_.lower_bound(key);
  if (it == lent_.end() || it->first != key) {
    if (spare_.empty()) {
      it = lent_.emplace_hint(it, key, Lent{storage, 0});
    } else {
      spare_.key() = key;
      spare_.mapped() = Lent{storage, 0};
      it = lent_.insert(it, std::move(spare_));
    }
  }
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
