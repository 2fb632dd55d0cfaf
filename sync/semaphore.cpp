#include <forkpool/sync/semaphore.hpp>

#include <pthread.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <stdexcept>

#include <forkpool/sync/private/waits.hpp>
#include <forkpool/sync/private/holders.hpp>
#include <forkpool/sync/private/journal.hpp>
#include <forkpool/sync/private/shared_page.hpp>
#include <forkpool/runtime/loop.hpp>

namespace forkpool {
namespace {

using namespace std::chrono_literals;

struct SemaphoreState {
  pthread_mutex_t mutex;            // guards what follows; value is also the futex word
  std::atomic<std::int32_t> value;  // units free
  std::int32_t initial;
  std::int32_t bound;  // the most value may be: BoundedSemaphore's start value
  detail::HolderTable holders;
  // Every change of value and holders is one commit of the journal: a process killed inside
  // acquire() or release() leaves both as they were, or both changed (issue 58.3).
  detail::Journal journal;
};
static_assert(sizeof(SemaphoreState) <= detail::SharedPage::kSize);
static_assert(std::atomic<std::int32_t>::is_always_lock_free);

SemaphoreState& state_of(detail::SharedPage& page) { return *page.as<SemaphoreState>(); }

// Completes the change of a holder that died inside it.
class Guard : public detail::RobustGuard {
 public:
  explicit Guard(SemaphoreState& state) : RobustGuard(state.mutex, "forkpool: Semaphore") {
    if (holder_died()) state.journal.replay(&state);
  }
};

// Sets value to `value` and adds `delta` to what this process holds, in one commit.
void change_units(SemaphoreState& state, std::int32_t value, std::int32_t delta) {
  state.journal.commit(&state,
                       {{&state.value, static_cast<std::uint32_t>(value)}, state.holders.change(getpid(), delta)});
}

bool take_unit(SemaphoreState& state) {
  Guard guard(state);
  std::int32_t value = state.value.load();
  if (value <= 0) return false;
  change_units(state, value - 1, 1);
  return true;
}

// Units held by processes that ended come back, up to the start value.
void give_back_ended(SemaphoreState& state) {
  std::int32_t back = 0;
  {
    Guard guard(state);
    while (detail::HolderTable::Slot* slot = state.holders.ended()) {
      std::int32_t value = state.value.load();
      std::int32_t room = std::max(0, state.initial - value);
      std::int32_t returned = std::min(slot->count, room);
      state.journal.commit(&state, {{&state.value, static_cast<std::uint32_t>(value + returned)},
                                    {detail::HolderTable::word(*slot), 0}});
      back += returned;
    }
  }
  if (back > 0) detail::futex_wake(&state.value, back);
}

bool acquire_until(SemaphoreState& state, detail::Deadline deadline) {
  for (;;) {
    if (take_unit(state)) return true;
    auto now = std::chrono::steady_clock::now();
    if (deadline && now >= *deadline) {
      give_back_ended(state);
      return take_unit(state);
    }
    auto slice = deadline ? std::min<std::chrono::nanoseconds>(detail::kEndedHolderCheck, *deadline - now)
                          : detail::kEndedHolderCheck;
    detail::wait_for_word(&state.value, 0, slice, "forkpool: Semaphore::acquire");
    if (state.value.load() <= 0) give_back_ended(state);
  }
}

std::shared_ptr<detail::SharedPage> new_semaphore(int value, bool bounded) {
  if (value < 0) throw std::invalid_argument("forkpool: a Semaphore's value must be >= 0");
  auto page = detail::SharedPage::create(bounded ? "forkpool-bounded-semaphore" : "forkpool-semaphore");
  SemaphoreState& state = state_of(*page);
  detail::init_robust_mutex(state.mutex, "forkpool: Semaphore");
  state.value.store(value);
  state.initial = value;
  state.bound = bounded ? value : INT_MAX;
  return page;
}

}  // namespace

Semaphore::Semaphore(int value) : Semaphore(value, false) {}

Semaphore::Semaphore(int value, bool bounded) : page_(new_semaphore(value, bounded)) {}

void Semaphore::acquire() { acquire_until(state_of(*page_), std::nullopt); }

bool Semaphore::acquire(std::chrono::nanoseconds timeout) {
  return acquire_until(state_of(*page_), detail::deadline_unless_forever(timeout));
}

bool Semaphore::try_acquire() { return acquire(0ns); }

Task<void> Semaphore::async_acquire() {
  std::shared_ptr<detail::SharedPage> page = page_.shared();  // this handle may go first
  SemaphoreState& state = state_of(*page);
  while (!take_unit(state)) {
    co_await detail::word_changed(&state.value, 0, detail::deadline_after(detail::kEndedHolderCheck),
                                  "forkpool: Semaphore::async_acquire");
    if (state.value.load() <= 0) give_back_ended(state);
  }
}

void Semaphore::release() {
  SemaphoreState& state = state_of(*page_);
  {
    Guard guard(state);
    if (state.value.load() >= state.bound)
      throw std::logic_error(state.bound == INT_MAX
                                 ? "forkpool: Semaphore released past INT_MAX (Python: released too many times)"
                                 : "forkpool: BoundedSemaphore released more times than it was acquired");
    change_units(state, state.value.load() + 1, -1);
  }
  detail::futex_wake(&state.value, 1);
}

int Semaphore::value() const { return state_of(*page_).value.load(); }

void codec<Semaphore>::encode(Writer& w, const Semaphore& semaphore) {
  detail::write_page(w, semaphore.page_.shared());
}

Semaphore codec<Semaphore>::decode(Reader& r) {
  auto page = detail::read_page(r);
  SemaphoreState& state = state_of(*page);
  if (state.initial < 0 || state.bound < state.initial) r.fail("a Semaphore's page holds no semaphore");
  return Semaphore(std::move(page));
}

BoundedSemaphore codec<BoundedSemaphore>::decode(Reader& r) { return BoundedSemaphore(codec<Semaphore>::decode(r)); }

}  // namespace forkpool
