// Controlling running work: cancel(), task_timeout, async_wait, done-callbacks, as_completed.

#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <functional>
#include <optional>
#include <set>
#include <string>
#include <numeric>
#include <ranges>
#include <stdexcept>
#include <thread>
#include <vector>

#include <forkpool/runtime/internal/progress_line.hpp>
#include <forkpool/forkpool.hpp>
#include "support.hpp"

namespace forkpool {
namespace {

using test_support::eventually;

using namespace std::chrono_literals;

// Counters shared with every worker.
struct Shared {
  std::atomic<int> calls;
  std::atomic<int> ran_marked;
  std::atomic<pid_t> running_pid;
};
Shared* shared() { return &test_support::shared_across_forks<Shared>(); }

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
  auto sent = pool.apply_async(count_then_sleep_ms, 5000);  // sent to the worker behind the first
  auto queued = pool.apply_async(mark_ran, 1);              // so is this (from plain code, all go at once)
  sent.cancel();
  queued.cancel();
  ASSERT_TRUE(sent.ready() && queued.ready());
  EXPECT_THROW(sent.get(), Cancelled);
  EXPECT_THROW(queued.get(), Cancelled);
  pid_t worker = pool.worker_pids().at(0);
  EXPECT_EQ(running.get(), 200);
  EXPECT_EQ(pool.apply_async(square, 3).get(2s), 9);  // not behind a 5 s task nobody wants
  EXPECT_EQ(shared()->calls.load(), 0);
  EXPECT_EQ(shared()->ran_marked.load(), 0);
  EXPECT_EQ(pool.worker_pids().at(0), worker);  // skipped, not killed
}

// Past what a worker is sent at once (up to 1024 from plain code, while its jobs are not yet
// measured), a task waits in the pool's queue: a cancel drops it there.
TEST_F(ControlTest, CancellingATaskStillInThePoolsQueueDropsItAndItNeverRuns) {
  Pool pool({.processes = 1});
  constexpr int kPastTheWindow = 1100;
  std::vector<AsyncResult<int>> sent;
  for (int i = 0; i < kPastTheWindow; ++i) sent.push_back(pool.apply_async(square, i));
  auto queued = pool.apply_async(mark_ran, 1);
  queued.cancel();
  ASSERT_TRUE(queued.ready());
  EXPECT_THROW(queued.get(), Cancelled);
  for (int i = 0; i < kPastTheWindow; ++i) EXPECT_EQ(sent[i].get(5s), i * i);
  EXPECT_EQ(pool.apply_async(square, 3).get(5s), 9);
  EXPECT_EQ(shared()->ran_marked.load(), 0);
}

// A worker that retires after maxtasksperchild counts a task it skipped because it was
// cancelled, as the pool counted it when it sent it: the worker leaves, and its replacement runs
// what comes next.
TEST_F(ControlTest, ACancelledTaskCountsTowardMaxtasksperchildAndTheReplacementServes) {
  Pool pool({.processes = 1, .maxtasksperchild = 2});
  auto first = pool.apply_async(sleep_ms, 200);
  auto second = pool.apply_async(count_then_sleep_ms, 5000);  // sent behind the first
  second.cancel();
  EXPECT_EQ(first.get(), 200);
  EXPECT_EQ(pool.apply_async(square, 7).get(5s), 49);
  EXPECT_EQ(shared()->calls.load(), 0);
}

// cancel() checks the calling thread before anything else: from another thread it throws and
// the task runs on to its result, which no one has failed (nor resumed an awaiter for).
TEST_F(ControlTest, ACancelFromAnotherThreadThrowsAndChangesNothing) {
  Pool pool({.processes = 1});
  AsyncResult<int> result = pool.apply_async(sleep_ms, 300);
  std::string message = test_support::logic_error_on_another_thread([&] { result.cancel(); });
  EXPECT_NE(message.find("AsyncResult::cancel"), std::string::npos) << message;
  EXPECT_FALSE(result.ready());
  EXPECT_EQ(result.get(std::chrono::seconds(10)), 300);
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
  EXPECT_LT(std::chrono::steady_clock::now() - started, test_support::scaled(100ms));
  EXPECT_EQ(behind.get(5s), 16);  // no WorkerLost, no retry used
  ASSERT_EQ(pool.worker_pids().size(), 1u);
  EXPECT_NE(pool.worker_pids().at(0), before);
}

TEST_F(ControlTest, AfterARunningTaskIsCancelledTheNextLongTaskStartsOnTheReplacement) {
  Pool pool({.processes = 1});
  for (int round = 0; round < 4; ++round) {
    shared()->running_pid = 0;
    auto running = pool.apply_async(sleep_ms, 60000);
    ASSERT_TRUE(eventually([&] { return running.wait(1ms) || shared()->running_pid != 0; })) << "round " << round;
    running.cancel();
    EXPECT_EQ(pool.apply_async(square, 5).get(5s), 25) << "round " << round;
    EXPECT_THROW(running.get(), Cancelled);
  }
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
  EXPECT_LT(took, test_support::scaled(1s));
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

TEST_F(ControlTest, ATimeoutOfNanosecondsMaxMeansNever) {
  PoolOptions o{.processes = 1};
  o.task_timeout = std::chrono::nanoseconds::max();
  Pool pool(o);
  pid_t worker = pool.worker_pids().at(0);
  auto r = pool.apply_async(sleep_ms, 100);
  EXPECT_EQ(r.get(std::chrono::nanoseconds::max()), 100);
  EXPECT_EQ(pool.worker_pids().at(0), worker);  // not stopped at once by an overflowed deadline
  auto body = [&]() -> Task<bool> {
    co_return co_await pool.apply_async(sleep_ms, 50).async_wait(std::chrono::nanoseconds::max());
  };
  EXPECT_TRUE(run(body()));
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

int nap_and_count(int ms) {
  std::this_thread::sleep_for(std::chrono::milliseconds(ms));
  if (ms >= 1000) return shared()->calls.load();  // how many others finished while this one ran
  shared()->calls.fetch_add(1);
  return -1;
}

TEST_F(ControlTest, AnOrderedImapKeepsTheOtherWorkerBusyWhileOneTaskIsSlow) {
  Pool pool({.processes = 2});
  std::vector<int> ms(1000, 1);
  ms[2] = 1000;  // long enough for 400 others of 1 ms each, also under ASan
  auto consume = [&]() -> Task<int> {
    auto stream = pool.imap(nap_and_count, ms);
    int during_slow = -1, count = 0;
    while (std::optional<int> r = co_await stream.next()) {
      if (*r >= 0) during_slow = *r;
      ++count;
    }
    EXPECT_EQ(count, 1000);
    co_return during_slow;
  };
  EXPECT_GE(run(consume()), 400);  // results waited in the reorder buffer, workers did not
}

TEST_F(ControlTest, ProgressCountsTheItemsOfAMapAndAStream) {
  Pool pool({.processes = 2});
  std::vector<int> ms(40, 2);
  auto result = pool.map_async(count_then_sleep_ms, ms, 1);
  EXPECT_EQ(result.progress().total, std::optional<std::size_t>(40));
  result.wait();
  EXPECT_EQ(result.progress().done, 40u);
  auto single = pool.apply_async(square, 2);
  EXPECT_EQ(single.progress().done, 0u);
  single.wait();
  EXPECT_EQ(single.progress().done, 1u);

  auto lazy = pool.imap(count_then_sleep_ms, ms | std::views::filter([](int) { return true; }));
  EXPECT_FALSE(lazy.progress().total.has_value());  // an input of unknown size is read lazily
  auto stream = pool.imap(count_then_sleep_ms, ms);
  EXPECT_EQ(stream.progress().total, std::optional<std::size_t>(40));  // a sized one is known
  auto drain = [](Stream<int>& s) -> Task<void> {
    while (co_await s.next()) {}
  };
  run(drain(stream));
  EXPECT_EQ(stream.progress().done, 40u);
  EXPECT_EQ(stream.progress().total, std::optional<std::size_t>(40));
  EXPECT_TRUE(stream.finished());
}

// Runs `body` with stderr going to a pipe; returns what it wrote.
std::string capture_stderr(const std::function<void()>& body) {
  int ends[2];
  EXPECT_EQ(pipe(ends), 0);
  int saved = dup(STDERR_FILENO);
  dup2(ends[1], STDERR_FILENO);
  close(ends[1]);
  body();
  std::fflush(stderr);
  dup2(saved, STDERR_FILENO);
  close(saved);
  std::string text;
  char buffer[4096];
  for (ssize_t n; (n = read(ends[0], buffer, sizeof buffer)) > 0;) text.append(buffer, static_cast<std::size_t>(n));
  close(ends[0]);
  return text;
}

// Issue 58.8: a line at each tenth, as the docs promise, also when several tenths pass between
// two draws (a 0.5 s map wrote 3 lines); each line's count is one that reached its tenth.
TEST_F(ControlTest, ShowProgressToAPipeWritesALineAtEveryTenthWithACountThatReachedIt) {
  Pool pool({.processes = 2});
  std::vector<int> ms(100, 15);
  std::string text = capture_stderr([&] {
    auto result = pool.map_async(count_then_sleep_ms, ms, 1);
    run(show_progress(result, "naps"));
    EXPECT_EQ(result.get().size(), 100u);
  });
  std::vector<std::string> lines;
  for (std::size_t at = 0, end; (end = text.find('\n', at)) != std::string::npos; at = end + 1)
    lines.push_back(text.substr(at, end - at));
  ASSERT_GE(lines.size(), 2u) << text;
  int previous = 0;
  for (const std::string& line : lines) {
    int percent = 0, done = 0, total = 0;
    ASSERT_EQ(std::sscanf(line.c_str(), "naps: %d%% (%d/%d items", &percent, &done, &total), 3) << line;
    EXPECT_EQ(total, 100);
    EXPECT_EQ(percent, previous + 10) << "a tenth without its line:\n" << text;
    EXPECT_EQ(percent, 10 * (10 * done / total)) << "a count of another tenth: " << line;
    previous = percent;
  }
  EXPECT_EQ(lines.size(), 10u) << text;
  EXPECT_NE(lines.back().find("100% (100/100 items"), std::string::npos) << lines.back();
}

// Tenths that passed between two draws are each said with the count that reached them, and all
// with the rate of now: that count over the time of now would understate it (issue 58.8's note).
TEST(ProgressLineTest, TenthsPassedBetweenTwoDrawsAllShowTheRateOfNow) {
  std::string text = capture_stderr([] {
    detail::ProgressLine line("jump");
    std::this_thread::sleep_for(std::chrono::milliseconds(300));  // past the time a rate needs
    line.draw(Progress{100, 100});
  });
  std::set<long> rates;
  int lines = 0;
  for (std::size_t at = 0, end; (end = text.find('\n', at)) != std::string::npos; at = end + 1, ++lines) {
    int percent = 0, done = 0, total = 0;
    long rate = 0;
    std::string one = text.substr(at, end - at);
    ASSERT_EQ(std::sscanf(one.c_str(), "jump: %d%% (%d/%d items, %ld items/s)", &percent, &done, &total, &rate), 4)
        << one;
    rates.insert(rate);
  }
  EXPECT_EQ(lines, 10) << text;
  EXPECT_EQ(rates.size(), 1u) << "tenths with rates of their own:\n" << text;
}

}  // namespace
}  // namespace forkpool
