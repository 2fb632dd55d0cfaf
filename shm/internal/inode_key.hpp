#pragma once
// A file's identity across processes: what a mapping already held here is found again by.

#include <sys/types.h>

#include <cstddef>
#include <functional>

namespace forkpool::detail {

struct InodeKey {
  dev_t device;
  ino_t inode;
  bool operator==(const InodeKey&) const = default;
};
struct InodeHash {
  std::size_t operator()(const InodeKey& k) const noexcept { return std::hash<ino_t>()(k.inode) * 31 + k.device; }
};

}  // namespace forkpool::detail
