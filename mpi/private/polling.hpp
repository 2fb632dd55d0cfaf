#pragma once
// MPI gives no descriptor to wait on, and its blocking calls spin a core. So a rank with MPI
// work outstanding polls it from a loop timer: soon after activity, then backing off to 1 ms.

#include <algorithm>
#include <chrono>

#include <forkpool/runtime/loop.hpp>
#include <forkpool/runtime/task.hpp>

namespace forkpool::mpi::detail {

inline constexpr std::chrono::microseconds kFirstPoll{20};
inline constexpr std::chrono::microseconds kSlowestPoll{1000};

// Calls step() (true: it found work) on the loop, waiting kFirstPoll after activity and twice
// as long after each idle step up to kSlowestPoll, while keep_going() holds. The first step comes
// after the first wait, never inline in the caller that starts it.
template <class Step, class KeepGoing>
Task<void> poll_with_backoff(Step step, KeepGoing keep_going) {
  std::chrono::microseconds delay = kFirstPoll;
  while (keep_going()) {
    co_await sleep_for(delay);
    delay = step() ? kFirstPoll : std::min(delay * 2, kSlowestPoll);
  }
}

}  // namespace forkpool::mpi::detail
