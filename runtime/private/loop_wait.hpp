#pragma once
// Work a loop does while it waits for its peers (forkpool-torch makes the next decode's TensorImpl
// there): done when a blocking turn of a loop with spinners (a pool's) finds nothing to handle,
// before it spins or sleeps, so it is off the path of the message the loop waits for.

namespace forkpool::detail {

// Runs on the thread of whichever loop waits, any number of times: it must be thread-safe, cheap
// when it has nothing to do, and not throw.
using LoopWaitHook = void (*)() noexcept;

// From now on, `hook` runs on every loop, on any thread, when it is about to wait as above.
// Registering a hook again does nothing; std::length_error past a handful of hooks. Any thread.
void at_every_loop_wait(LoopWaitHook hook);

// The loop's side (loop.cpp): runs each hook registered so far.
void run_loop_wait_hooks() noexcept;

}  // namespace forkpool::detail
