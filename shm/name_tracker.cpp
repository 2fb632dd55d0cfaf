#include <forkpool/shm/private/name_tracker.hpp>

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <poll.h>
#include <sys/socket.h>
#include <sys/syscall.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <cstdio>
#include <map>
#include <mutex>
#include <set>
#include <atomic>
#include <string>
#include <string_view>

#include <forkpool/runtime/error.hpp>
#include <forkpool/runtime/private/inherited_fds.hpp>
#include <forkpool/runtime/private/process.hpp>
#include <forkpool/runtime/unique_fd.hpp>
#include <forkpool/runtime/private/errno.hpp>

namespace forkpool::detail {
namespace {

// Above the descriptors helpers renumber (0-3) and out of the way of ordinary ones.
constexpr int kTrackerFdFloor = 64;

// The tracker's one message to the process that started it: it has a session of its own.
constexpr char kTrackerReady = 'R';

// How long a name outlives its last holder's death: time for a message carrying it to arrive.
constexpr auto kGrace = std::chrono::milliseconds(500);

class TrackerState {
 public:
  // One message: '+' or '-' and a segment name, from the process `pid` (the kernel's word for
  // it, SCM_CREDENTIALS). Anything else is dropped: a task may write junk to our socket, and it
  // must not spoil anybody else's message.
  void apply(pid_t pid, std::string_view message) {
    if (message.size() < 2 || (message[0] != '+' && message[0] != '-')) return;
    std::string name(message.substr(1));
    if (!is_segment_name(name)) return;
    if (message[0] == '+') {
      seen_.insert(name);
      holders_[name].insert(pid);
      doomed_.erase(name);
      watch(pid);
    } else if (auto it = holders_.find(name); it != holders_.end()) {
      it->second.erase(pid);
      if (it->second.empty()) holders_.erase(it);  // let go normally: its last holder unlinked it
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

// Receives one message and who sent it. False at end-of-file: every process that could send
// (the whole tree) is gone.
bool receive_message(int socket, std::string& message, pid_t& sender) {
  char buffer[512];
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(ucred))];
  for (;;) {
    iovec iov{buffer, sizeof buffer};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof control;
    ssize_t n = recvmsg(socket, &msg, MSG_CMSG_CLOEXEC);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && errno == EAGAIN) return true;  // nothing after all
    if (n <= 0) return false;
    sender = 0;
    for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c)) {
      if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_CREDENTIALS) {
        ucred credentials;
        std::memcpy(&credentials, CMSG_DATA(c), sizeof credentials);
        sender = credentials.pid;
      } else if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
        // Descriptors nobody should send us: closed unread.
        std::size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (std::size_t i = 0; i < count; ++i) {
          int fd;
          std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof fd);
          close(fd);
        }
      }
    }
    message.assign(buffer, (msg.msg_flags & MSG_TRUNC) ? 0 : static_cast<std::size_t>(n));
    return true;
  }
}

[[noreturn]] void tracker_main(int socket) {
  // Ctrl-C in the terminal must not take the tracker with the program: it cleans up after it.
  signal(SIGINT, SIG_IGN);
  signal(SIGTERM, SIG_IGN);
  signal(SIGHUP, SIG_IGN);
  sigset_t none;
  sigemptyset(&none);
  sigprocmask(SIG_SETMASK, &none, nullptr);  // blocked since the fork (fork_helper)
  prctl(PR_SET_NAME, "forkpool-shm");
  // A session (and process group) of its own: a kill of the program's whole group (a job
  // control SIGKILL, a supervisor's killpg) leaves it to unlink what the group held. The
  // process that started us waits for this word: until then a group kill would take us too.
  setsid();
  if (::send(socket, &kTrackerReady, 1, MSG_NOSIGNAL) != 1) _exit(1);
  close_descriptors_from(3, {socket});
  TrackerState state;
  std::string message;
  for (;;) {
    std::vector<pollfd> fds{{socket, POLLIN, 0}};
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
      pid_t sender = 0;
      if (!receive_message(socket, message, sender)) break;  // the whole tree is gone
      if (sender > 0) state.apply(sender, message);
    }
    state.unlink_due();
  }
  state.unlink_all();
  _exit(0);
}

UniqueFd& adopted_socket() {
  static UniqueFd socket;
  return socket;
}
std::atomic<int> tracker_socket{-1};

class Tracker {
 public:
  static Tracker& instance() {
    static Tracker tracker;
    return tracker;
  }

  void send(char op, const std::string& name) {
    // One datagram each: never mixed with another process's, and the kernel says who sent it.
    std::string message = op + name;
    while (::send(socket_, message.data(), message.size(), MSG_NOSIGNAL) < 0 && errno == EINTR) {}
  }

 private:
  Tracker() {
    if (UniqueFd& adopted = adopted_socket()) {
      keep(adopted.get());
      adopted.reset();
      return;
    }
    int ends[2];
    if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, ends) != 0)
      throw_last_errno("forkpool: name tracker socket");
    UniqueFd tracker_end(ends[0]), our_end(ends[1]);
    int on = 1;
    if (setsockopt(tracker_end.get(), SOL_SOCKET, SO_PASSCRED, &on, sizeof on) != 0)
      throw_last_errno("forkpool: name tracker credentials");
    pid_t pid = fork_helper();
    if (pid < 0) throw_last_errno("forkpool: fork (name tracker)");
    if (pid == 0) {
      our_end.reset();
      tracker_main(tracker_end.release());
    }
    tracker_end.reset();
    wait_until_ready(our_end.get());
    keep(our_end.get());
  }

  // Until the tracker has left our process group (it says so once): a group kill right after
  // the first segment (CI saw one on a loaded machine, before the tracker had run at all) would
  // otherwise end it with the group, and nothing would unlink what the group held.
  static void wait_until_ready(int socket) {
    char ready = 0;
    ssize_t n;
    while ((n = ::recv(socket, &ready, 1, 0)) < 0 && errno == EINTR) {}
    if (n < 0) throw_last_errno("forkpool: name tracker start");
    if (n != 1 || ready != kTrackerReady)
      throw std::system_error(ECHILD, std::generic_category(), "forkpool: the name tracker ended as it started");
  }

  // Our socket, at a number helpers keep (kTrackerFdFloor or above).
  void keep(int fd) {
    socket_ = fcntl(fd, F_DUPFD_CLOEXEC, kTrackerFdFloor);
    if (socket_ < 0 && errno == EINVAL) socket_ = fcntl(fd, F_DUPFD_CLOEXEC, 4);  // a limit at or below the floor
    if (socket_ < 0) throw_last_errno("forkpool: name tracker descriptor");
    keep_in_helpers(socket_);
    tracker_socket.store(socket_);
  }

  int socket_ = -1;  // open for the life of the process (and of its helpers)
};

}  // namespace

void start_name_tracker() { Tracker::instance(); }

int name_tracker_socket() noexcept { return tracker_socket.load(); }

void adopt_name_tracker(UniqueFd socket) {
  adopted_socket() = std::move(socket);
  Tracker::instance();
}

void track_segment_name(const std::string& name) { Tracker::instance().send('+', name); }
void untrack_segment_name(const std::string& name) { Tracker::instance().send('-', name); }

}  // namespace forkpool::detail
