#include <forkpool/runtime/private/inherited_fds.hpp>

#include <algorithm>

namespace forkpool::detail {
namespace {

std::vector<int>& kept_registry() {
  static std::vector<int> kept;
  return kept;
}

}  // namespace

void keep_in_helpers(int fd) {
  auto& kept = kept_registry();
  kept.insert(std::upper_bound(kept.begin(), kept.end(), fd), fd);
}
std::vector<int> kept_in_helpers() { return kept_registry(); }

}  // namespace forkpool::detail
