#include <forkpool/shm/internal/name_tracker.hpp>

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <poll.h>
#include <sys/syscall.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <mutex>
#include <set>
#include <string>

#include <forkpool/runtime/error.hpp>
#include <forkpool/runtime/internal/inherited_fds.hpp>
#include <forkpool/runtime/internal/process.hpp>
#include <forkpool/runtime/internal/unique_fd.hpp>
#include <forkpool/runtime/internal/errno.hpp>

namespace forkpool::detail {
namespace {

// Above the descriptors helpers renumber (0-3) and out of the way of ordinary ones.
constexpr int kTrackerFdFloor = 64;

// How long a name outlives its last holder's death: time for a message carrying it to arrive.
constexpr auto kGrace = std::chrono::milliseconds(500);

class TrackerState {
 public:
  void apply(const std::string& line) {
    // "+<pid> <name>" or "-<pid> <name>"
    auto space = line.find(' ');
    if (line.size() < 4 || space == std::string::npos) return;
    pid_t pid = static_cast<pid_t>(std::atol(line.c_str() + 1));
    std::string name = line.substr(space + 1);
    if (pid <= 0 || name.empty() || name.find('/') != std::string::npos) return;
    if (line[0] == '+') {
      seen_.insert(name);
      holders_[name].insert(pid);
      doomed_.erase(name);
      watch(pid);
    } else if (line[0] == '-') {
      if (auto it = holders_.find(name); it != holders_.end()) {
        it->second.erase(pid);
        if (it->second.empty()) holders_.erase(it);  // let go normally: its last holder unlinked it
      }
    }
  }

  void on_death(pid_t pid) {
    watched_.erase(pid);
    for (auto it = holders_.begin(); it != holders_.end();) {
      it->second.erase(pid);
      if (it->second.empty()) {
        doomed_[it->first] = std::chrono::steady_clock::now() + kGrace;
        it = holders_.erase(it);
      } else {
        ++it;
      }
    }
  }

  void unlink_due() {
    auto now = std::chrono::steady_clock::now();
    for (auto it = doomed_.begin(); it != doomed_.end();) {
      if (it->second <= now) {
        unlink(segment_path(it->first).c_str());
        it = doomed_.erase(it);
      } else {
        ++it;
      }
    }
  }

  void unlink_all() {
    for (const std::string& name : seen_) unlink(segment_path(name).c_str());
  }

  int poll_timeout_ms() const {
    if (doomed_.empty()) return -1;
    auto next = std::min_element(doomed_.begin(), doomed_.end(), [](auto& a, auto& b) { return a.second < b.second; });
    auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(next->second - std::chrono::steady_clock::now());
    return static_cast<int>(std::max<long>(ms.count() + 1, 0));
  }

  std::map<pid_t, UniqueFd>& watched() { return watched_; }

 private:
  void watch(pid_t pid) {
    if (watched_.contains(pid)) return;
    int fd = static_cast<int>(syscall(SYS_pidfd_open, pid, 0));
    if (fd < 0) {
      watched_.emplace(pid, UniqueFd());
      on_death(pid);  // already gone
      return;
    }
    watched_.emplace(pid, UniqueFd(fd));
  }

  std::set<std::string> seen_;
  std::map<std::string, std::set<pid_t>> holders_;
  std::map<std::string, std::chrono::steady_clock::time_point> doomed_;
  std::map<pid_t, UniqueFd> watched_;
};

[[noreturn]] void tracker_main(int read_end) {
  // Ctrl-C in the terminal must not take the tracker with the program: it cleans up after it.
  signal(SIGINT, SIG_IGN);
  signal(SIGTERM, SIG_IGN);
  signal(SIGHUP, SIG_IGN);
  prctl(PR_SET_NAME, "forkpool-shm");
  close_descriptors_from(3, {read_end});
  TrackerState state;
  std::string pending;
  char buffer[4096];
  for (;;) {
    std::vector<pollfd> fds{{read_end, POLLIN, 0}};
    std::vector<pid_t> pids;
    for (auto& [pid, pidfd] : state.watched())
      if (pidfd) {
        fds.push_back({pidfd.get(), POLLIN, 0});
        pids.push_back(pid);
      }
    int ready = poll(fds.data(), fds.size(), state.poll_timeout_ms());
    if (ready < 0 && errno != EINTR) break;
    for (std::size_t i = 1; i < fds.size(); ++i)
      if (fds[i].revents) state.on_death(pids[i - 1]);
    if (fds[0].revents) {
      ssize_t n = read(read_end, buffer, sizeof buffer);
      if (n == 0 || (n < 0 && errno != EINTR && errno != EAGAIN)) break;  // the whole tree is gone
      if (n > 0) pending.append(buffer, static_cast<std::size_t>(n));
      for (std::size_t newline; (newline = pending.find('\n')) != std::string::npos; pending.erase(0, newline + 1))
        state.apply(pending.substr(0, newline));
    }
    state.unlink_due();
  }
  state.unlink_all();
  _exit(0);
}

class Tracker {
 public:
  static Tracker& instance() {
    static Tracker tracker;
    return tracker;
  }

  void send(char op, const std::string& name) {
    // Shorter than PIPE_BUF: written whole, never interleaved with another process's line.
    std::string line = op + std::to_string(getpid()) + " " + name + "\n";
    [[maybe_unused]] ssize_t ignored = write(write_end_, line.data(), line.size());
  }

 private:
  Tracker() {
    int fds[2];
    if (pipe2(fds, O_CLOEXEC) != 0) throw_last_errno("forkpool: name tracker pipe");
    pid_t pid = fork_flushed();
    if (pid < 0) throw_last_errno("forkpool: fork (name tracker)");
    if (pid == 0) {
      close(fds[1]);
      tracker_main(fds[0]);
    }
    close(fds[0]);
    write_end_ = fcntl(fds[1], F_DUPFD_CLOEXEC, kTrackerFdFloor);
    close(fds[1]);
    if (write_end_ < 0) throw_last_errno("forkpool: name tracker descriptor");
    keep_in_helpers(write_end_);
  }

  int write_end_ = -1;  // open for the life of the process (and of its helpers)
};

}  // namespace

void track_segment_name(const std::string& name) { Tracker::instance().send('+', name); }
void untrack_segment_name(const std::string& name) { Tracker::instance().send('-', name); }

}  // namespace forkpool::detail
