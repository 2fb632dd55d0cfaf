#pragma once
// Scope: structured concurrency for tasks nobody awaits. start() runs a task on the calling
// thread's loop without waiting for it; join() completes once every task started in the scope
// has ended, and rethrows the first exception one of them threw. A host loop's way to start
// forkpool work, and the pool's own way to run its background coroutines.
//
//   forkpool::Scope scope;
//   scope.start(serve(client));          // runs until its first suspension, then returns
//   ...
//   co_await scope.join();               // all ended; the first failure rethrown here
//
// A Scope is used on one thread. A task started in it resumes where its awaited operations
// complete (inside the loop's turn); join()'s awaiter resumes inside the completion of the last
// task to end. A Scope destroyed with tasks still running leaves them running to their end; a
// failure nobody joined is reported on stderr.

#include <cstddef>
#include <memory>

#include <forkpool/runtime/task.hpp>

namespace forkpool {

class Scope {
 public:
  Scope();
  ~Scope();
  Scope(const Scope&) = delete;
  Scope& operator=(const Scope&) = delete;

  // Starts `task` now; it runs inline until its first suspension.
  void start(Task<void> task);
  // Completes when no task of the scope is running (at once if none is); rethrows the first
  // exception a task threw since the last join.
  Task<void> join();
  // Tasks started and not yet ended.
  std::size_t active() const noexcept;

  struct State;  // shared with the tasks running in the scope (scope.cpp)

 private:
  std::shared_ptr<State> state_;
};

}  // namespace forkpool
