#pragma once
// Blocking waits on a descriptor with a deadline, for the plain (not loop) calls of queues and
// events: poll(2), never a busy wait.

#include <forkpool/sync/queue.hpp>

namespace forkpool::detail {

// Deadline and deadline_unless_forever() are in runtime/internal/deadline.hpp.

// Waits until `fd` has `events` (POLLIN, POLLOUT) or `deadline` passes (false). Signals are
// waited through. Throws std::system_error naming `who`.
//
// When the calling thread's loop has work in flight and nothing drives it (a pool's replies, the
// jobs queued behind them), the wait drives it, as AsyncResult::get() does: coroutines resume
// inside this call. Otherwise a pool's queued tasks would wait for the wait to end, and a task
// that is to put the awaited item could never start (Python's Pool feeds its workers from a
// thread). Inside a coroutine on that loop the wait blocks the thread, as before.
bool wait_for_fd(int fd, short events, Deadline deadline, const char* who);
// poll(2)'s timeout for `deadline`: -1 for none, else the milliseconds left, rounded up.
int poll_timeout(Deadline deadline);

}  // namespace forkpool::detail
