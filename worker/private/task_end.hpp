#pragma once
// What a codec may keep from one task to the next in a pool worker (forkpool-torch keeps the
// libtorch objects of the tensors it decoded, to reuse them): kept objects let go of their blocks
// when the task ends, so what a task let go of still goes home with its result.

namespace forkpool::detail {

using TaskEndHook = void (*)() noexcept;

// True on a pool worker's serving thread while a task runs there (its arguments decoded, the
// function run, its result encoded). False everywhere else: the parent, other threads, and a
// Process's function (its task has no end to let go at).
bool in_pool_task() noexcept;

// From now on, `hook` runs on that thread at the end of every task: after the task's arguments
// and result are destroyed, before what they held is taken for the parent. Registering a hook
// again does nothing. Call it within a task (in_pool_task()); elsewhere it does nothing.
void at_every_task_end(TaskEndHook hook);

// The worker's side (worker.cpp): a task of a pool runs between these. end_pool_task runs the
// hooks; after a begin that was not a pool's, it does nothing.
void begin_pool_task() noexcept;
void end_pool_task() noexcept;

}  // namespace forkpool::detail
