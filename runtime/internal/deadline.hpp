#pragma once
// Deadlines, one way for the whole library: a time on the steady clock, `deadline_after` a
// duration from now (saturating, so kForever never overflows), and `Deadline`, one that may be
// none, for the blocking waits of queues, pipes and processes.

#include <chrono>
#include <optional>

namespace forkpool::detail {

using Clock = std::chrono::steady_clock;
inline constexpr std::chrono::nanoseconds kForever = std::chrono::nanoseconds::max();

// `from` + `duration`, or the clock's end when that would overflow.
inline Clock::time_point saturating_add(Clock::time_point from, std::chrono::nanoseconds duration) {
  if (duration <= std::chrono::nanoseconds::zero()) return from + duration;
  if (duration >= Clock::time_point::max() - from) return Clock::time_point::max();
  return from + duration;
}

inline Clock::time_point deadline_after(std::chrono::nanoseconds duration) {
  return saturating_add(Clock::now(), duration);
}

// A deadline or none (for ever): `timeout` from now, none for kForever.
using Deadline = std::optional<Clock::time_point>;
inline Deadline deadline_unless_forever(std::chrono::nanoseconds timeout) {
  if (timeout == kForever) return std::nullopt;
  return deadline_after(timeout);
}

}  // namespace forkpool::detail
