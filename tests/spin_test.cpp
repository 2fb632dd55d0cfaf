// Spinning before sleeping (PoolOptions::spin): the pool polls only while work is in flight,
// never with spin = 0, and an idle pool costs (almost) no CPU. And batching: a worker whose jobs
// are short is given more at once, one whose job was long goes back to two.

#include <gtest/gtest.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <new>
#include <optional>
#include <thread>
#include <vector>

#include <forkpool/pool/internal/pool_internals.hpp>
#include <forkpool/pool/pool.hpp>
#include <forkpool/runtime/private/loop_wait.hpp>
#include <forkpool/runtime/private/spin.hpp>
#include <forkpool/runtime/loop.hpp>
#include "support.hpp"

namespace forkpool {
namespace {

using namespace std::chrono_literals;

int ident(int x) { return x; }
int nap(int ms) {
  std::this_thread::sleep_for(std::chrono::milliseconds(ms));
  return ms;
}

// Polls done so far by this process's loop and by the pool's live workers.
std::uint64_t polls_of(Pool& pool) {
  return detail::spin_polls() + detail::PoolInternals::core(pool).worker_spin_polls();
}

void round_trips(Pool& pool, int count) {
  auto body = [&]() -> Task<void> {
    for (int i = 0; i < count; ++i) EXPECT_EQ(co_await pool.apply_async(ident, i), i);
    std::vector<int> inputs(2000, 3);
    EXPECT_EQ((co_await pool.map(ident, inputs, 1)).size(), inputs.size());
  };
  run(body());
}

std::atomic<int> waits_seen_by_once{0}, waits_seen_by_twice{0};
void count_once() noexcept { waits_seen_by_once.fetch_add(1, std::memory_order_relaxed); }
void count_twice() noexcept { waits_seen_by_twice.fetch_add(1, std::memory_order_relaxed); }

// A loop-wait hook (forkpool-torch makes its next TensorImpl there) runs whenever a pool's loop
// is about to wait for a worker, whether it then spins or sleeps: at least once a round trip to a
// task that naps. A hook registered twice runs once a wait, as one registered once.
TEST(Spin, ALoopWaitHookRunsWheneverThePoolsLoopWaitsForAWorker) {
  detail::at_every_loop_wait(&count_once);
  detail::at_every_loop_wait(&count_twice);
  detail::at_every_loop_wait(&count_twice);
  for (std::optional<std::chrono::nanoseconds> spin : {std::optional<std::chrono::nanoseconds>{}, std::optional{0ns}}) {
    SCOPED_TRACE(spin ? "spin = 0" : "spin adaptive");
    Pool pool({.processes = 1, .spin = spin});
    int before = waits_seen_by_once.load();
    for (int i = 0; i < 50; ++i) EXPECT_EQ(pool.apply_async(nap, 1).get(20s), 1);
    EXPECT_GE(waits_seen_by_once.load() - before, 50);
  }
  EXPECT_EQ(waits_seen_by_twice.load(), waits_seen_by_once.load());
}

TEST(Spin, WithSpinZeroNeitherThePoolNorItsWorkersEverPoll) {
  Pool pool({.processes = 2, .spin = 0ns});
  std::uint64_t before = polls_of(pool);
  round_trips(pool, 2000);
  EXPECT_EQ(polls_of(pool), before);
}

TEST(Spin, ByDefaultBothSidesPollWhileWorkIsInFlight) {
  Pool pool({.processes = 2});
  std::uint64_t parent_before = detail::spin_polls();
  round_trips(pool, 2000);
  EXPECT_GT(detail::spin_polls(), parent_before);
  EXPECT_GT(detail::PoolInternals::core(pool).worker_spin_polls(), 0u);
}

// One wait that was long by chance (a peer preempted) does not make a waiter think its waits are
// long; four in a row do.
TEST(Spin, AWaiterTakesTheShortestOfItsRecentWaitsAsTypical) {
  detail::AdaptiveSpin spin;
  EXPECT_EQ(spin.typical_gap(), 0ns) << "no wait seen: taken as short";
  for (int i = 0; i < 4; ++i) spin.record(40us);
  EXPECT_EQ(spin.typical_gap(), 40us);
  spin.record(1us);
  spin.record(900us);
  EXPECT_EQ(spin.typical_gap(), 1us);
  for (int i = 0; i < 2; ++i) spin.record(30us);
  EXPECT_EQ(spin.typical_gap(), 1us) << "the short wait is one of the last four";
  spin.record(30us);
  EXPECT_EQ(spin.typical_gap(), 30us);
}

// With a busy worker behind every CPU, the parent's spin would take one of their CPUs: it spins
// only for waits that are typically short, and sleeps through long ones.
TEST(Spin, ASpinThatWouldTakeABusyWorkersCpuIsOnlyForShortWaits) {
  constexpr std::size_t kMoreWorkersThanCpus = 4096;
  EXPECT_TRUE(detail::spin_takes_a_busy_cpu(kMoreWorkersThanCpus, 40us));
  EXPECT_FALSE(detail::spin_takes_a_busy_cpu(kMoreWorkersThanCpus, 2us)) << "a short wait is worth a spin";
  EXPECT_FALSE(detail::spin_takes_a_busy_cpu(0, 40us)) << "a CPU is free for the spin";
}

std::chrono::milliseconds own_cpu_time() {
  rusage usage{};
  getrusage(RUSAGE_THREAD, &usage);
  auto ms = [](timeval t) { return std::chrono::milliseconds(t.tv_sec * 1000 + t.tv_usec / 1000); };
  return ms(usage.ru_utime) + ms(usage.ru_stime);
}

TEST(Spin, AnIdlePoolUsesUnderOnePercentOfACpu) {
  Pool pool({.processes = 2});
  round_trips(pool, 2000);  // the spin budgets are warm
  std::vector<pid_t> workers = pool.worker_pids();
  std::chrono::milliseconds before = own_cpu_time();
  for (pid_t w : workers) before += test_support::cpu_time_of(w);
  std::uint64_t parent_polls = detail::spin_polls();
  run(sleep_for(2s));  // the loop is driven, the pool holds no work
  std::chrono::milliseconds after = own_cpu_time();
  for (pid_t w : workers) after += test_support::cpu_time_of(w);
  EXPECT_LT(after - before, test_support::scaled(20ms));
  EXPECT_EQ(detail::spin_polls(), parent_polls);  // nothing in flight: the loop never spun
}

// Polls a spin does until a child forked onto this CPU (both pinned to it) has run.
std::uint64_t polls_until_a_child_on_this_cpu_runs() {
  cpu_set_t own, one;
  EXPECT_EQ(sched_getaffinity(0, sizeof own, &own), 0);
  CPU_ZERO(&one);
  CPU_SET(sched_getcpu(), &one);
  EXPECT_EQ(sched_setaffinity(0, sizeof one, &one), 0);  // the child inherits it
  void* page = mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  EXPECT_NE(page, MAP_FAILED);
  auto* arrived = new (page) std::atomic<int>(0);
  pid_t child = fork();
  if (child == 0) {
    arrived->store(1);
    _exit(0);
  }
  EXPECT_GT(child, 0);
  std::uint64_t polls = 0;
  auto give_up = std::chrono::steady_clock::now() + 10s;
  while (child > 0 && std::chrono::steady_clock::now() < give_up) {  // a spin that lost the CPU ends early
    detail::SpinOutcome spun = detail::spin_for(1s, [&](std::uint64_t) { return arrived->load() != 0; });
    polls += spun.polls;
    if (spun.found) break;
  }
  EXPECT_EQ(sched_setaffinity(0, sizeof own, &own), 0);
  int status = 0;
  if (child > 0) {
    EXPECT_EQ(waitpid(child, &status, 0), child);
  }
  EXPECT_EQ(arrived->load(), 1);
  munmap(page, 4096);
  return polls;
}

// With more busy processes than CPUs (a parent and two workers on two CPUs) the process a spin
// waits for may need the spinner's own CPU. A spin that lasts offers it (sched_yield), so that
// process runs within a few polls, not when the scheduler's slice (milliseconds) runs out.
TEST(Spin, ASpinLetsTheProcessItWaitsForRunOnTheSameCpu) {
  int waited = 0;  // rounds where the child had not run before the first poll
  for (int attempt = 0; attempt < 100 && waited < 3; ++attempt) {
    std::uint64_t polls = polls_until_a_child_on_this_cpu_runs();
    if (polls <= 1) continue;
    ++waited;
    // A yield comes after 2 µs of polling (~100 polls), then every 64 (a busy machine may run
    // others first); without them, the child waits for the slice to end: 40,000 polls and more.
    EXPECT_LT(polls, 5000u) << "the spin kept the CPU from the process it waited for";
  }
  if (waited == 0) GTEST_SKIP() << "the forked child always ran before the spin began";
}

TEST(Batching, ShortJobsWidenAWorkersWindowAndALongOneNarrowsItToTwo) {
  Pool pool(PoolOptions{.processes = 1});
  detail::PoolCore& core = detail::PoolInternals::core(pool);
  EXPECT_EQ(core.jobs_wanted(), 2u);
  std::size_t widest = 0;
  std::vector<AsyncResult<int>> results;
  for (int i = 0; i < 5000; ++i) {
    results.push_back(pool.apply_async(ident, i));
    results.back().add_done_callback([&](AsyncResult<int>&) { widest = std::max(widest, core.jobs_wanted()); });
  }
  for (int i = 0; i < 5000; ++i) ASSERT_EQ(results[i].get(30s), i);
#if !defined(__SANITIZE_ADDRESS__)
  // Under ASan, on a loaded machine, a trivial job's turn can pass kShortJob (20 µs): the window
  // then rightly stays narrow (seen once in CI), so there only the narrowing below is checked.
  EXPECT_GT(widest, 2u) << "5000 trivial jobs and the window never widened";
#else
  (void)widest;
#endif
  EXPECT_EQ(pool.apply_async(nap, 30).get(30s), 30);
  EXPECT_EQ(core.jobs_wanted(), 2u) << "a 30 ms job left the window wide";
}

}  // namespace
}  // namespace forkpool
