#pragma once
// start_process(f, args...): f(args...) in a new process, as multiprocessing.Process(target=f,
// args=args).start(). The process is started by the start method of ProcessOptions (a fork, a
// fork of the fork server, or a fresh run of the program), so `f` is what a task may be (a
// function pointer or a lambda without captures) and each argument a value codec<T> sends:
// Queue, Event, Lock, Barrier and Tensor included, their descriptors in the message.
//
//   void produce(fp::Queue<fp::Tensor> q, int n) { ... }
//   fp::Queue<fp::Tensor> q;
//   fp::Process p = fp::start_process(produce, q, 100);
//   ... q.get() ...
//   p.join();   // p.exitcode() == 0

#include <sys/types.h>

#include <chrono>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <forkpool/pool/pool.hpp>
#include <forkpool/pool/pool_options.hpp>
#include <forkpool/runtime/async_result.hpp>
#include <forkpool/runtime/unique_fd.hpp>
#include <forkpool/runtime/task.hpp>

namespace forkpool {

struct ProcessOptions {
  StartMethod start_method = StartMethod::forkserver;
  std::string name = {};  // in ps; "forkpool-process" when empty
  // A daemon process is ended when its parent exits, and when its Process handle is destroyed
  // while it runs. false: the handle's destructor waits for it to end, as Python waits for
  // non-daemon processes at exit (where a join is refused, inside a coroutine on the loop or on
  // another thread than the starting one, it is ended as a daemon). (Unlike Python's, forkpool's default is true: a
  // destructor that may wait for ever is the riskier default in C++.)
  bool daemon = true;
};

// One process running one function. Belongs to the thread that started it (its waits drive that
// thread's loop). Destroying a Process that still runs kills it: join() first.
class Process {
 public:
  Process(Process&&) noexcept;
  Process& operator=(Process&&) noexcept;
  ~Process();

  pid_t pid() const noexcept { return pid_; }
  bool is_alive() const;
  // Empty while it runs; then its exit code: 0 when f returned, 1 when an exception escaped f
  // (printed to stderr with its type and message), -N when signal N killed it, as Python.
  std::optional<int> exitcode() const;
  void terminate();  // SIGTERM
  void kill();       // SIGKILL
  // A descriptor that turns readable when the process has ended (its pidfd): poll() it beside
  // others, as Python's sentinel. Valid until close() or the handle's end.
  int sentinel() const noexcept { return pidfd_.get(); }
  // Lets go of the process's resources once it has ended; exitcode() still answers. Throws
  // std::logic_error while it runs.
  void close();
  // True once it has ended (and its exit code is known); false if `timeout` passes first. The
  // exit code reaches the loop of the thread that started the process: on another thread,
  // joining a process that has not ended is std::logic_error (it would wait for ever).
  bool join(std::chrono::nanoseconds timeout = std::chrono::nanoseconds::max());
  // On the calling thread's loop: its exit code, once it has ended. As join(), on the starting
  // thread only until then (std::logic_error elsewhere).
  Task<int> async_join();

  // For start_process: runs `submit(pool)` on a pool whose one worker is the new process.
  template <class R>
  static Process start(const ProcessOptions& options, const std::function<AsyncResult<R>(Pool&)>& submit) {
    Process process(options);
    AsyncResult<R> result = submit(*process.pool_);
    process.outcome_ = [result] { return result.ready(); };
    process.failure_ = [result]() -> std::exception_ptr {
      try {
        result.get();
        return nullptr;
      } catch (...) {
        return std::current_exception();
      }
    };
    process.wait_ = [result]() -> Task<void> {
      try {
        co_await result;
      } catch (...) {}
    };
    process.started();
    return process;
  }

 private:
  explicit Process(const ProcessOptions& options);
  void started();
  void swap(Process& other) noexcept;
  bool daemon_ = true;
  std::optional<int> closed_exit_code_;  // after close()
  std::optional<int> exit_code_from_result() const;
  // std::logic_error naming `who` unless the process has ended or this is its starting thread.
  void check_joiner(const char* who) const;

  std::unique_ptr<Pool> pool_;
  pid_t pid_ = -1;
  UniqueFd pidfd_;
  // The task's result, type-erased: ready, its failure (null: success), awaiting it.
  std::function<bool()> outcome_;
  std::function<std::exception_ptr()> failure_;
  std::function<Task<void>()> wait_;
};

template <class F, class... Args>
Process start_process(ProcessOptions options, F f, Args... args) {
  return Process::start<detail::CallResult<F, std::tuple<Args...>, true>>(
      options, [&](Pool& pool) { return pool.apply_async(f, args...); });
}

template <class F, class... Args>
requires(!std::is_same_v<std::decay_t<F>, ProcessOptions>) Process start_process(F f, Args... args) {
  return start_process(ProcessOptions{}, f, args...);
}

// The name of the calling process, as `ps` shows it ("forkpool-worker-0", "forkpool-process",
// or the program's own), as Python's current_process().name.
std::string current_process_name();
// The process that started this one: a pool's or a Process's owner in a worker (not the fork
// server it was forked from); getppid() elsewhere. As Python's parent_process().pid.
pid_t parent_pid();
// The pids of the Processes this process started that still run, as Python's active_children().
std::vector<pid_t> active_children();

}  // namespace forkpool
