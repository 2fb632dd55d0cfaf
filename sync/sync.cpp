#include <forkpool/sync/sync.hpp>

#include <linux/futex.h>
#include <poll.h>
#include <pthread.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <optional>
#include <stdexcept>
#include <string>
#include <system_error>

#include <forkpool/sync/private/waits.hpp>
#include <forkpool/sync/private/holders.hpp>
#include <forkpool/sync/private/journal.hpp>
#include <forkpool/sync/private/shared_page.hpp>
#include <forkpool/runtime/private/errno.hpp>
#include <forkpool/runtime/private/loaded_objects.hpp>
#include <forkpool/runtime/internal/io.hpp>
#include <forkpool/runtime/loop.hpp>

namespace forkpool {

using namespace std::chrono_literals;

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

int Event::fd() const { return state_->fd.get(); }

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
  return detail::wait_for_fd(fd(), POLLIN, detail::deadline_unless_forever(timeout), "forkpool: Event::wait");
}

Task<void> Event::async_wait() const {
  auto state = state_;  // the event outlives the wait
  int rc = co_await detail::wait_readable(state->fd.get());
  if (rc < 0) throw std::system_error(-rc, std::generic_category(), "forkpool: Event::async_wait");
  co_return;
}

void codec<Event>::encode(Writer& w, const Event& event) { w.write_fd(event.fd(), event.state_.shared()); }

Event codec<Event>::decode(Reader& r) {
  UniqueFd fd = r.read_fd();
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

// glibc's robust mutex keeps its holder's thread id in its futex word, with FUTEX_WAITERS set
// while someone may sleep on it (the holder's unlock then wakes one sleeper).
int& futex_word_of(detail::SharedPage& page) { return page.as<LockState>()->mutex.__data.__lock; }
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
  detail::init_robust_mutex(page_->as<LockState>()->mutex, "forkpool: Lock");
}

Lock::Lock(Recursive) : page_(detail::SharedPage::create("forkpool-rlock")) {
  detail::init_robust_mutex(page_->as<LockState>()->mutex, "forkpool: RLock", /*recursive=*/true);
}

bool Lock::took(int result) {
  bool taken =
      detail::robust_lock_taken(page_->as<LockState>()->mutex, result, previous_owner_died_, "forkpool: Lock::lock");
  if (taken) page_->mutex_taken();
  return taken;
}

void Lock::lock() {
  if (!detail::wait_drives_loop())
    took(pthread_mutex_lock(&page_->as<LockState>()->mutex));
  else if (!try_lock())  // free: taken without a coroutine
    detail::drive_until_done(lock_on_loop(std::nullopt), "forkpool: Lock::lock");
}

bool Lock::try_lock() { return took(pthread_mutex_trylock(&page_->as<LockState>()->mutex)); }

bool Lock::try_lock_for(std::chrono::nanoseconds timeout) {
  if (detail::wait_drives_loop() && timeout > 0ns)
    return try_lock() ||
           detail::drive_until_done(lock_on_loop(detail::deadline_after(timeout)), "forkpool: Lock::try_lock_for");
  // pthread's timed lock takes a CLOCK_REALTIME deadline; the _clock form, the steady one's.
  __kernel_timespec when = detail::to_kernel_time(detail::deadline_after(timeout));  // saturates: "for ever"
  timespec deadline{static_cast<time_t>(when.tv_sec), static_cast<long>(when.tv_nsec)};
  int rc = pthread_mutex_clocklock(&page_->as<LockState>()->mutex, CLOCK_MONOTONIC, &deadline);
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
  if (int rc = pthread_mutex_unlock(&page_->as<LockState>()->mutex); rc != 0)
    throw std::system_error(rc, std::generic_category(), "forkpool: Lock::unlock (not held by this thread)");
  page_->mutex_released();
}

void codec<Lock>::encode(Writer& w, const Lock& lock) { detail::write_page(w, lock.page_.shared()); }
Lock codec<Lock>::decode(Reader& r) { return Lock(detail::read_page(r)); }

using detail::RobustGuard;

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
  return release_and_wait(lock_.page_->as<LockState>()->mutex.__data.__count, timeout);
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

