#include "runtime/loop.hpp"

#include <pthread.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <vector>

#include "runtime/async_result.hpp"
#include "runtime/error.hpp"

namespace forkpool {
namespace {

constexpr unsigned kRingEntries = 256;

// initial-exec: the loop is looked up on every operation, and this library is not dlopen()ed.
__attribute__((tls_model("initial-exec"))) thread_local Loop* t_loop = nullptr;
// Bumped in every forked child (pthread_atfork): a loop made under an older generation belongs
// to an ancestor process. Cheaper than asking getpid() on every operation.
std::atomic<unsigned> g_fork_generation{0};
void note_fork_in_child() { g_fork_generation.fetch_add(1, std::memory_order_relaxed); }
// Loops inherited through fork(): their kernel objects belong to the parent. Kept reachable (not
// destroyed: their coroutines are the parent's) so leak checkers stay quiet.
std::vector<Loop*>* g_abandoned = nullptr;

std::unique_ptr<detail::Backend> choose_backend() {
  const char* forced = std::getenv("FORKPOOL_BACKEND");
  std::string choice = forced ? forced : "";
  if (choice == "epoll") return detail::make_epoll_backend();
  std::string why;
  if (auto uring = detail::make_uring_backend(kRingEntries, &why)) return uring;
  if (choice == "io_uring") throw std::runtime_error("forkpool: FORKPOOL_BACKEND=io_uring but " + why);
  return detail::make_epoll_backend();
}

void thread_exit_cleanup(void* loop) { delete static_cast<Loop*>(loop); }

pthread_key_t loop_key() {
  static pthread_key_t key = [] {
    pthread_key_t k;
    pthread_key_create(&k, &thread_exit_cleanup);
    return k;
  }();
  return key;
}

}  // namespace

Loop::Loop() : backend_(choose_backend()), generation_(g_fork_generation.load(std::memory_order_relaxed)) {
  static std::once_flag registered;
  std::call_once(registered, [] { pthread_atfork(nullptr, nullptr, &note_fork_in_child); });
}

Loop::~Loop() {
  try {
    finish_lingering();
  } catch (...) {
  }
}

Loop& Loop::current() {
  if (t_loop && t_loop->generation_ != g_fork_generation.load(std::memory_order_relaxed)) [[unlikely]] {
    // We are a forked child: leave the parent's loop untouched and make our own.
    t_loop->backend_->abandon();
    t_loop->host_fd_.reset();
    t_loop->wake_fd_.reset();
    if (!g_abandoned) g_abandoned = new std::vector<Loop*>;
    g_abandoned->push_back(t_loop);
    t_loop = nullptr;
  }
  if (!t_loop) {
    t_loop = new Loop();
    pthread_setspecific(loop_key(), t_loop);
  }
  return *t_loop;
}

Loop::DriveGuard::DriveGuard(Loop& loop, const char* who) : loop_(loop) {
  if (loop.driving_) {
    std::string message = who;
    message += " called from inside a coroutine running on the same loop: it would deadlock; co_await instead";
    throw std::logic_error(message);
  }
  loop.driving_ = true;
}

void Loop::start(detail::Operation* op) {
  backend_->start(op);
  flush_if_idle();
}

void Loop::flush_if_idle() {
  // Inside a turn the next wait submits everything in one system call; outside one (a host
  // program started work), the kernel must hear of it now.
  if (!in_turn_) backend_->flush();
}

std::size_t Loop::turn(bool block) {
  in_turn_ = true;
  std::size_t handled;
  try {
    handled = backend_->reap(block);
  } catch (...) {
    in_turn_ = false;
    throw;
  }
  in_turn_ = false;
  return handled;
}

int Loop::fd() const {
  if (!host_fd_) {
    UniqueFd set(epoll_create1(EPOLL_CLOEXEC));
    UniqueFd wake(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
    if (!set || !wake) throw_last_errno("forkpool: Loop::fd");
    for (int watched : {backend_->pollable_fd(), wake.get()}) {
      epoll_event ev{};
      ev.events = EPOLLIN;
      ev.data.fd = watched;
      if (epoll_ctl(set.get(), EPOLL_CTL_ADD, watched, &ev) < 0) throw_last_errno("forkpool: Loop::fd epoll_ctl");
    }
    int wake_fd = wake.get();
    backend_->on_soft_completion = [this, wake_fd] {
      if (in_turn_) return;  // the turn delivers it before returning
      std::uint64_t one = 1;
      [[maybe_unused]] ssize_t ignored = ::write(wake_fd, &one, sizeof one);
    };
    host_fd_ = std::move(set);
    wake_fd_ = std::move(wake);
  }
  return host_fd_.get();
}

std::size_t Loop::run_ready() {
  DriveGuard guard(*this, "forkpool::Loop::run_ready");
  if (wake_fd_) {
    std::uint64_t count;
    [[maybe_unused]] ssize_t ignored = ::read(wake_fd_.get(), &count, sizeof count);
  }
  std::size_t handled = turn(false);
  backend_->flush();
  return handled;
}

void Loop::finish_lingering() {
  while (lingering_ > 0 && outstanding() > 0) turn(true);
}

}  // namespace forkpool

namespace forkpool::detail {

bool drive_loop_until(const std::function<bool()>& ready, std::optional<std::chrono::nanoseconds> timeout,
                      const char* who) {
  if (ready()) return true;
  Loop& loop = Loop::current();
  Loop::DriveGuard guard(loop, who);
  if (!timeout) {
    loop.drive_until(ready);
    return true;
  }
  // A timer on the loop wakes the wait when the timeout passes.
  bool timer_done = false;
  Operation timer;
  timer.kind = OpKind::timeout;
  timer.context = &timer_done;
  timer.on_complete = [](Operation* op, int) { *static_cast<bool*>(op->context) = true; };
  auto deadline = std::chrono::steady_clock::now() + *timeout;
  auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(deadline.time_since_epoch()).count();
  timer.deadline = {ns / 1'000'000'000, ns % 1'000'000'000};
  loop.start(&timer);
  loop.drive_until([&] { return timer_done || ready(); });
  if (!timer_done) {
    loop.cancel(&timer);
    loop.drive_until([&] { return timer_done; });  // the timer lives on this stack
  }
  return ready();
}

}  // namespace forkpool::detail
