#include <forkpool/pool/process.hpp>

#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <mutex>
#include <map>
#include <stdexcept>

#include <forkpool/sync/private/waits.hpp>
#include <forkpool/pool/internal/pool_internals.hpp>
#include <forkpool/worker/worker_info.hpp>
#include <forkpool/runtime/error.hpp>
#include <forkpool/runtime/internal/blocking_wait.hpp>
#include <forkpool/runtime/internal/io.hpp>
#include <forkpool/runtime/private/process.hpp>

namespace forkpool {

// The process is the one worker of a pool that then closes: when its task is done the worker
// exits (maxtasksperchild 1), and nothing replaces it.
namespace {
// The Processes of this process: pid -> the handle's pidfd (not owned; a handle leaves before it
// closes it). active_children() asks the pidfd, as is_alive() does, so that the two agree (CI
// once saw /proc show a process as running after its pidfd had said it ended).
std::mutex started_lock;
std::map<pid_t, int>& started_here() {
  static auto* pids = new std::map<pid_t, int>;  // never destroyed: handles may outlive static destruction
  return *pids;
}
bool pidfd_readable(int pidfd) {
  pollfd exited{pidfd, POLLIN, 0};
  return poll(&exited, 1, 0) != 0;
}
void forget_started(pid_t pid) {
  std::lock_guard guard(started_lock);
  started_here().erase(pid);
}
}  // namespace

Process::Process(const ProcessOptions& options)
    : daemon_(options.daemon),
      pool_(std::make_unique<Pool>(
          PoolOptions{.processes = 1, .maxtasksperchild = 1, .start_method = options.start_method},
          options.name.empty() ? std::string("forkpool-process") : options.name)) {}

void Process::started() {
  pool_->close();
  pid_ = pool_->worker_pids().at(0);
  // Our own watch on it: the pool's pidfd (from the fork server when it is the server's child),
  // never one opened by pid, which a short task's process may have given up already.
  pidfd_ = pool_->worker_pidfd(pid_);
  std::lock_guard guard(started_lock);
  started_here()[pid_] = pidfd_.get();
}

Process::Process(Process&&) noexcept = default;
// The process this handle had ends as it would in the destructor.
Process& Process::operator=(Process&& other) noexcept {
  Process taken(std::move(other));
  swap(taken);
  return *this;  // `taken` now holds what this handle had, and ends it
}

void Process::swap(Process& other) noexcept {
  std::swap(daemon_, other.daemon_);
  std::swap(closed_exit_code_, other.closed_exit_code_);
  std::swap(pool_, other.pool_);
  std::swap(pid_, other.pid_);
  std::swap(pidfd_, other.pidfd_);
  std::swap(outcome_, other.outcome_);
  std::swap(failure_, other.failure_);
  std::swap(wait_, other.wait_);
}

Process::~Process() {
  if (!pidfd_) return;
  if (is_alive()) {
    if (daemon_) {
      kill();
    } else {
      try {
        join();
      } catch (...) {
        kill();  // joining was refused (inside a coroutine on this loop, or on another thread): as a daemon
      }
    }
  }
  forget_started(pid_);
}

void Process::close() {
  if (!pidfd_) return;
  if (is_alive()) throw std::logic_error("forkpool: Process::close() while the process runs: join() it first");
  join();  // its outcome, from the pool
  closed_exit_code_ = exit_code_from_result();
  forget_started(pid_);
  pidfd_ = UniqueFd();
  pool_.reset();
  outcome_ = nullptr;
  failure_ = nullptr;
  wait_ = nullptr;
}

bool Process::is_alive() const { return pidfd_ && !pidfd_readable(pidfd_.get()); }

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
  if (!pidfd_) return closed_exit_code_;
  if (is_alive()) return std::nullopt;
  return exit_code_from_result();
}

void Process::terminate() { detail::send_signal(pidfd_.get(), SIGTERM); }
void Process::kill() { detail::send_signal(pidfd_.get(), SIGKILL); }

bool Process::join(std::chrono::nanoseconds timeout) {
  if (!pidfd_) return true;  // closed: it had ended
  detail::Deadline deadline = detail::deadline_unless_forever(timeout);
  std::optional<std::chrono::nanoseconds> left;
  if (deadline) left = *deadline - std::chrono::steady_clock::now();
  // The task's outcome comes first (a result before the worker exits, or its death).
  check_joiner("Process::join");
  if (!detail::drive_loop_until(outcome_, left, "forkpool::Process::join")) return false;
  return detail::wait_for_fd(pidfd_.get(), POLLIN, deadline, "forkpool::Process::join");
}

// The pool learns of the task's outcome on its thread's loop alone: another thread's wait
// would last for ever (or resume its coroutine on the starting thread).
void Process::check_joiner(const char* who) const {
  const detail::PoolCore& core = detail::PoolInternals::core(*pool_);
  if (outcome_() || (core.on_owner_thread() && core.in_owner_process())) return;
  throw std::logic_error(std::string("forkpool: ") + who +
                         " called on another thread than the one that started the process, before it ended: its "
                         "exit code reaches that thread's loop alone; join it there, or watch is_alive() or "
                         "sentinel() here");
}

Task<int> Process::async_join() {
  if (!pidfd_) {  // closed (it had ended), as join()
    if (!closed_exit_code_) throw std::logic_error("forkpool: Process used after it was moved from");
    co_return *closed_exit_code_;
  }
  check_joiner("Process::async_join");
  co_await wait_();
  co_await detail::wait_process_exit(pidfd_.get());
  co_return *exit_code_from_result();
}

std::string current_process_name() {
  char name[17] = {};
  prctl(PR_GET_NAME, name);
  return name;
}

pid_t parent_pid() { return detail::starting_parent().value_or(getppid()); }

std::vector<pid_t> active_children() {
  std::lock_guard guard(started_lock);
  std::vector<pid_t> running;
  for (auto [pid, pidfd] : started_here())
    if (!pidfd_readable(pidfd)) running.push_back(pid);
  return running;
}

}  // namespace forkpool