// Barrier: arrivals of the current round counted in a shared page under a robust mutex, with
// the arrived parties' pids; the last arrival starts the next generation, which the others wait
// for on a futex. Breaking also starts one, with `broken_round` saying which round broke.
namespace {
struct BarrierState {
  pthread_mutex_t mutex;
  std::atomic<std::uint32_t> generation;  // the futex word
  std::int32_t parties;
  std::int32_t arrived;
  std::int32_t broken;          // until reset()
  std::uint32_t broken_round;   // the generation that broke, plus one (0: none yet)
  std::int32_t died;            // the party whose death broke it (0: none)
  detail::HolderTable waiting;  // who arrived this round
  // The words above change together in one commit (a party killed inside wait() leaves them as
  // they were, or all changed); `waiting` is emptied after a round's commit, and on recovery
  // whenever nobody has arrived (issue 58.3).
  detail::Journal journal;
};
static_assert(sizeof(BarrierState) <= detail::SharedPage::kSize);
static_assert(std::atomic<std::uint32_t>::is_always_lock_free);

// Holds the barrier's mutex; completes the change of a party that died inside it.
class BarrierGuard : public detail::RobustGuard {
 public:
  BarrierGuard(BarrierState& state, const char* who) : RobustGuard(state.mutex, who) {
    if (!holder_died()) return;
    state.journal.replay(&state);
    if (state.arrived == 0) state.waiting.clear();
  }
};

// Under the mutex: the next round starts (broken, by `died` if a party died); its waiters wake.
void next_round(BarrierState& state, bool broken, pid_t died = 0) {
  std::uint32_t generation = state.generation.load();
  if (broken) {
    state.journal.commit(&state, {{&state.broken, 1},
                                  {&state.broken_round, generation + 1},
                                  {&state.died, static_cast<std::uint32_t>(died)},
                                  {&state.arrived, 0},
                                  {&state.generation, generation + 1}});
  } else {
    state.journal.commit(&state, {{&state.arrived, 0}, {&state.generation, generation + 1}});
  }
  state.waiting.clear();
  detail::futex_wake_all(&state.generation);
}

[[noreturn]] void throw_broken(const BarrierState& state, const char* why) {
  if (state.died != 0)
    throw BrokenBarrierError("forkpool: Barrier broken: a party (process " + std::to_string(state.died) +
                             ") died while the others waited; reset() it to use it again");
  throw BrokenBarrierError(std::string("forkpool: Barrier broken: ") + why);
}

std::shared_ptr<detail::SharedPage> new_barrier(int parties) {
  if (parties < 1) throw std::invalid_argument("forkpool: Barrier needs parties >= 1");
  auto page = detail::SharedPage::create("forkpool-barrier");
  BarrierState& state = *page->as<BarrierState>();
  detail::init_robust_mutex(state.mutex, "forkpool: Barrier");
  state.parties = parties;
  return page;
}
}  // namespace

Barrier::Barrier(int parties, Action action) : page_(new_barrier(parties)), action_(action) {}

int Barrier::parties() const { return page_->as<BarrierState>()->parties; }

// Counts this party in; the last one of the round starts the next.
Barrier::Arrival Barrier::arrive() {
  BarrierState& state = *page_->as<BarrierState>();
  BarrierGuard guard(state, "forkpool: Barrier::wait");
  if (state.broken) throw_broken(state, "aborted, or a round before failed (reset() it)");
  Arrival arrival{state.generation.load(), state.arrived, false};
  if (state.arrived + 1 == state.parties) {
    if (action_) {
      try {
        action_();  // before the others are released, as Python's
      } catch (...) {
        next_round(state, /*broken=*/true);
        throw;
      }
    }
    next_round(state, /*broken=*/false);
    arrival.last = true;
  } else {
    auto arrived = static_cast<std::uint32_t>(state.arrived + 1);
    state.journal.commit(&state, {{&state.arrived, arrived}, state.waiting.change(getpid(), 1)});
  }
  return arrival;
}

// The arrival's index once its round is over; nothing while it goes on. Throws
// BrokenBarrierError when the round broke, or breaks it when the deadline passed or (looking
// for them when `look_for_ended`) a party that arrived has ended.
std::optional<int> Barrier::round_over(const Arrival& arrival, std::chrono::steady_clock::time_point deadline,
                                       bool look_for_ended) {
  BarrierState& state = *page_->as<BarrierState>();
  if (state.generation.load() == arrival.generation && std::chrono::steady_clock::now() < deadline && !look_for_ended)
    return std::nullopt;
  BarrierGuard guard(state, "forkpool: Barrier::wait");
  if (state.generation.load() != arrival.generation) {
    if (state.broken_round == arrival.generation + 1) throw_broken(state, "aborted, reset, or a party failed");
    return arrival.index;
  }
  if (std::chrono::steady_clock::now() >= deadline) {
    next_round(state, /*broken=*/true);
    throw_broken(state, "a wait timed out");
  }
  if (detail::HolderTable::Slot* ended = state.waiting.ended()) {
    next_round(state, /*broken=*/true, ended->pid);
    throw_broken(state, "a party died while the others waited");
  }
  return std::nullopt;
}

