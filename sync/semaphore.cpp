#include <forkpool/sync/semaphore.hpp>

#include <pthread.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <stdexcept>

#include <forkpool/sync/private/waits.hpp>
#include <forkpool/sync/private/holders.hpp>
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
};
static_assert(sizeof(SemaphoreState) <= detail::SharedPage::kSize);
static_assert(std::atomic<std::int32_t>::is_always_lock_free);

SemaphoreState& state_of(detail::SharedPage& page) { return *page.as<SemaphoreState>(); }

// A holder that died mid-update: at worst a unit is lost or comes back early.
class Guard : public detail::RobustGuard {
 public:
  explicit Guard(SemaphoreState& state) : RobustGuard(state.mutex, "forkpool: Semaphore") {}
};

bool take_unit(SemaphoreState& state) {
  Guard guard(state);
  if (state.value.load() <= 0) return false;
  state.value.fetch_sub(1);
  state.holders.add(getpid(), 1);
  return true;
}

// Units held by processes that ended come back, up to the start value.
void give_back_ended(SemaphoreState& state) {
  Guard guard(state);
  std::int64_t held = state.holders.take_ended();
  std::int64_t room = std::max<std::int64_t>(0, std::int64_t{state.initial} - state.value.load());
  auto back = static_cast<std::int32_t>(std::min(held, room));
  if (back == 0) return;
  state.value.fetch_add(back);
  detail::futex_wake(&state.value, back);
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
    state.value.fetch_add(1);
    state.holders.add(getpid(), -1);
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
