#pragma once
// spawn_detached: starts a Task<void> now and lets it run to its end on its own. The task must
// not throw (it is internal plumbing that reports its failures elsewhere).

#include <coroutine>
#include <exception>

#include "runtime/task.hpp"

namespace forkpool::detail {

struct Detached {
  struct promise_type {
    Detached get_return_object() noexcept { return {}; }
    std::suspend_never initial_suspend() noexcept { return {}; }
    std::suspend_never final_suspend() noexcept { return {}; }
    void return_void() noexcept {}
    void unhandled_exception() noexcept { std::terminate(); }
  };
};

inline Detached spawn_detached(Task<void> task) { co_await std::move(task); }

}  // namespace forkpool::detail
