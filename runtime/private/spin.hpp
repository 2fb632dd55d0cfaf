#pragma once
// Polling before sleeping. A side that expects a message soon polls for it for a while instead
// of sleeping in the kernel: on these VMs a sleep and wake-up across CPUs costs ~25 µs a hop,
// a cache line crosses in ~0.1 µs. AdaptiveSpin chooses how long; a Spinner lets the loop poll
// a source (a worker's ring) before it blocks (LoopInternals::add_spinner).

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <optional>

#include <sched.h>

namespace forkpool::detail {

// One polite busy-wait step: tells the CPU we spin (the sibling hyperthread runs, power drops).
inline void cpu_relax() noexcept {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// How long one waiting side polls before it sleeps. Not thread-safe: one per waiter.
//
// The bound is PoolOptions::spin: empty means adaptive up to kDefaultSpinBound, zero never
// spins. Within the bound the budget follows what the waits saw: a message that came `gap`
// after the wait began raises the budget to at least twice that gap (spinning would have caught
// it, or did); a wait longer than the bound halves it, so a side whose peer works for long stops
// burning a CPU after a few waits. A spin that lost the CPU (a gap between two polls far
// longer than a poll: another runnable process took it) turns spinning off for
// kPreemptedCooldown waits, so oversubscribed machines do not pay for it.
class AdaptiveSpin {
 public:
  static constexpr std::chrono::nanoseconds kDefaultSpinBound = std::chrono::microseconds(50);
  static constexpr std::chrono::nanoseconds kPreemptionGap = std::chrono::microseconds(200);
  static constexpr int kPreemptedCooldown = 64;

  explicit AdaptiveSpin(std::optional<std::chrono::nanoseconds> bound = {}) noexcept;

  // How long the next wait may poll; zero: sleep at once.
  std::chrono::nanoseconds budget() const noexcept { return cooldown_ > 0 ? std::chrono::nanoseconds{0} : budget_; }
  // The wait that began `gap` ago ended with a message.
  void record(std::chrono::nanoseconds gap) noexcept;
  // The spin of the current wait lost the CPU.
  void saw_preemption() noexcept { cooldown_ = kPreemptedCooldown; }
  // How long the recent waits lasted at the least: the shortest of the last kRecentGaps gaps (so
  // one wait that was long by chance, a peer preempted, does not count), zero before any.
  static constexpr std::size_t kRecentGaps = 4;
  std::chrono::nanoseconds typical_gap() const noexcept { return *std::ranges::min_element(recent_gaps_); }

 private:
  std::chrono::nanoseconds bound_;
  std::chrono::nanoseconds budget_;
  std::array<std::chrono::nanoseconds, kRecentGaps> recent_gaps_{};
  std::size_t next_gap_ = 0;
  int cooldown_ = 0;
};

// How one spin ended: something came (`found`), the budget ran out, or the CPU was taken away
// (`preempted`: a gap between two clock reads longer than AdaptiveSpin::kPreemptionGap).
struct SpinOutcome {
  bool found = false;
  bool preempted = false;
  std::uint64_t polls = 0;
};

// Calls `look(polls)` (true: something came) until it finds something, `budget` has passed or
// the CPU was taken away, relaxing the CPU between looks and reading the clock only every
// kPollsPerClockRead looks (a look costs nanoseconds, a clock read tens of them).
//
// A spin that lasts past kSpinBeforeYield offers the CPU to another runnable process every
// kPollsPerYield looks (sched_yield; it comes back at once when there is none). With more busy
// processes than CPUs (a parent and two workers on two CPUs) the side that spins often shares
// its CPU with the very process it waits for: without the yield the scheduler splits that CPU
// between the two and the spin halves the rate. Not sooner: a system call costs about 1 µs on
// these VMs, as much as a whole back-to-back round trip.
inline constexpr std::uint64_t kPollsPerClockRead = 16;
inline constexpr std::uint64_t kPollsPerYield = 64;
inline constexpr std::chrono::nanoseconds kSpinBeforeYield = std::chrono::microseconds(2);
template <class Look>
SpinOutcome spin_for(std::chrono::nanoseconds budget, Look look) {
  using Clock = std::chrono::steady_clock;
  SpinOutcome outcome;
  const Clock::time_point began = Clock::now();
  Clock::time_point last = began;
  for (;;) {
    ++outcome.polls;
    if (look(outcome.polls)) {
      outcome.found = true;
      return outcome;
    }
    cpu_relax();
    if (outcome.polls % kPollsPerClockRead != 0) continue;
    Clock::time_point now = Clock::now();
    if (now - last > AdaptiveSpin::kPreemptionGap) {
      outcome.preempted = true;
      return outcome;
    }
    if (now - began >= budget) return outcome;
    last = now;
    // A yield that gave the CPU away for long shows as a gap at the next clock read: the
    // machine is busy with others, and the spin is counted as preempted.
    if (outcome.polls % kPollsPerYield == 0 && now - began >= kSpinBeforeYield) sched_yield();
  }
}

// When every CPU this process may use has a busy peer behind it (`busy` spinners expect a message
// and there are no more CPUs than that), a spin takes its CPU from one of those peers, and the
// scheduler splits it between the two. That pays only while the wait is short: a wait typically
// longer than kLongWait (a wake-up across CPUs costs about 25 µs here) sleeps, and gives the CPU
// to the peers it waits for.
inline constexpr std::chrono::nanoseconds kLongWait = std::chrono::microseconds(10);
bool spin_takes_a_busy_cpu(std::size_t busy, std::chrono::nanoseconds typical_gap) noexcept;

// Polls done by spinning in this process (for tests: spin = 0 must do none).
std::uint64_t spin_polls() noexcept;
void count_spin_polls(std::uint64_t polls) noexcept;

// A source the loop polls before it sleeps in the kernel. Loop thread only.
class Spinner {
 public:
  virtual ~Spinner() = default;
  // How long the loop may poll this before sleeping; zero when no message is expected now.
  virtual std::chrono::nanoseconds spin_budget() = 0;
  // How long its recent waits lasted (AdaptiveSpin::typical_gap).
  virtual std::chrono::nanoseconds typical_gap() const = 0;
  // Looks once; true when it resumed something (a message was there).
  virtual bool poll() = 0;
  // The loop is about to sleep in the kernel: announce it to the peer (who then wakes us through
  // the kernel), and look once more. True when a message came meanwhile: the loop does not sleep.
  virtual bool prepare_to_sleep() = 0;
  // The loop's spin lost the CPU to another process: the machine is oversubscribed.
  virtual void saw_preemption() = 0;
};

}  // namespace forkpool::detail
