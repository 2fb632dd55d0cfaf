// The epoll backend: the same operations as io_uring, done as readiness + a non-blocking system
// call. Used where io_uring is unavailable (seccomp, kernel.io_uring_disabled) or forced off.

#include <errno.h>
#include <poll.h>
#include <sys/epoll.h>
#include <sys/timerfd.h>
#include <time.h>
#include <unistd.h>

#include <array>
#include <set>
#include <unordered_map>
#include <utility>

#include <forkpool/runtime/private/backend.hpp>
#include <forkpool/runtime/error.hpp>
#include <forkpool/runtime/unique_fd.hpp>
#include <forkpool/runtime/private/errno.hpp>

namespace forkpool::detail {
namespace {

std::int64_t to_ns(const __kernel_timespec& ts) { return ts.tv_sec * 1'000'000'000LL + ts.tv_nsec; }

std::int64_t now_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1'000'000'000LL + ts.tv_nsec;
}

bool wants_write(const Operation* op) {
  return op->kind == OpKind::write || op->kind == OpKind::sendmsg ||
         (op->kind == OpKind::poll && (op->flags & POLLOUT));
}

// The non-blocking attempt of an I/O operation: its result, or -EAGAIN to keep waiting.
int attempt(Operation* op, std::uint32_t revents) {
  ssize_t rc = 0;
  switch (op->kind) {
    case OpKind::read: rc = ::read(op->fd, op->buffer, op->length); break;
    case OpKind::write: rc = ::write(op->fd, op->buffer, op->length); break;
    case OpKind::sendmsg: rc = ::sendmsg(op->fd, op->message, static_cast<int>(op->flags) | MSG_DONTWAIT); break;
    case OpKind::recvmsg: rc = ::recvmsg(op->fd, op->message, static_cast<int>(op->flags) | MSG_DONTWAIT); break;
    case OpKind::poll: {
      std::uint32_t mask = revents & (op->flags | POLLERR | POLLHUP);
      return mask ? static_cast<int>(mask) : -EAGAIN;
    }
    case OpKind::timeout:
    case OpKind::futex_wait: return 0;  // neither is attempted: start() takes them apart
  }
  return rc < 0 ? -errno : static_cast<int>(rc);
}

class EpollBackend final : public Backend {
 public:
  EpollBackend()
      : epoll_(epoll_create1(EPOLL_CLOEXEC)), timer_(timerfd_create(CLOCK_MONOTONIC, TFD_CLOEXEC | TFD_NONBLOCK)) {
    if (!epoll_) throw_last_errno("epoll_create1");
    if (!timer_) throw_last_errno("timerfd_create");
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.fd = timer_.get();
    if (epoll_ctl(epoll_.get(), EPOLL_CTL_ADD, timer_.get(), &ev) < 0) throw_last_errno("epoll_ctl");
  }

  void start(Operation* op) override {
    note_started();
    switch (op->kind) {
      case OpKind::timeout: add_timer(op); return;
      case OpKind::futex_wait: complete_soon(op, -EOPNOTSUPP); return;  // epoll cannot watch a futex
      case OpKind::sendmsg:
      case OpKind::recvmsg:
        // Sockets take MSG_DONTWAIT: try at once, wait only if the kernel says so.
        if (int rc = attempt(op, 0); rc != -EAGAIN) {
          complete_soon(op, rc);
          return;
        }
        break;
      default: break;
    }
    add_waiter(op);
  }

  void cancel(Operation* op) override {
    if (op->state != OpState::in_kernel) return;
    if (op->kind == OpKind::timeout) {
      timers_.erase({to_ns(op->deadline), op});
    } else {
      remove_waiter(op);
    }
    complete_soon(op, -ECANCELED);
  }

  void flush() override {}

  std::size_t reap(bool block) override {
    std::size_t delivered = deliver_soft_completions();
    bool may_wait = block && delivered == 0 && !has_soft_completions();
    std::array<epoll_event, 64> events;
    int count = epoll_wait(epoll_.get(), events.data(), events.size(), may_wait ? -1 : 0);
    if (count < 0 && errno != EINTR) throw_last_errno("epoll_wait");
    for (int i = 0; i < count; ++i) {
      if (events[i].data.fd == timer_.get()) {
        delivered += expire_timers();
      } else {
        delivered += on_ready(events[i].data.fd, events[i].events);
      }
    }
    return delivered + deliver_soft_completions();
  }

