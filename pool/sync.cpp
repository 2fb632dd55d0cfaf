#include <forkpool/pool/sync.hpp>

#include <poll.h>
#include <pthread.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <climits>
#include <stdexcept>
#include <system_error>

#include <forkpool/pool/internal/fd_wait.hpp>
#include <forkpool/pool/internal/shared_page.hpp>
#include <forkpool/runtime/internal/errno.hpp>
#include <forkpool/runtime/internal/io.hpp>

namespace forkpool {

// Event: an eventfd whose count is non-zero while set. poll() says readable while it is, so
// waiting (blocking, or on the loop) never consumes it; clear() reads the count back to zero.
struct Event::State {
  UniqueFd fd;
};

Event::Event() : state_(std::make_shared<State>()) {
  int fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (fd < 0) detail::throw_last_errno("forkpool: Event: eventfd");
  state_->fd = UniqueFd(fd);
}

int Event::fd() const noexcept { return state_->fd.get(); }

void Event::set() {
  std::uint64_t one = 1;
  if (write(fd(), &one, sizeof one) < 0 && errno != EAGAIN) detail::throw_last_errno("forkpool: Event::set");
}

void Event::clear() {
  std::uint64_t count;
  if (read(fd(), &count, sizeof count) < 0 && errno != EAGAIN) detail::throw_last_errno("forkpool: Event::clear");
}

bool Event::is_set() const { return wait(std::chrono::nanoseconds::zero()); }

bool Event::wait(std::chrono::nanoseconds timeout) const {
  return detail::wait_for_fd(fd(), POLLIN, detail::deadline_after(timeout), "forkpool: Event::wait");
}

Task<void> Event::async_wait() const {
  auto state = state_;  // the event outlives the wait
  int rc = co_await wait_readable(state->fd.get());
  if (rc < 0) throw std::system_error(-rc, std::generic_category(), "forkpool: Event::async_wait");
  co_return;
}

void codec<Event>::encode(Writer& w, const Event& event) { w.write(w.attach_fd(event.fd(), event.state_)); }

Event codec<Event>::decode(Reader& r) {
  UniqueFd fd = r.take_fd(r.read<std::uint32_t>());
  // An eventfd's link reads "anon_inode:[eventfd]": anything else is not an event.
  char link[64] = {};
  std::string path = "/proc/self/fd/" + std::to_string(fd.get());
  if (readlink(path.c_str(), link, sizeof link - 1) < 0 || std::string_view(link) != "anon_inode:[eventfd]")
    r.fail("an Event's descriptor is not an eventfd");
  auto state = std::make_shared<Event::State>();
  state->fd = std::move(fd);
  return Event(std::move(state));
}

// Lock: a robust, process-shared pthread mutex in a shared page. When its holder dies the kernel
// marks it (robust futex list), and the next locker gets EOWNERDEAD and makes it usable again.
namespace {
struct LockState {
  pthread_mutex_t mutex;
};
}  // namespace

Lock::Lock() : page_(detail::SharedPage::create("forkpool-lock")) {
  detail::init_robust_mutex(page_->as<LockState>()->mutex, "forkpool: Lock");
}

bool Lock::took(int result) {
  return detail::robust_lock_taken(page_->as<LockState>()->mutex, result, previous_owner_died_, "forkpool: Lock::lock");
}

void Lock::lock() { took(pthread_mutex_lock(&page_->as<LockState>()->mutex)); }
bool Lock::try_lock() { return took(pthread_mutex_trylock(&page_->as<LockState>()->mutex)); }

bool Lock::try_lock_for(std::chrono::nanoseconds timeout) {
  // pthread's timed lock takes a CLOCK_REALTIME deadline; the _clock form, the steady one's.
  __kernel_timespec when = to_kernel_time(forkpool::deadline_after(timeout));  // saturates: "for ever"
  timespec deadline{static_cast<time_t>(when.tv_sec), static_cast<long>(when.tv_nsec)};
  int rc = pthread_mutex_clocklock(&page_->as<LockState>()->mutex, CLOCK_MONOTONIC, &deadline);
  return took(rc);
}

void Lock::unlock() {
  if (int rc = pthread_mutex_unlock(&page_->as<LockState>()->mutex); rc != 0)
    throw std::system_error(rc, std::generic_category(), "forkpool: Lock::unlock (not held by this thread)");
}

void codec<Lock>::encode(Writer& w, const Lock& lock) { w.write(w.attach_fd(lock.page_->fd(), lock.page_)); }
Lock codec<Lock>::decode(Reader& r) { return Lock(detail::SharedPage::adopt(r.take_fd(r.read<std::uint32_t>()))); }

// Barrier: arrivals counted in a shared page; the last one of a round starts the next
// generation, which the others wait for on a futex.
namespace {
struct BarrierState {
  std::atomic<std::uint32_t> arrived;
  std::atomic<std::uint32_t> generation;
  std::int32_t parties;
};
static_assert(std::atomic<std::uint32_t>::is_always_lock_free);
}  // namespace

Barrier::Barrier(int parties) {
  if (parties < 1) throw std::invalid_argument("forkpool: Barrier needs parties >= 1");
  page_ = detail::SharedPage::create("forkpool-barrier");
  page_->as<BarrierState>()->parties = parties;
}

int Barrier::parties() const noexcept { return page_->as<BarrierState>()->parties; }

void Barrier::wait() {
  auto* state = page_->as<BarrierState>();
  std::uint32_t generation = state->generation.load();
  if (state->arrived.fetch_add(1) + 1 == static_cast<std::uint32_t>(state->parties)) {
    state->arrived.store(0);
    state->generation.fetch_add(1);
    detail::futex_wake_all(&state->generation);
    return;
  }
  while (state->generation.load() == generation) detail::futex_wait(&state->generation, generation, nullptr);
}

void codec<Barrier>::encode(Writer& w, const Barrier& barrier) {
  w.write(w.attach_fd(barrier.page_->fd(), barrier.page_));
}
Barrier codec<Barrier>::decode(Reader& r) {
  auto page = detail::SharedPage::adopt(r.take_fd(r.read<std::uint32_t>()));
  if (page->as<BarrierState>()->parties < 1) r.fail("a Barrier of fewer than one party");
  return Barrier(std::move(page));
}

}  // namespace forkpool
