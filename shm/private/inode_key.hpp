#pragma once
// A file's identity across processes: what a mapping already held here is found again by.

#include <sys/types.h>

#include <cstddef>
#include <functional>
#include <memory>
#include <unordered_map>

namespace forkpool::detail {

struct InodeKey {
  dev_t device;
  ino_t inode;
  bool operator==(const InodeKey&) const = default;
};
struct InodeHash {
  std::size_t operator()(const InodeKey& k) const noexcept { return std::hash<ino_t>()(k.inode) * 31 + k.device; }
};

// What this process holds, by the file it maps or names: a descriptor received again finds the
// object made for it the first time. Weak: the cache keeps nothing alive. Not thread-safe: the
// caller locks.
template <class T>
class InodeCache {
 public:
  std::shared_ptr<T> find(const InodeKey& key) const {
    auto it = by_inode_.find(key);
    return it == by_inode_.end() ? nullptr : it->second.lock();
  }
  void remember(const InodeKey& key, const std::shared_ptr<T>& object) { by_inode_[key] = object; }
  // From the object's destructor: its entry goes unless a newer object took the key.
  void forget_expired(const InodeKey& key) {
    auto it = by_inode_.find(key);
    if (it != by_inode_.end() && it->second.expired()) by_inode_.erase(it);
  }
  // Calls `f(T&)` on each object still alive.
  template <class F>
  void for_each_alive(F f) const {
    for (const auto& [key, weak] : by_inode_)
      if (auto object = weak.lock()) f(*object);
  }
  void clear() noexcept { by_inode_.clear(); }  // a forked child: the parent's entries are not ours

 private:
  std::unordered_map<InodeKey, std::weak_ptr<T>, InodeHash> by_inode_;
};

}  // namespace forkpool::detail
