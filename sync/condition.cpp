#include <forkpool/sync/sync.hpp>

#include <linux/futex.h>

#include <atomic>
#include <climits>
#include <cstdint>
#include <stdexcept>
#include <string>

#include <forkpool/runtime/internal/io.hpp>
#include <forkpool/sync/private/lock_state.hpp>
#include <forkpool/sync/private/shared_page.hpp>
#include <forkpool/sync/private/waits.hpp>

namespace forkpool {

using namespace std::chrono_literals;

// Condition: a sequence number in a shared page, bumped by every notify; a waiter sleeps on it
// (futex) from the number it saw while it held the lock, so no notify is missed.
namespace {
struct ConditionState {
  std::atomic<std::uint32_t> sequence;
};
}  // namespace

Condition::Condition(Lock lock) : lock_(std::move(lock)), page_(detail::SharedPage::create("forkpool-condition")) {}

void Condition::wait(std::unique_lock<Lock>& held) { wait_for(held, detail::kForever); }

// A wait must hold the condition's own lock: under another, a notify between the caller's look
// at its predicate and the wait would be missed, and the wait could last for ever.
void Condition::check_held(const Lock* held, const char* who) const {
  if (!held) throw std::logic_error(std::string("forkpool: ") + who + " without its lock held");
  if (!held->is(lock_))
    throw std::logic_error(std::string("forkpool: ") + who + " holding another lock than the condition's (get_lock())");
}

void Condition::check_held(const std::unique_lock<Lock>& held, const char* who) const {
  check_held(held.owns_lock() ? held.mutex() : nullptr, who);
}

Condition::Condition(RLock lock) : Condition(std::move(lock.lock_)) {}

void Condition::wait(std::unique_lock<RLock>& held) { wait_for(held, detail::kForever); }

void Condition::check_held(const std::unique_lock<RLock>& held, const char* who) const {
  check_held(held.owns_lock() ? &held.mutex()->lock_ : nullptr, who);
}

bool Condition::wait_for(std::unique_lock<Lock>& held, std::chrono::nanoseconds timeout) {
  check_held(held, "Condition::wait");
  return release_and_wait(1, timeout);
}

bool Condition::wait_for(std::unique_lock<RLock>& held, std::chrono::nanoseconds timeout) {
  check_held(held, "Condition::wait");
  // glibc keeps a recursive mutex's depth beside its owner: how often this thread took it.
  return release_and_wait(static_cast<int>(lock_.page_->as<detail::LockState>()->mutex.__data.__count), timeout);
}

bool Condition::release_and_wait(int depth, std::chrono::nanoseconds timeout) {
  auto& sequence = page_->as<ConditionState>()->sequence;
  std::uint32_t seen = sequence.load();
  auto deadline = detail::deadline_after(timeout);
  for (int i = 0; i < depth; ++i) lock_.unlock();
  // Slices: a timeout of "for ever" would overflow a timespec.
  while (sequence.load() == seen) {
    auto left = deadline - std::chrono::steady_clock::now();
    if (left <= 0ns) break;
    detail::wait_for_word(&sequence, seen, std::min<std::chrono::nanoseconds>(left, 1h), "forkpool: Condition::wait");
  }
  for (int i = 0; i < depth; ++i) lock_.lock();
  return sequence.load() != seen;
}

Task<void> Condition::async_wait(std::unique_lock<Lock>& held) {
  check_held(held, "Condition::async_wait");
  std::shared_ptr<detail::SharedPage> page = page_.shared();
  auto& sequence = page->as<ConditionState>()->sequence;
  std::uint32_t seen = sequence.load();
  Lock* lock = held.release();
  lock->unlock();
  while (sequence.load() == seen)
    co_await detail::word_changed(&sequence, seen, detail::deadline_after(1h), "forkpool: Condition::async_wait");
  co_await lock->async_lock();
  held = std::unique_lock<Lock>(*lock, std::adopt_lock);
}

void Condition::notify(int n) {
  auto& sequence = page_->as<ConditionState>()->sequence;
  sequence.fetch_add(1);
  detail::futex_wake(&sequence, n);
}

void Condition::notify_all() { notify(INT_MAX); }

void codec<Condition>::encode(Writer& w, const Condition& condition) {
  codec<Lock>::encode(w, condition.lock_);
  detail::write_page(w, condition.page_.shared());
}
Condition codec<Condition>::decode(Reader& r) {
  Lock lock = codec<Lock>::decode(r);
  return Condition(std::move(lock), detail::read_page(r));
}

}  // namespace forkpool
