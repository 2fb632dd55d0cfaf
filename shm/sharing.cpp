#include <forkpool/shm/sharing.hpp>

#include <atomic>

namespace forkpool {
namespace {
std::atomic<SharingStrategy> g_strategy{SharingStrategy::file_descriptor};
}

void set_sharing_strategy(SharingStrategy strategy) { g_strategy.store(strategy, std::memory_order_relaxed); }
SharingStrategy get_sharing_strategy() { return g_strategy.load(std::memory_order_relaxed); }
std::vector<SharingStrategy> get_all_sharing_strategies() {
  return {SharingStrategy::file_descriptor, SharingStrategy::file_system};
}

}  // namespace forkpool
