#pragma once
// Blocking waits: the calling thread drives its own loop until a condition holds.

#include <chrono>
#include <functional>
#include <optional>

namespace forkpool::detail {

// Drives the calling thread's loop (outside any coroutine) until `ready()` or `timeout` passes;
// true if ready. std::logic_error naming `who` when called from inside a coroutine on the loop.
bool drive_loop_until(const std::function<bool()>& ready, std::optional<std::chrono::nanoseconds> timeout,
                      const char* who);

}  // namespace forkpool::detail
