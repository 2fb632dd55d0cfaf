#pragma once
// The blocking waits of the plain (not loop) calls of queues, events, pipes, processes and the
// futex-based primitives (Lock, Semaphore, Condition, Barrier, JoinableQueue::join).
//
// When the calling thread's loop has work in flight and nothing drives it (a pool's replies, the
// jobs queued behind them), each of these waits drives it, as AsyncResult::get() does: coroutines
// resume inside the call. Otherwise a pool's queued tasks would wait for the wait to end, and a
// task that is to put the awaited item, release the unit or notify could never start (Python's
// Pool feeds its workers from a thread). Inside a coroutine on that loop, or with no loop or no
// work, the wait blocks the thread (poll(2), futex(2)) and runs nothing.

#include <chrono>
#include <cstdint>

#include <forkpool/runtime/internal/blocking_wait.hpp>
#include <forkpool/runtime/internal/deadline.hpp>
#include <forkpool/runtime/task.hpp>
#include <forkpool/sync/queue.hpp>

namespace forkpool::detail {

// Deadline and deadline_unless_forever() are in runtime/internal/deadline.hpp.

// Whether a blocking wait on this thread now drives its loop: the loop exists, has work in
// flight, and nothing (run(), get(), a coroutine of its own) drives it already.
bool wait_drives_loop() noexcept;

// Starts `waiting` (its first wait goes on the loop) and drives the loop until it has ended:
// the blocking form of a wait written as a coroutine. Rethrows what it threw.
template <class T>
T drive_until_done(Task<T> waiting, const char* who) {
  waiting.handle().resume();
  drive_loop_until([&] { return waiting.handle().done(); }, std::nullopt, who);
  return waiting.handle().promise().take();
}

// Waits until `fd` has `events` (POLLIN, POLLOUT) or `deadline` passes (false). Signals are
// waited through. Throws std::system_error naming `who`.
bool wait_for_fd(int fd, short events, Deadline deadline, const char* who);
// poll(2)'s timeout for `deadline`: -1 for none, else the milliseconds left, rounded up.
int poll_timeout(Deadline deadline);

// Sleeps on the shared (not private) futex word `word` while it holds `expected`, for at most
// `slice`. Returns early when woken, interrupted, or spuriously: callers look at the word again.
void wait_for_word(const void* word, std::uint32_t expected, std::chrono::nanoseconds slice, const char* who);

// The same wait on the calling thread's loop, for the async forms (and for wait_for_word when it
// drives the loop): resumes on the loop when the word is woken or `deadline` passes. A loop that
// cannot wait on a futex (the epoll backend, Linux before 6.7) looks at the word between its
// turns instead, after pauses growing from kFirstLook to kLongestLook: a wake-up may be seen
// that much later. Throws std::system_error naming `who`.
inline constexpr std::chrono::microseconds kFirstLook{50};
inline constexpr std::chrono::microseconds kLongestLook{10'000};
Task<void> word_changed(const void* word, std::uint32_t expected, Clock::time_point deadline, const char* who);

}  // namespace forkpool::detail
