#include <forkpool/runtime/private/process.hpp>

#include <forkpool/runtime/private/fork_hooks.hpp>

#include <dirent.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <fstream>
#include <iterator>
#include <mutex>
#include <sstream>
#include <system_error>
#include <vector>

#include <forkpool/runtime/private/errno.hpp>
#include <forkpool/runtime/private/inherited_fds.hpp>

#ifndef P_PIDFD
#define P_PIDFD 3
#endif

namespace forkpool::detail {

void close_descriptors_from(int first, const std::vector<int>& keep) noexcept {
  bool ranged = true;
  int from = first;
  for (int fd : keep) {
    if (fd < from) continue;
    if (fd > from && syscall(SYS_close_range, from, fd - 1, 0) != 0) ranged = false;
    from = fd + 1;
  }
  if (ranged && syscall(SYS_close_range, from, ~0U, 0) == 0) return;
  // Kernels before 5.9: walk /proc/self/fd.
  std::vector<int> open;
  if (DIR* dir = opendir("/proc/self/fd")) {
    while (dirent* entry = readdir(dir)) {
      int fd = atoi(entry->d_name);
      bool kept = std::find(keep.begin(), keep.end(), fd) != keep.end();
      if (entry->d_name[0] != '.' && fd >= first && fd != dirfd(dir) && !kept) open.push_back(fd);
    }
    closedir(dir);
  }
  for (int fd : open) close(fd);
}

namespace {
std::atomic<const ForkHooks*> fork_hooks{nullptr};
}  // namespace

// Kept for ever. Out of memory this early ends the program, as from any noexcept function.
void set_fork_hooks(ForkHooks hooks) noexcept {
  fork_hooks.store(new ForkHooks(hooks));  // NOLINT(bugprone-unhandled-exception-at-new)
}

pid_t fork_flushed() noexcept {
  fflush(nullptr);
  const ForkHooks* hooks = fork_hooks.load();
  if (!hooks) return fork();
  if (hooks->prepare) hooks->prepare();
  pid_t pid = fork();
  void (*after)() noexcept = pid == 0 ? hooks->child : hooks->parent;
  if (after) after();
  return pid;
}

pid_t fork_helper() noexcept {
  sigset_t all, old;
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &old);
  pid_t pid = fork_flushed();
  if (pid != 0) pthread_sigmask(SIG_SETMASK, &old, nullptr);
  return pid;
}

namespace {

// Overwrites the argument area so that ps shows `name` in full (comm is cut at 15 characters).
void set_cmdline(const std::string& name) noexcept {
  std::ifstream stat_file("/proc/self/stat");
  std::string stat((std::istreambuf_iterator<char>(stat_file)), std::istreambuf_iterator<char>());
  auto close_paren = stat.rfind(')');
  if (close_paren == std::string::npos) return;
  std::istringstream fields(stat.substr(close_paren + 2));
  std::string field;
  unsigned long arg_start = 0, arg_end = 0;
  // Fields after "(comm)" start at field 3; arg_start and arg_end are fields 48 and 49.
  for (int index = 3; fields >> field; ++index) {
    if (index == 48) arg_start = std::stoul(field);
    if (index == 49) {
      arg_end = std::stoul(field);
      break;
    }
  }
  if (!arg_start || arg_end <= arg_start) return;
  auto* area = reinterpret_cast<char*>(arg_start);
  std::size_t size = arg_end - arg_start;
  std::size_t n = std::min(name.size(), size - 1);
  std::copy_n(name.data(), n, area);
  std::fill(area + n, area + size, '\0');
}

}  // namespace

pid_t current_pid() noexcept {
  static pid_t cached = [] {
    pthread_atfork(nullptr, nullptr, [] { cached = getpid(); });
    return getpid();
  }();
  return cached;
}

// Stands in for the pidfd of a process that is already gone: readable at once (so its exit is
// seen), and no pidfd (so reap() reports the status unknown, and signals go nowhere).
UniqueFd ended_process_fd() {
  int fd = eventfd(1, EFD_CLOEXEC);
  if (fd < 0) throw_last_errno("forkpool: eventfd");
  return UniqueFd(fd);
}

UniqueFd open_pidfd(pid_t pid) {
  int fd = static_cast<int>(syscall(SYS_pidfd_open, pid, 0));
  if (fd < 0) throw_last_errno("forkpool: pidfd_open");
  return UniqueFd(fd);  // pidfds are close-on-exec from birth
}

UniqueFd watch_child(pid_t pid) {
  try {
    return open_pidfd(pid);
  } catch (const std::system_error& e) {
    // ESRCH: it ran, exited and was reaped before we could look (a host that ignores SIGCHLD,
    // or reaps with waitpid(-1)). Its start did not fail: it is watched as ended, status unknown.
    if (e.code().value() == ESRCH) return ended_process_fd();
    kill(pid, SIGKILL);
    waitpid(pid, nullptr, 0);
    throw;
  } catch (...) {
    kill(pid, SIGKILL);
    waitpid(pid, nullptr, 0);
    throw;
  }
}

