#include <forkpool/pool/process.hpp>

#include <poll.h>
#include <signal.h>

#include <forkpool/pool/internal/fd_wait.hpp>
#include <forkpool/runtime/error.hpp>
#include <forkpool/runtime/internal/blocking_wait.hpp>
#include <forkpool/runtime/internal/io.hpp>
#include <forkpool/runtime/internal/process.hpp>

namespace forkpool {

// The process is the one worker of a pool that then closes: when its task is done the worker
// exits (maxtasksperchild 1), and nothing replaces it.
Process::Process(const ProcessOptions& options)
    : pool_(std::make_unique<Pool>(PoolOptions{.processes = 1, .maxtasksperchild = 1, .start_method = options.start_method},
                                   options.name.empty() ? std::string("forkpool-process") : options.name)) {}

void Process::started() {
  pool_->close();
  pid_ = pool_->worker_pids().at(0);
  // Our own watch on it: the pool's pidfd (from the fork server when it is the server's child),
  // never one opened by pid, which a short task's process may have given up already.
  pidfd_ = pool_->worker_pidfd(pid_);
}

Process::Process(Process&&) noexcept = default;
Process& Process::operator=(Process&&) noexcept = default;

Process::~Process() {
  if (pidfd_ && is_alive()) kill();
}

bool Process::is_alive() const {
  pollfd exited{pidfd_.get(), POLLIN, 0};
  return poll(&exited, 1, 0) == 0;
}

// How the task ended says how the process did: its result (exit 0), or WorkerLost with the
// exit code (1: it raised) or the signal.
std::optional<int> Process::exit_code_from_result() const {
  if (!outcome_()) return std::nullopt;
  std::exception_ptr failure = failure_();
  if (!failure) return 0;
  try {
    std::rethrow_exception(failure);
  } catch (const WorkerLost& e) {
    return e.signal() ? -e.signal() : e.exit_code();
  } catch (...) {
    return 1;
  }
}

std::optional<int> Process::exitcode() const {
  if (is_alive()) return std::nullopt;
  return exit_code_from_result();
}

void Process::terminate() { detail::send_signal(pidfd_.get(), SIGTERM); }
void Process::kill() { detail::send_signal(pidfd_.get(), SIGKILL); }

bool Process::join(std::chrono::nanoseconds timeout) {
  detail::Deadline deadline = detail::deadline_after(timeout);
  std::optional<std::chrono::nanoseconds> left;
  if (deadline) left = *deadline - std::chrono::steady_clock::now();
  // The task's outcome comes first (a result before the worker exits, or its death); the pool
  // learns of it on this thread's loop.
  if (!detail::drive_loop_until(outcome_, left, "forkpool::Process::join")) return false;
  return detail::wait_for_fd(pidfd_.get(), POLLIN, deadline, "forkpool::Process::join");
}

Task<int> Process::async_join() {
  co_await wait_();
  co_await wait_process_exit(pidfd_.get());
  co_return *exit_code_from_result();
}

}  // namespace forkpool