  int pollable_fd() const override { return epoll_.get(); }
  const char* name() const override { return "epoll"; }
  void abandon() noexcept override {
    // The child's copies of the descriptors; the epoll set itself stays the parent's.
    epoll_.reset();
    timer_.reset();
  }

 private:
  struct Waiters {
    OpList readers;
    OpList writers;
    std::uint32_t registered = 0;
  };

  void add_waiter(Operation* op) {
    op->state = OpState::in_kernel;
    Waiters& w = waiters_[op->fd];
    (wants_write(op) ? w.writers : w.readers).push_back(op);
    update_interest(op->fd, w);
  }

  void remove_waiter(Operation* op) {
    auto it = waiters_.find(op->fd);
    (wants_write(op) ? it->second.writers : it->second.readers).remove(op);
    update_interest(op->fd, it->second);
  }

  void update_interest(int fd, Waiters& w) {
    std::uint32_t wanted =
        (w.readers.empty() ? 0u : std::uint32_t{EPOLLIN}) | (w.writers.empty() ? 0u : std::uint32_t{EPOLLOUT});
    if (wanted == w.registered) {
      if (!wanted) waiters_.erase(fd);
      return;
    }
    epoll_event ev{};
    ev.events = wanted;
    ev.data.fd = fd;
    int op = !w.registered ? EPOLL_CTL_ADD : wanted ? EPOLL_CTL_MOD : EPOLL_CTL_DEL;
    if (epoll_ctl(epoll_.get(), op, fd, &ev) < 0 && op != EPOLL_CTL_DEL) {
      // The descriptor cannot be watched (closed, or a regular file): fail its operations.
      int error = errno;
      fail_all(w.readers, error);
      fail_all(w.writers, error);
      wanted = 0;
    }
    w.registered = wanted;
    if (!wanted) waiters_.erase(fd);
  }

  void fail_all(OpList& list, int error) {
    while (Operation* op = list.pop_front()) complete_soon(op, -error);
  }

  std::size_t on_ready(int fd, std::uint32_t revents) {
    auto it = waiters_.find(fd);
    if (it == waiters_.end()) return 0;
    std::uint32_t poll_events = revents;  // EPOLLIN/OUT/ERR/HUP share their POLL* values
    bool error = revents & (EPOLLERR | EPOLLHUP);
    OpList ready;
    for (OpList* list : {&it->second.readers, &it->second.writers}) {
      bool listed_ready = error || (revents & (list == &it->second.readers ? EPOLLIN : EPOLLOUT));
      if (!listed_ready) continue;
      // Try each waiter once; the ones that completed move to `ready`.
      OpList still;
      while (Operation* op = list->pop_front()) {
        int rc = attempt(op, poll_events);
        if (rc == -EAGAIN) {
          still.push_back(op);
        } else {
          op->result = rc;
          ready.push_back(op);
        }
      }
      *list = still.take_all();
    }
    update_interest(fd, it->second);
    return deliver_all(ready);
  }

  void add_timer(Operation* op) {
    op->state = OpState::in_kernel;
    timers_.insert({to_ns(op->deadline), op});
    arm_timer();
  }

  void arm_timer() {
    itimerspec spec{};
    if (!timers_.empty()) {
      std::int64_t at = std::max<std::int64_t>(timers_.begin()->first, 1);
      spec.it_value = {static_cast<time_t>(at / 1'000'000'000), static_cast<long>(at % 1'000'000'000)};
    }
    if (timerfd_settime(timer_.get(), TFD_TIMER_ABSTIME, &spec, nullptr) < 0) throw_last_errno("timerfd_settime");
  }

  std::size_t expire_timers() {
    std::uint64_t ticks;
    [[maybe_unused]] ssize_t ignored = ::read(timer_.get(), &ticks, sizeof ticks);
    std::int64_t now = now_ns();
    OpList fired;
    while (!timers_.empty() && timers_.begin()->first <= now) {
      Operation* op = timers_.begin()->second;
      op->result = -ETIME;  // as io_uring reports a timeout that fired
      fired.push_back(op);
      timers_.erase(timers_.begin());
    }
    arm_timer();
    return deliver_all(fired);
  }

  UniqueFd epoll_;
  UniqueFd timer_;
  std::unordered_map<int, Waiters> waiters_;
  std::set<std::pair<std::int64_t, Operation*>> timers_;
};

}  // namespace

std::unique_ptr<Backend> make_epoll_backend() { return std::make_unique<EpollBackend>(); }

}  // namespace forkpool::detail
