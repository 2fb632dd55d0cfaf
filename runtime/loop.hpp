#pragma once
// Loop: the calling thread's single-threaded event loop (io_uring, or epoll where io_uring is
// unavailable). Coroutines suspended on its operations are resumed from inside its turns.

#include <chrono>
#include <coroutine>
#include <cstddef>
#include <memory>
#include <stdexcept>
#include <string>

#include "runtime/backend.hpp"
#include "runtime/task.hpp"
#include "runtime/unique_fd.hpp"

namespace forkpool {

class Loop {
 public:
  // The calling thread's loop, made on first use. The backend is io_uring unless the kernel
  // refuses it or FORKPOOL_BACKEND=epoll; FORKPOOL_BACKEND=io_uring makes a refusal an error.
  // In a forked child the parent's loop is left alone and a fresh one is made.
  static Loop& current();

  ~Loop();
  Loop(const Loop&) = delete;
  Loop& operator=(const Loop&) = delete;

  // A descriptor that turns readable when the loop has work; a host loop (epoll, asio, Qt) watches
  // it and then calls run_ready().
  int fd() const;

  // Runs what is ready without blocking; returns how many completions it handled.
  std::size_t run_ready();

  // "io_uring" or "epoll".
  const char* backend_name() const { return backend_->name(); }

  // --- for awaitables and drivers inside forkpool ---
  void start(detail::Operation* op);
  void cancel(detail::Operation* op) { backend_->cancel(op); }
  // Runs one turn: delivers completions, blocking for at least one first if `block`.
  std::size_t turn(bool block);
  // True while a run()/get()/run_ready() on this thread is driving the loop.
  bool driving() const noexcept { return driving_; }
  // Operations started and not yet completed.
  std::size_t outstanding() const noexcept { return backend_->outstanding(); }

  // Work that must finish before the loop may stop (a pool's workers being reaped after
  // terminate). run() returns only once it is zero, and ~Loop drives it down.
  void add_lingering() noexcept { ++lingering_; }
  void end_lingering() noexcept { --lingering_; }
  std::size_t lingering() const noexcept { return lingering_; }

  // Marks the loop as driven for the guard's lifetime; throws std::logic_error if it already is.
  class DriveGuard {
   public:
    explicit DriveGuard(Loop& loop, const char* who);
    ~DriveGuard() { loop_.driving_ = false; }
    DriveGuard(const DriveGuard&) = delete;
    DriveGuard& operator=(const DriveGuard&) = delete;

   private:
    Loop& loop_;
  };

  // Turns until `done()` or until nothing can make progress (then throws std::logic_error).
  template <class Done>
  void drive_until(Done done) {
    while (!done()) {
      if (outstanding() == 0) throw std::logic_error("forkpool: waiting for work that nothing in flight can complete (deadlock)");
      turn(true);
    }
  }

  // Finishes lingering work (see add_lingering). Called by run() and ~Loop.
  void finish_lingering();

 private:
  Loop();
  void flush_if_idle();

  std::unique_ptr<detail::Backend> backend_;
  mutable UniqueFd host_fd_;    // epoll set for fd(): the backend's fd + wake_fd_
  mutable UniqueFd wake_fd_;    // eventfd: soft completions while a host loop waits
  bool driving_ = false;
  bool in_turn_ = false;
  std::size_t lingering_ = 0;
  unsigned generation_;  // the fork generation this loop was made in
};

// Drives the calling thread's loop until `task` ends; returns its value or rethrows. Throws
// std::logic_error when called from inside a coroutine running on the same loop.
template <class T>
T run(Task<T> task) {
  Loop& loop = Loop::current();
  {
    Loop::DriveGuard guard(loop, "forkpool::run");
    auto handle = task.handle();
    handle.resume();
    loop.drive_until([&] { return handle.done(); });
    loop.finish_lingering();
  }
  return task.handle().promise().take();
}

}  // namespace forkpool
