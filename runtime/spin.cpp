#include <forkpool/runtime/private/spin.hpp>

#include <algorithm>

namespace forkpool::detail {
namespace {
std::atomic<std::uint64_t> g_spin_polls{0};
}  // namespace

AdaptiveSpin::AdaptiveSpin(std::optional<std::chrono::nanoseconds> bound) noexcept
    : bound_(std::max(bound.value_or(kDefaultSpinBound), std::chrono::nanoseconds{0})), budget_(bound_) {}

void AdaptiveSpin::record(std::chrono::nanoseconds gap) noexcept {
  if (cooldown_ > 0) --cooldown_;
  // A gap within the bound raises the budget to cover twice it (never lowers it: one quick answer
  // says little about the next); a longer one halves it.
  if (gap <= bound_)
    budget_ = std::max(budget_, std::min(bound_, 2 * gap + std::chrono::microseconds(1)));
  else
    budget_ /= 2;
  if (budget_ < std::chrono::microseconds(1)) budget_ = {};
}

std::uint64_t spin_polls() noexcept { return g_spin_polls.load(std::memory_order_relaxed); }
void count_spin_polls(std::uint64_t polls) noexcept { g_spin_polls.fetch_add(polls, std::memory_order_relaxed); }

}  // namespace forkpool::detail
