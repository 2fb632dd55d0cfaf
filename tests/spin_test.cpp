// Spinning before sleeping (PoolOptions::spin): the pool polls only while work is in flight,
// never with spin = 0, and an idle pool costs (almost) no CPU. And batching: a worker whose jobs
// are short is given more at once, one whose job was long goes back to two.

#include <gtest/gtest.h>
#include <sys/resource.h>
#include <unistd.h>

#include <chrono>
#include <thread>
#include <vector>

#include <forkpool/pool/private/pool_internals.hpp>
#include <forkpool/pool/pool.hpp>
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
  EXPECT_LT(after - before, 20ms);
  EXPECT_EQ(detail::spin_polls(), parent_polls);  // nothing in flight: the loop never spun
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
