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

// As drive_loop_until, for what only the loop of the thread that started it completes (a pool's
// result, a process's outcome): on a thread that has no loop, a wait that is not already over is
// refused (refuse_wait_without_loop) instead of lasting for ever.
bool drive_owners_loop_until(const std::function<bool()>& ready, std::optional<std::chrono::nanoseconds> timeout,
                             const char* who);

// Whether the calling thread has a loop (it has made a pool, run a task, or waited on one).
bool thread_has_loop() noexcept;
// For a pool's result or stream, not ready, waited for on a thread that has no loop: its pool's
// thread's loop completes it, never this thread, so the wait would last for ever. Throws
// std::logic_error naming `who` and the rule.
[[noreturn]] void refuse_wait_without_loop(const char* who);

// Runs what the calling thread's loop has ready, without waiting: unless the thread has no loop,
// or something drives it now (a coroutine on it, a turn, a host's run_ready). A program that
// polls a result outside any coroutine (`while (!r.ready()) ...`) then sees the pool's work go
// on and finish, as Python's result-handler thread would have made it.
void run_ready_work_if_idle();

}  // namespace forkpool::detail
