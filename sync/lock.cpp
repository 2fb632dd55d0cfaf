#include <forkpool/sync/sync.hpp>

#include <linux/futex.h>
#include <pthread.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <system_error>

#include <forkpool/runtime/internal/io.hpp>
#include <forkpool/runtime/private/errno.hpp>
#include <forkpool/sync/private/holders.hpp>
#include <forkpool/sync/private/lock_state.hpp>
#include <forkpool/sync/private/shared_page.hpp>
#include <forkpool/sync/private/waits.hpp>

namespace forkpool {

using namespace std::chrono_literals;

// Lock: a robust, process-shared pthread mutex in a shared page. When its holder dies the kernel
// marks it (robust futex list), and the next locker gets EOWNERDEAD and makes it usable again.
namespace {

// glibc's robust mutex keeps its holder's thread id in its futex word, with FUTEX_WAITERS set
// while someone may sleep on it (the holder's unlock then wakes one sleeper).
int& futex_word_of(detail::SharedPage& page) { return page.as<detail::LockState>()->mutex.__data.__lock; }
constexpr int kWaiters = static_cast<int>(FUTEX_WAITERS);

// The value to sleep on while another holds the lock, marked FUTEX_WAITERS so that its unlock
// wakes us; 0 when nobody holds it (try to take it again).
std::uint32_t value_to_sleep_on(int& word) {
  std::atomic_ref<int> shared(word);
  int seen = shared.load();
  while ((seen & FUTEX_TID_MASK) != 0 && (seen & kWaiters) == 0)
    if (shared.compare_exchange_weak(seen, seen | kWaiters)) return static_cast<std::uint32_t>(seen | kWaiters);
  return (seen & FUTEX_TID_MASK) != 0 ? static_cast<std::uint32_t>(seen) : 0;
}
}  // namespace

Lock::Lock() : page_(detail::SharedPage::create("forkpool-lock")) {
  detail::init_robust_mutex(page_->as<detail::LockState>()->mutex, "forkpool: Lock");
}

Lock::Lock(Recursive) : page_(detail::SharedPage::create("forkpool-rlock")) {
  detail::init_robust_mutex(page_->as<detail::LockState>()->mutex, "forkpool: RLock", /*recursive=*/true);
}

bool Lock::took(int result) {
  bool taken = detail::robust_lock_taken(page_->as<detail::LockState>()->mutex, result, previous_owner_died_,
                                         "forkpool: Lock::lock");
  if (taken) page_->mutex_taken();
  return taken;
}

void Lock::lock() {
  if (!detail::wait_drives_loop())
    took(pthread_mutex_lock(&page_->as<detail::LockState>()->mutex));
  else if (!try_lock())  // free: taken without a coroutine
    detail::drive_until_done(lock_on_loop(std::nullopt), "forkpool: Lock::lock");
}

bool Lock::try_lock() { return took(pthread_mutex_trylock(&page_->as<detail::LockState>()->mutex)); }

bool Lock::try_lock_for(std::chrono::nanoseconds timeout) {
  if (detail::wait_drives_loop() && timeout > 0ns)
    return try_lock() ||
           detail::drive_until_done(lock_on_loop(detail::deadline_after(timeout)), "forkpool: Lock::try_lock_for");
  // pthread's timed lock takes a CLOCK_REALTIME deadline; the _clock form, the steady one's.
  __kernel_timespec when = detail::to_kernel_time(detail::deadline_after(timeout));  // saturates: "for ever"
  timespec deadline{static_cast<time_t>(when.tv_sec), static_cast<long>(when.tv_nsec)};
  int rc = pthread_mutex_clocklock(&page_->as<detail::LockState>()->mutex, CLOCK_MONOTONIC, &deadline);
  return took(rc);
}

bool Lock::locked() const {
  // The kernel clears the owner's thread id from the word when the owner dies (and sets
  // FUTEX_OWNER_DIED).
  return (std::atomic_ref<int>(futex_word_of(*page_)).load() & FUTEX_TID_MASK) != 0;
}

// glibc's own wait, with the sleep on the loop: mark the word, sleep while it holds that value,
// try again.
Task<bool> Lock::lock_on_loop(detail::Deadline deadline) {
  int& word = futex_word_of(*page_);
  bool slept = false;
  while (!try_lock()) {
    if (deadline && std::chrono::steady_clock::now() >= *deadline) co_return false;
    std::uint32_t seen = value_to_sleep_on(word);
    if (seen == 0) continue;  // unlocked meanwhile
    slept = true;
    auto slice_end = std::min(deadline.value_or(detail::Clock::time_point::max()), detail::deadline_after(1h));
    co_await detail::word_changed(&word, seen, slice_end, "forkpool: Lock::lock");
  }
  // Others may sleep on it too, and took their mark off with ours: this holder's unlock must wake
  // one (glibc's lock does the same after a sleep).
  if (slept) std::atomic_ref<int>(word).fetch_or(kWaiters);
  co_return true;
}

Task<void> Lock::async_lock() { co_await lock_on_loop(std::nullopt); }

bool Lock::is(const Lock& other) const { return page_->same_as(*other.page_); }

void Lock::unlock() {
  if (int rc = pthread_mutex_unlock(&page_->as<detail::LockState>()->mutex); rc != 0)
    throw std::system_error(rc, std::generic_category(), "forkpool: Lock::unlock (not held by this thread)");
  page_->mutex_released();
}

void codec<Lock>::encode(Writer& w, const Lock& lock) { detail::write_page(w, lock.page_.shared()); }
Lock codec<Lock>::decode(Reader& r) { return Lock(detail::read_page(r)); }

}  // namespace forkpool
