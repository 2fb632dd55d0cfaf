#include <forkpool/runtime/loop.hpp>

#include <poll.h>
#include <pthread.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <vector>

#include <forkpool/runtime/async_result.hpp>
#include <forkpool/runtime/private/spawned_worker.hpp>
#include <forkpool/runtime/private/errno.hpp>
#include <forkpool/runtime/internal/io.hpp>
#include <forkpool/runtime/private/loop_internals.hpp>
#include <forkpool/runtime/private/loop_wait.hpp>

namespace forkpool {
namespace {

constexpr unsigned kRingEntries = 256;

// Looked up on every operation: the library is built with TLS descriptors (meson.build), which
// cost a load when it was loaded with the program and stay correct when it is dlopen()ed.
thread_local Loop* t_loop = nullptr;
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

using detail::LoopInternals;

// Functions posted from other threads, and the eventfd whose poll, always in flight on the loop,
// completes when one is posted.
struct Loop::Door {
  std::mutex mutex;
  std::vector<std::function<void()>> posted;  // guarded by mutex
  UniqueFd fd;
  detail::Operation read;  // loop thread only

  Door() : fd(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)) {
    if (!fd) detail::throw_last_errno("forkpool: Loop's eventfd");
  }
};

Loop::Loop() : door_(std::make_unique<Door>()), backend_(choose_backend()) {
  static std::once_flag registered;
  std::call_once(registered, [] { pthread_atfork(nullptr, nullptr, &detail::LoopInternals::abandon_after_fork); });
  LoopInternals::open_door(*this);
}

void Loop::post(std::function<void()> fn) {
  bool first;
  {
    std::lock_guard lock(door_->mutex);
    first = door_->posted.empty();
    door_->posted.push_back(std::move(fn));
  }
  // One write per batch: the loop takes the whole queue at once, after which the next post writes.
  std::uint64_t one = 1;
  if (first) [[maybe_unused]]
    ssize_t ignored = ::write(door_->fd.get(), &one, sizeof one);
}

void detail::LoopInternals::open_door(Loop& loop) {
  Loop::Door& door = *loop.door_;
  door.read = {};
  door.read.kind = OpKind::poll;
  door.read.flags = POLLIN;
  door.read.fd = door.fd.get();
  door.read.context = &loop;
  door.read.on_complete = [](Operation* op, int result) {
    Loop& loop = *static_cast<Loop*>(op->context);
    if (result < 0 && result != -EINTR && result != -ECANCELED) return;  // the loop is going
    std::vector<std::function<void()>> posted;
    {
      std::lock_guard lock(loop.door_->mutex);
      std::uint64_t count;
      [[maybe_unused]] ssize_t drained = ::read(loop.door_->fd.get(), &count, sizeof count);  // under the lock:
      posted.swap(loop.door_->posted);  // a post after it finds the queue empty and writes again
    }
    open_door(loop);  // before running them: one may post again
    for (auto& fn : posted) {
      try {
        fn();
      } catch (...) {
        report_callback_failure("a function given to Loop::post");
      }
    }
  };
  start(loop, &door.read);
}

Loop::~Loop() {
  LoopInternals::tell_leave_listeners(*this, &detail::LeaveListener::loop_ending);
  try {
    LoopInternals::finish(*this);
  } catch (...) {}
}

const char* Loop::backend_name() const { return backend_->name(); }

Loop& Loop::current() {
  if (!t_loop) [[unlikely]] {
    t_loop = new Loop();
    pthread_setspecific(loop_key(), t_loop);
  }
  return *t_loop;
}

void detail::LoopInternals::abandon_after_fork() {
  // In the child, at once: the descriptors still have the numbers the loop knows (a helper
  // process renumbers its own later). The parent's coroutines are left alone; the child makes a
  // fresh loop on first use.
  Loop* inherited = std::exchange(t_loop, nullptr);
  if (!inherited) return;
  inherited->backend_->abandon();
  inherited->host_fd_.reset();
  inherited->wake_fd_.reset();
  inherited->door_->fd.reset();
  if (!g_abandoned) g_abandoned = new std::vector<Loop*>;
  g_abandoned->push_back(inherited);
  pthread_setspecific(loop_key(), nullptr);
}

detail::LoopInternals::DriveGuard::DriveGuard(Loop& loop, const char* who) : loop_(loop) {
  // A loop is driven only by its own thread: its ring and coroutines are not shared.
  if (&loop != t_loop)
    throw std::logic_error(std::string(who) +
                           " called on a loop from a thread that does not own it: a loop belongs to the thread "
                           "that made it (Loop::current()); hand work to it with Loop::post");
  if (loop.driving_) {
    std::string message = who;
    message +=
        " called from inside a coroutine running on the same loop (or a callback the loop runs): it would "
        "deadlock; co_await instead";
    throw std::logic_error(message);
  }
  loop.driving_ = true;
}

void detail::LoopInternals::start(Loop& loop, Operation* op) {
  loop.backend_->start(op);
  // Inside a turn the next wait submits everything in one system call; outside one (a host
  // program started work), the kernel must hear of it now.
  if (!loop.in_turn_) loop.backend_->flush();
}

detail::LoopInternals::DriveGuard::~DriveGuard() {
  loop_.driving_ = false;
  tell_leave_listeners(loop_, &LeaveListener::loop_left);
}

void detail::LoopInternals::tell_leave_listeners(Loop& loop, void (LeaveListener::*event)() noexcept) {
  auto& listeners = loop.leave_listeners_;
  std::erase_if(listeners, [](const std::weak_ptr<LeaveListener>& l) { return l.expired(); });
  for (std::size_t i = 0; i < listeners.size(); ++i)
    if (std::shared_ptr<LeaveListener> listener = listeners[i].lock()) (listener.get()->*event)();
}

void detail::LoopInternals::add_leave_listener(Loop& loop, std::weak_ptr<LeaveListener> listener) {
  loop.leave_listeners_.push_back(std::move(listener));
}

void detail::LoopInternals::add_spinner(Loop& loop, Spinner* spinner) { loop.spinners_.push_back(spinner); }

void detail::LoopInternals::remove_spinner(Loop& loop, Spinner* spinner) noexcept {
  std::erase(loop.spinners_, spinner);
}

namespace {

// Tells every spinner's peer to wake us through the kernel from now on; counts what came first.
std::size_t announce_sleep(std::vector<detail::Spinner*>& spinners) {
  std::size_t handled = 0;
  for (std::size_t i = 0; i < spinners.size(); ++i) handled += spinners[i]->prepare_to_sleep() ? 1 : 0;
  return handled;
}

// Before a blocking turn sleeps: polls the spinners (and now and then the kernel's completions)
// for as long as the largest budget; if nothing came, lets each announce the sleep. Returns what
// it handled; zero means the turn may sleep. A spinner may remove itself while polled: iterate
// by index.
std::size_t spin_before_sleep(std::vector<detail::Spinner*>& spinners, detail::Backend& backend) {
  std::chrono::nanoseconds budget{0}, typical_gap = std::chrono::nanoseconds::max();
  std::size_t busy = 0;  // spinners that expect a message: the shortest typical wait decides
  for (std::size_t i = 0; i < spinners.size(); ++i)
    if (std::chrono::nanoseconds wanted = spinners[i]->spin_budget(); wanted.count() > 0) {
      ++busy;
      budget = std::max(budget, wanted);
      typical_gap = std::min(typical_gap, spinners[i]->typical_gap());
    }
  if (budget.count() > 0 && !detail::spin_takes_a_busy_cpu(busy, typical_gap)) {
    std::size_t handled = 0;
    detail::SpinOutcome spun = detail::spin_for(budget, [&](std::uint64_t polls) {
      for (std::size_t i = 0; i < spinners.size(); ++i) handled += spinners[i]->poll() ? 1 : 0;
      if (handled == 0 && polls % detail::kPollsPerClockRead == 0) handled = backend.reap(false);  // a timer, a post
      return handled > 0;
    });
    detail::count_spin_polls(spun.polls);
    if (spun.preempted)
      for (std::size_t i = 0; i < spinners.size(); ++i) spinners[i]->saw_preemption();
    if (handled > 0) return handled;  // awake: the peers need not wake us
  }
  return announce_sleep(spinners);
}

}  // namespace

std::size_t detail::LoopInternals::turn(Loop& loop, bool block) {
  loop.in_turn_ = true;
  std::size_t handled = 0;
  try {
    if (block && !loop.spinners_.empty()) {
      handled = loop.backend_->reap(false);
      if (handled == 0) {
        detail::run_loop_wait_hooks();  // (while the peers work: off the path of what they send)
        handled = spin_before_sleep(loop.spinners_, *loop.backend_);
      }
    }
    if (handled == 0) handled = loop.backend_->reap(block);
    // A turn that does not block may be a host loop's (run_ready): it sleeps in its own poll,
    // after this returns, so the peers must wake it through the kernel.
    if (!block) handled += announce_sleep(loop.spinners_);
  } catch (...) {
    loop.in_turn_ = false;
    throw;
  }
  loop.in_turn_ = false;
  return handled;
}

// With nothing else in flight, the loop still waits: another thread may post what ends the wait.
void detail::LoopInternals::drive_until(Loop& loop, const std::function<bool()>& done) {
  while (!done()) turn(loop, true);
}

void detail::LoopInternals::finish(Loop& loop) {
  while (loop.finishing_.active() > 0 && outstanding(loop) > 0) turn(loop, true);
}

Loop* detail::LoopInternals::existing() noexcept { return t_loop; }

std::size_t detail::LoopInternals::outstanding(const Loop& loop) noexcept {
  return loop.backend_->outstanding() - (loop.door_->read.state == OpState::idle ? 0 : 1);  // not the door
}

int Loop::fd() const {
  if (!host_fd_) {
    UniqueFd set(epoll_create1(EPOLL_CLOEXEC));
    UniqueFd wake(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
    if (!set || !wake) detail::throw_last_errno("forkpool: Loop::fd");
    for (int watched : {backend_->pollable_fd(), wake.get()}) {
      epoll_event ev{};
      ev.events = EPOLLIN;
      ev.data.fd = watched;
      if (epoll_ctl(set.get(), EPOLL_CTL_ADD, watched, &ev) < 0)
        detail::throw_last_errno("forkpool: Loop::fd epoll_ctl");
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
  LoopInternals::DriveGuard guard(*this, "forkpool::Loop::run_ready");
  if (wake_fd_) {
    std::uint64_t count;
    [[maybe_unused]] ssize_t ignored = ::read(wake_fd_.get(), &count, sizeof count);
  }
  std::size_t handled = LoopInternals::turn(*this, false);
  backend_->flush();
  return handled;
}

Task<void> sleep_until(detail::Clock::time_point when) { co_await detail::wait_until(when); }
Task<void> sleep_for(std::chrono::nanoseconds duration) {
  co_await detail::wait_until(detail::deadline_after(duration));
}

}  // namespace forkpool

namespace forkpool::detail {

void run_until_done(std::coroutine_handle<> task) {
  serve_if_spawned_worker();  // a spawned worker's program reaching run() becomes the worker
  Loop& loop = Loop::current();
  LoopInternals::DriveGuard guard(loop, "forkpool::run");
  task.resume();
  LoopInternals::drive_until(loop, [&] { return task.done(); });
  LoopInternals::finish(loop);
}

}  // namespace forkpool::detail