int Barrier::wait(std::chrono::nanoseconds timeout) {
  BarrierState& state = *page_->as<BarrierState>();
  auto deadline = detail::deadline_after(timeout);
  Arrival arrival = arrive();
  if (arrival.last) return arrival.index;
  for (;;) {
    auto left = std::max<std::chrono::nanoseconds>(deadline - std::chrono::steady_clock::now(), 0ns);
    detail::wait_for_word(&state.generation, arrival.generation,
                          std::min<std::chrono::nanoseconds>(left, detail::kEndedHolderCheck),
                          "forkpool: Barrier::wait");
    bool slice_ended = state.generation.load() == arrival.generation;  // nobody woke us: look for the dead
    if (std::optional<int> index = round_over(arrival, deadline, slice_ended)) return *index;
  }
}

Task<int> Barrier::async_wait() {
  Barrier self = *this;  // this handle may go first
  Arrival arrival = self.arrive();
  if (arrival.last) co_return arrival.index;
  auto never = std::chrono::steady_clock::time_point::max();
  BarrierState& state = *self.page_->as<BarrierState>();
  for (;;) {
    co_await detail::word_changed(&state.generation, arrival.generation,
                                  detail::deadline_after(detail::kEndedHolderCheck), "forkpool: Barrier::async_wait");
    bool slice_ended = state.generation.load() == arrival.generation;  // nobody woke us: look for the dead
    if (std::optional<int> index = self.round_over(arrival, never, slice_ended)) co_return *index;
  }
}

void Barrier::abort() {
  BarrierState& state = *page_->as<BarrierState>();
  BarrierGuard guard(state, "forkpool: Barrier::abort");
  next_round(state, /*broken=*/true);
}

void Barrier::reset() {
  BarrierState& state = *page_->as<BarrierState>();
  BarrierGuard guard(state, "forkpool: Barrier::reset");
  if (state.arrived > 0) next_round(state, /*broken=*/true);  // those waiting now fail
  state.journal.commit(&state, {{&state.broken, 0}, {&state.died, 0}});
}

bool Barrier::broken() const {
  BarrierState& state = *page_->as<BarrierState>();
  RobustGuard guard(state.mutex, "forkpool: Barrier::broken");
  return state.broken != 0;
}

int Barrier::n_waiting() const {
  BarrierState& state = *page_->as<BarrierState>();
  RobustGuard guard(state.mutex, "forkpool: Barrier::n_waiting");
  return state.arrived;
}

// The page, then the action as where it is in its object (detail::CodeAddress): a process maps
// the same program and objects at other addresses (spawn), and finds the object already loaded.
void codec<Barrier>::encode(Writer& w, const Barrier& barrier) {
  detail::write_page(w, barrier.page_.shared());
  std::optional<detail::CodeAddress> action;
  if (barrier.action_) {
    action = detail::code_address_of(reinterpret_cast<std::uintptr_t>(barrier.action_));
    if (!action) throw Error("forkpool: a Barrier's action is in no loaded object: it cannot be sent");
  }
  w.write(action.has_value());
  if (action) {
    w.write(action->path);
    w.write(action->build_id);
    w.write(action->offset);
  }
}
Barrier codec<Barrier>::decode(Reader& r) {
  auto page = detail::read_page(r);
  if (page->as<BarrierState>()->parties < 1) r.fail("a Barrier of fewer than one party");
  Barrier::Action action = nullptr;
  if (r.read<bool>()) {
    detail::CodeAddress where;
    where.path = r.read<std::string>();
    where.build_id = r.read<std::string>();
    where.offset = r.read<std::uint64_t>();
    std::optional<std::uintptr_t> address = detail::loaded_address(where);
    if (!address)
      r.fail("a Barrier's action in " + (where.path.empty() ? std::string("the main program") : where.path) +
             ", which this process has not loaded (or another build of it)");
    action = reinterpret_cast<Barrier::Action>(*address);
  }
  return Barrier(std::move(page), action);
}

}  // namespace forkpool
