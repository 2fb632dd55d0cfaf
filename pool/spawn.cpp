#include <forkpool/pool/spawn.hpp>

#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <string>

#include <forkpool/runtime/error.hpp>
#include <forkpool/runtime/internal/describe_exception.hpp>
#include <forkpool/runtime/internal/process.hpp>
#include <forkpool/runtime/internal/errno.hpp>

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

bool ProcessContext::join(std::optional<std::chrono::nanoseconds> timeout) {
  std::vector<pollfd> fds;
  std::vector<Child*> running;
  for (Child& child : children_)
    if (!child.done) {
      fds.push_back({child.pidfd.get(), POLLIN, 0});
      running.push_back(&child);
    }
  if (running.empty()) return true;
  int wait_ms = timeout ? static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(*timeout).count()) : -1;
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

ProcessContext::~ProcessContext() { kill_all(); }

}  // namespace forkpool
