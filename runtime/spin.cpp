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
  recent_gaps_[next_gap_] = gap;
  next_gap_ = (next_gap_ + 1) % kRecentGaps;
  // A gap within the bound raises the budget to cover twice it (never lowers it: one quick answer
  // says little about the next); a longer one halves it.
  if (gap <= bound_)
    budget_ = std::max(budget_, std::min(bound_, 2 * gap + std::chrono::microseconds(1)));
  else
    budget_ /= 2;
  if (budget_ < std::chrono::microseconds(1)) budget_ = {};
}

bool spin_takes_a_busy_cpu(std::size_t busy, std::chrono::nanoseconds typical_gap) noexcept {
  // Counted once: a system call per wait would cost what the spin saves.
  static const std::size_t cpus = [] {
    cpu_set_t set;
    return sched_getaffinity(0, sizeof set, &set) == 0 ? static_cast<std::size_t>(CPU_COUNT(&set)) : std::size_t{1};
  }();
  return busy >= cpus && typical_gap > kLongWait;
}

std::uint64_t spin_polls() noexcept { return g_spin_polls.load(std::memory_order_relaxed); }
void count_spin_polls(std::uint64_t polls) noexcept { g_spin_polls.fetch_add(polls, std::memory_order_relaxed); }

}  // namespace forkpool::detail