ExitStatus reap(int pidfd) {
  siginfo_t info{};
  int rc;
  do rc = waitid(static_cast<idtype_t>(P_PIDFD), static_cast<id_t>(pidfd), &info, WEXITED | __WALL);
  while (rc < 0 && errno == EINTR);
  if (rc < 0) return {};
  if (info.si_code == CLD_EXITED) return {info.si_status, 0};
  return {-1, info.si_status};
}

void send_signal(int pidfd, int signal) noexcept { syscall(SYS_pidfd_send_signal, pidfd, signal, nullptr, 0); }

void die_with_parent(pid_t expected_parent) noexcept {
  if (expected_parent == 0) return;  // its lifeline is a socket instead
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  // The parent may have died between fork() and prctl(): then nobody would ever kill us.
  if (getppid() != expected_parent) _exit(kExitOrphaned);
}

void set_process_name(const std::string& name) noexcept {
  prctl(PR_SET_NAME, name.substr(0, 15).c_str());
  set_cmdline(name);
}

namespace {

// Default dispositions but SIGINT and SIGQUIT ignored, then an empty mask. Async-signal-safe.
void reset_signals_in_helper() noexcept {
  struct sigaction action {};
  for (int sig = 1; sig < NSIG; ++sig) {
    if (sig == SIGKILL || sig == SIGSTOP) continue;
    action.sa_handler = (sig == SIGINT || sig == SIGQUIT) ? SIG_IGN : SIG_DFL;
    sigaction(sig, &action, nullptr);
  }
  sigset_t none;
  sigemptyset(&none);
  sigprocmask(SIG_SETMASK, &none, nullptr);
}

// Our arguments, as the kernel keeps them (argv[0] included).
std::vector<std::string> own_arguments() {
  std::ifstream file("/proc/self/cmdline", std::ios::binary);
  std::string all((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  std::vector<std::string> arguments;
  for (std::size_t at = 0; at < all.size();) {
    std::size_t end = all.find('\0', at);
    if (end == std::string::npos) end = all.size();
    arguments.emplace_back(all, at, end - at);
    at = end + 1;
  }
  return arguments;
}

std::mutex spawn_program_mutex;
std::vector<std::string> spawn_program;  // empty: our own executable and arguments

std::vector<char*> pointers_to(std::vector<std::string>& strings) {
  std::vector<char*> pointers;
  pointers.reserve(strings.size() + 1);
  for (auto& s : strings) pointers.push_back(s.data());
  pointers.push_back(nullptr);
  return pointers;
}

}  // namespace

void set_spawn_program(std::vector<std::string> command) {
  std::lock_guard lock(spawn_program_mutex);
  spawn_program = std::move(command);
}

pid_t spawn_self(int keep, const std::vector<std::string>& environment) {
  // Everything the child needs is made here: between fork and exec it may only make
  // async-signal-safe calls (other threads of ours may hold the allocator's locks).
  std::vector<std::string> arguments;
  {
    std::lock_guard lock(spawn_program_mutex);
    arguments = spawn_program;
  }
  std::string program = arguments.empty() ? "/proc/self/exe" : arguments.front();
  if (arguments.empty()) arguments = own_arguments();
  std::vector<std::string> variables = environment;
  std::vector<char*> argv = pointers_to(arguments), envp = pointers_to(variables);
  pid_t pid = fork_helper();  // the child starts with every signal blocked
  if (pid < 0) throw_last_errno("forkpool: fork (spawn)");
  if (pid > 0) return pid;
  reset_signals_in_helper();
  if (fcntl(keep, F_SETFD, 0) != 0) _exit(127);
  execve(program.c_str(), argv.data(), envp.data());
  _exit(127);
}

int become_helper_process(const std::string& name, pid_t expected_parent, int keep) noexcept {
  die_with_parent(expected_parent);

  // Ctrl-C and Ctrl-\ reach the terminal's whole process group: they are the parent's to handle
  // (with its own handler, say), and its helpers live and die with it. Signals stay blocked
  // (fork_helper) until every disposition is set: none finds the parent's handler or a default.
  reset_signals_in_helper();

  constexpr int kChannelFd = 3;
  if (keep != kChannelFd) {
    if (dup2(keep, kChannelFd) < 0) _exit(kExitBadMessage);
  }
  close_descriptors_from(kChannelFd + 1, kept_in_helpers());
  set_process_name(name);
  return kChannelFd;
}

void exit_helper(int code) noexcept {
  fflush(nullptr);
  _exit(code);
}

}  // namespace forkpool::detail
