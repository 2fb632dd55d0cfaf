#pragma once
// Loop: the calling thread's single-threaded event loop (io_uring, or epoll where io_uring is
// unavailable). Coroutines suspended on its operations are resumed from inside its turns, on the
// thread that owns the loop.

#include <chrono>
#include <coroutine>
#include <cstddef>
#include <functional>
#include <memory>
#include <vector>

#include <forkpool/runtime/unique_fd.hpp>
#include <forkpool/runtime/scope.hpp>
#include <forkpool/runtime/task.hpp>

namespace forkpool {
namespace detail {
class Backend;
class Spinner;
class LeaveListener;
struct LoopInternals;
}  // namespace detail

class Loop {
 public:
  // The calling thread's loop, made on first use. The backend is io_uring unless the kernel
  // refuses it or FORKPOOL_BACKEND=epoll; FORKPOOL_BACKEND=io_uring makes a refusal an error.
  // A forked child closes its copies of the parent's loop descriptors at fork and makes a fresh
  // loop here on first use.
  static Loop& current();

  ~Loop();
  Loop(const Loop&) = delete;
  Loop& operator=(const Loop&) = delete;

  // A descriptor that turns readable when the loop has work; a host loop (epoll, asio, Qt) watches
  // it and then calls run_ready() on this loop's thread.
  int fd() const;

  // Runs what is ready without blocking; returns how many completions it handled. Coroutines
  // resume inside this call. std::logic_error if the loop is already being driven (from a coroutine),
  // or if the calling thread is not the loop's.
  std::size_t run_ready();

  // "io_uring" or "epoll".
  const char* backend_name() const;

  // The door for other threads (Python's call_soon_threadsafe). Any thread: queues `fn` to run
  // on this loop's thread at its next turn, and wakes the loop if it sleeps in the kernel (also
  // a host loop watching fd()). Functions run in the order posted; one that throws is reported
  // on stderr and the rest still run. The loop must outlive the call.
  //
  //   fp::Loop& loop = fp::Loop::current();                 // on the pool's thread
  //   std::thread feeder([&] { loop.post([&] { results.push_back(pool.apply_async(f, 1)); }); });
  void post(std::function<void()> fn);

 private:
  friend struct detail::LoopInternals;
  struct Door;
  Loop();

  std::unique_ptr<Door> door_;  // before backend_: destroyed after it, as its read may be in the kernel
  std::unique_ptr<detail::Backend> backend_;
  mutable UniqueFd host_fd_;  // epoll set for fd(): the backend's fd + wake_fd_
  mutable UniqueFd wake_fd_;  // eventfd: soft completions while a host loop waits
  bool driving_ = false;
  bool in_turn_ = false;
  Scope finishing_;                         // work run() and ~Loop wait for (a destroyed pool's workers being reaped)
  std::vector<detail::Spinner*> spinners_;  // polled before a blocking turn sleeps
  std::vector<std::weak_ptr<detail::LeaveListener>> leave_listeners_;  // told when a drive ends
};

namespace detail {
// Drives the calling thread's loop until `task` is done, then until the work the loop must
// finish has ended. Throws std::logic_error when the loop is already being driven.
void run_until_done(std::coroutine_handle<> task);
}  // namespace detail

// Drives the calling thread's loop until `task` ends; returns its value or rethrows. Throws
// std::logic_error when called from inside a coroutine running on the same loop.
//   int main() { return forkpool::run(amain()); }
template <class T>
T run(Task<T> task) {
  detail::run_until_done(task.handle_to_start());
  return task.handle().promise().take();
}

// A timer on the loop; the awaiting coroutine resumes inside the loop's turn once it fires.
Task<void> sleep_for(std::chrono::nanoseconds duration);
Task<void> sleep_until(std::chrono::steady_clock::time_point when);

}  // namespace forkpool
