#include <forkpool/sync/sync.hpp>

#include <pthread.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <optional>
#include <string>
#include <system_error>

#include <forkpool/runtime/internal/io.hpp>
#include <forkpool/runtime/private/errno.hpp>
#include <forkpool/runtime/private/loaded_objects.hpp>
#include <forkpool/sync/private/holders.hpp>
#include <forkpool/sync/private/journal.hpp>
#include <forkpool/sync/private/shared_page.hpp>
#include <forkpool/sync/private/waits.hpp>

namespace forkpool {

using namespace std::chrono_literals;
using detail::RobustGuard;

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
