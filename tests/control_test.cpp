// Controlling running work: cancel(), task_timeout, async_wait, done-callbacks, as_completed.

#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <numeric>
#include <stdexcept>
#include <thread>
#include <vector>

#include <forkpool/forkpool.hpp>

namespace forkpool {
namespace {

using namespace std::chrono_literals;

// Memory shared with every worker (mapped before any pool forks).
struct Shared {
  std::atomic<int> calls;
  std::atomic<int> ran_marked;
  std::atomic<pid_t> running_pid;
};
Shared* shared() {
  static Shared* s = [] {
    void* p = mmap(nullptr, sizeof(Shared), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    return new (p) Shared{};
  }();
  return s;
}

int square(int x) { return x * x; }
int sleep_ms(int ms) {
  shared()->running_pid = getpid();
  std::this_thread::sleep_for(std::chrono::milliseconds(ms));
  return ms;
}
int count_then_sleep_ms(int ms) {
  shared()->calls.fetch_add(1);
  std::this_thread::sleep_for(std::chrono::milliseconds(ms));
  return ms;
}
int mark_ran(int x) {
  shared()->ran_marked = 1;
  return x;
}
int spin_forever(int) {
  volatile long spins = 0;
  for (;;) spins = spins + 1;
}

template <class F>
bool eventually(F condition) {
  for (int i = 0; i < 500; ++i) {
    if (condition()) return true;
    std::this_thread::sleep_for(10ms);
  }
  return condition();
}

class ControlTest : public ::testing::Test {
 protected:
  void SetUp() override {
    shared()->calls = 0;
    shared()->ran_marked = 0;
    shared()->running_pid = 0;
  }
};

TEST_F(ControlTest, CancellingAQueuedTaskDropsItAndItNeverRuns) {
  Pool pool({.processes = 1});
  auto running = pool.apply_async(sleep_ms, 200);
  auto sent = pool.apply_async(square, 2);    // already in the worker's socket
  auto queued = pool.apply_async(mark_ran, 1);  // still in the pool's queue
  queued.cancel();
  ASSERT_TRUE(queued.ready());
  EXPECT_THROW(queued.get(), Cancelled);
  EXPECT_EQ(running.get(), 200);
  EXPECT_EQ(sent.get(), 4);
  EXPECT_EQ(pool.apply_async(square, 3).get(), 9);  // after everything queued before it
  EXPECT_EQ(shared()->ran_marked.load(), 0);
}

TEST_F(ControlTest, CancellingARunningTaskKillsItsWorkerAndWorkQueuedBehindItSucceeds) {
  PoolOptions o{.processes = 1};
  o.max_retries = 0;
  Pool pool(o);
  auto slow = pool.apply_async(sleep_ms, 10000);
  ASSERT_TRUE(eventually([&] { return slow.wait(1ms) || shared()->running_pid != 0; }));
  pid_t before = pool.worker_pids().at(0);
  auto behind = pool.apply_async(square, 4);
  auto started = std::chrono::steady_clock::now();
  slow.cancel();
  EXPECT_THROW(slow.get(), Cancelled);
  EXPECT_LT(std::chrono::steady_clock::now() - started, 100ms);
  EXPECT_EQ(behind.get(5s), 16);  // no WorkerLost, no retry used
  ASSERT_EQ(pool.worker_pids().size(), 1u);
  EXPECT_NE(pool.worker_pids().at(0), before);
}

TEST_F(ControlTest, CancellingAMapMidwayStopsItsRemainingChunks) {
  Pool pool({.processes = 2});
  std::vector<int> xs(100, 20);
  auto result = pool.map_async(count_then_sleep_ms, xs, 1);
  ASSERT_TRUE(eventually([&] { return result.wait(1ms) || shared()->calls >= 4; }));
  result.cancel();
  EXPECT_THROW(result.get(), Cancelled);
  EXPECT_EQ(pool.apply_async(square, 5).get(5s), 25);
  EXPECT_LT(shared()->calls.load(), 20);
}

TEST_F(ControlTest, ATaskPastTaskTimeoutFailsWithTimeoutErrorAndThePoolServesOn) {
  PoolOptions o{.processes = 1};
  o.task_timeout = 200ms;
  Pool pool(o);
  auto started = std::chrono::steady_clock::now();
  auto endless = pool.apply_async(spin_forever, 0);
  EXPECT_THROW(endless.get(5s), TimeoutError);
  auto took = std::chrono::steady_clock::now() - started;
  EXPECT_GE(took, 200ms);
  EXPECT_LT(took, 1s);
  EXPECT_EQ(pool.apply_async(square, 6).get(5s), 36);
}

TEST_F(ControlTest, TaskTimeoutCountsFromTheTasksStartNotItsSubmission) {
  PoolOptions o{.processes = 1};
  o.task_timeout = 400ms;
  Pool pool(o);
  pid_t worker = pool.worker_pids().at(0);
  std::vector<AsyncResult<int>> results;
  for (int i = 0; i < 4; ++i) results.push_back(pool.apply_async(sleep_ms, 150));  // 600 ms in all
  for (auto& r : results) EXPECT_EQ(r.get(5s), 150);
  EXPECT_EQ(pool.worker_pids().at(0), worker);
}

TEST_F(ControlTest, AsyncWaitSaysWhetherTheResultWasReadyInTime) {
  Pool pool({.processes = 1});
  auto body = [&]() -> Task<std::pair<bool, bool>> {
    auto r = pool.apply_async(sleep_ms, 300);
    bool early = co_await r.async_wait(50ms);
    bool later = co_await r.async_wait(5s);
    co_return std::pair{early, later};
  };
  auto [early, later] = run(body());
  EXPECT_FALSE(early);
  EXPECT_TRUE(later);
}

TEST_F(ControlTest, DoneCallbacksRunOnceOnTheLoopsThreadAlsoWhenAddedAfterCompletion) {
  Pool pool({.processes = 1});
  auto r = pool.apply_async(sleep_ms, 50);
  int before = 0, after = 0, throwing = 0;
  std::thread::id thread;
  r.add_done_callback([&](AsyncResult<int>& done) {
    ++before;
    thread = std::this_thread::get_id();
    EXPECT_EQ(done.get(), 50);
  });
  r.add_done_callback([&](AsyncResult<int>&) {
    ++throwing;
    throw std::runtime_error("a callback that throws");
  });
  EXPECT_EQ(r.get(), 50);
  r.add_done_callback([&](AsyncResult<int>&) { ++after; });
  EXPECT_EQ(before, 1);
  EXPECT_EQ(throwing, 1);
  EXPECT_EQ(after, 1);
  EXPECT_EQ(thread, std::this_thread::get_id());
  EXPECT_EQ(pool.apply_async(square, 7).get(), 49);  // the throwing callback broke nothing
}

TEST_F(ControlTest, AsCompletedYieldsEveryIndexOnceFastestFirst) {
  Pool pool({.processes = 3});
  std::vector<AsyncResult<int>> results;
  for (int ms : {400, 10, 200}) results.push_back(pool.apply_async(sleep_ms, ms));
  auto order = [&]() -> Task<std::vector<std::size_t>> {
    Stream<std::size_t> done = as_completed(results);
    std::vector<std::size_t> indices;
    while (std::optional<std::size_t> i = co_await done.next()) indices.push_back(*i);
    co_return indices;
  };
  EXPECT_EQ(run(order()), (std::vector<std::size_t>{1, 2, 0}));
  std::vector<AsyncResult<int>> none;
  auto empty = [&]() -> Task<bool> { co_return !(co_await as_completed(none).next()).has_value(); };
  EXPECT_TRUE(run(empty()));
}

}  // namespace
}  // namespace forkpool
