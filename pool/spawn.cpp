#include <forkpool/pool/spawn.hpp>

#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <string>

#include <forkpool/worker/worker_info.hpp>
#include <forkpool/runtime/error.hpp>
#include <forkpool/runtime/internal/blocking_wait.hpp>
#include <forkpool/runtime/private/describe_exception.hpp>
#include <forkpool/runtime/private/process.hpp>
#include <forkpool/runtime/private/errno.hpp>

namespace forkpool {
namespace {

// What the child threw: "<type>\0<message>", cut to fit one atomic pipe write.
void report_exception(int fd) noexcept {
  auto [type, message] = detail::describe_current_exception();
  std::string text = type + '\0' + message;
  if (text.size() > PIPE_BUF) text.resize(PIPE_BUF);
  [[maybe_unused]] ssize_t ignored = write(fd, text.data(), text.size());
}

std::string read_all(int fd) {
  std::string text;
  char buffer[PIPE_BUF];
  ssize_t n;
  while ((n = read(fd, buffer, sizeof buffer)) > 0) text.append(buffer, static_cast<std::size_t>(n));
  return text;
}

}  // namespace

ProcessContext ProcessContext::start(int nprocs, const std::function<void(int rank)>& body) {
  if (nprocs <= 0) throw std::invalid_argument("forkpool: start_processes needs nprocs >= 1");
  ProcessContext context;
  pid_t parent = getpid();
  std::uint64_t seed_base = detail::pool_seed_base(0);
  for (int rank = 0; rank < nprocs; ++rank) {
    int fds[2];
    if (pipe2(fds, O_CLOEXEC | O_NONBLOCK) < 0) detail::throw_last_errno("forkpool: pipe");
    UniqueFd read_end(fds[0]), write_end(fds[1]);
    pid_t pid = detail::fork_flushed();
    if (pid < 0) detail::throw_last_errno("forkpool: fork");
    if (pid == 0) {
      read_end.reset();
      detail::die_with_parent(parent);
      detail::set_process_name("forkpool-rank-" + std::to_string(rank));
      detail::set_worker_info({rank, nprocs, getpid(), detail::worker_seed(seed_base, rank, 0)});
      try {
        body(rank);
      } catch (...) {
        report_exception(write_end.get());
        detail::exit_helper(1);
      }
      detail::exit_helper(0);
    }
    context.children_.push_back({rank, pid, detail::open_pidfd(pid), std::move(read_end)});
  }
  return context;
}

ProcessContext ProcessContext::start_in_pool(int nprocs, StartMethod method,
                                             const std::function<detail::RankOutcome(Pool&, int rank)>& submit) {
  if (nprocs <= 0) throw std::invalid_argument("forkpool: start_processes needs nprocs >= 1");
  ProcessContext context;
  // A rank runs once: killed before it started, it fails (ProcessExitedException), never reruns.
  context.pool_ =
      std::make_unique<Pool>(PoolOptions{.processes = nprocs, .start_method = method}, detail::JobsDieWithWorker{});
  context.pool_pids_ = context.pool_->worker_pids();
  // Each worker is idle: rank r goes to worker r, the least busy one in turn.
  for (int rank = 0; rank < nprocs; ++rank) context.ranks_.push_back(submit(*context.pool_, rank));
  return context;
}

// Under a pool: the ranks' results, the first failure turned into what a forked rank's would
// have said (the other ranks are stopped first).
bool ProcessContext::join_pool(std::optional<std::chrono::nanoseconds> timeout) {
  auto failed_or_all_done = [&] {
    bool all = true;
    for (auto& rank : ranks_) {
      if (rank.ready() && rank.failure()) return true;
      all = all && rank.ready();
    }
    return all;
  };
  if (!detail::drive_loop_until(failed_or_all_done, timeout, "forkpool::ProcessContext::join")) return false;
  for (std::size_t rank = 0; rank < ranks_.size(); ++rank) {
    std::exception_ptr failure = ranks_[rank].ready() ? ranks_[rank].failure() : nullptr;
    if (!failure) continue;
    pool_->terminate();
    pool_.reset();  // every rank killed and reaped
    try {
      std::rethrow_exception(failure);
    } catch (const RemoteError& e) {
      throw ProcessRaisedException(static_cast<int>(rank), e.worker_pid(), e.type_name(), e.message());
    } catch (const WorkerLost& e) {
      throw ProcessExitedException(static_cast<int>(rank), e.pid(), e.exit_code(), e.signal());
    }
  }
  return true;
}

bool ProcessContext::join(std::optional<std::chrono::nanoseconds> timeout) {
  if (!ranks_.empty()) return pool_ ? join_pool(timeout) : true;  // no pool: stopped after a failure
  std::vector<pollfd> fds;
  std::vector<Child*> running;
  for (Child& child : children_)
    if (!child.done) {
      fds.push_back({child.pidfd.get(), POLLIN, 0});
      running.push_back(&child);
    }
  if (running.empty()) return true;
  int wait_ms =
      timeout ? static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(*timeout).count()) : -1;
  int ready;
  do ready = poll(fds.data(), fds.size(), wait_ms);
  while (ready < 0 && errno == EINTR);
  if (ready < 0) detail::throw_last_errno("forkpool: ProcessContext::join");
  for (std::size_t i = 0; i < fds.size(); ++i) {
    if (!fds[i].revents) continue;
    Child& child = *running[i];
    detail::ExitStatus status = detail::reap(child.pidfd.get());
    child.done = true;
    if (status.exit_code != 0) {
      std::string report = read_all(child.error_pipe.get());
      kill_all();
      auto separator = report.find('\0');
      if (status.exit_code == 1 && separator != std::string::npos)
        throw ProcessRaisedException(child.rank, child.pid, report.substr(0, separator), report.substr(separator + 1));
      throw ProcessExitedException(child.rank, child.pid, status.exit_code, status.signal);
    }
  }
  for (Child& child : children_)
    if (!child.done) return false;
  return true;
}

std::vector<pid_t> ProcessContext::pids() const {
  if (!ranks_.empty()) return pool_pids_;
  std::vector<pid_t> pids;
  for (const Child& child : children_) pids.push_back(child.pid);
  return pids;
}

void ProcessContext::kill_all() noexcept {
  for (Child& child : children_)
    if (!child.done) {
      detail::send_signal(child.pidfd.get(), SIGKILL);
      detail::reap(child.pidfd.get());
      child.done = true;
    }
}

ProcessContext::~ProcessContext() {
  kill_all();
  if (pool_) pool_->terminate();
}

}  // namespace forkpool
