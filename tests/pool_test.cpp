// Pool on real forked workers: the behaviour CPython's and torch's pool tests check, and every
// failure a worker can have.

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <limits>
#include <cstring>
#include <filesystem>
#include <functional>
#include <fstream>
#include <numeric>
#include <optional>
#include <ranges>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <map>
#include <tuple>
#include <vector>

#include <forkpool/runtime/internal/io.hpp>
#include <forkpool/ipc/internal/channel.hpp>
#include <forkpool/ipc/private/link.hpp>
#include <forkpool/pool/as_completed.hpp>
#include <forkpool/worker/internal/protocol.hpp>
#include <forkpool/pool/pool.hpp>
#include <forkpool/pool/internal/pool_internals.hpp>
#include <forkpool/worker/worker_info.hpp>
#include <forkpool/runtime/loop.hpp>
#include <forkpool/runtime/show_progress.hpp>
#include <forkpool/runtime/when_all.hpp>
#include "support.hpp"

namespace forkpool {
namespace {

using namespace std::chrono_literals;

// Memory shared with every worker (mapped before any pool forks).
struct Shared {
  std::atomic<int> initializer_runs;
  std::atomic<int> running_pid;
  std::atomic<int> slot_forger_runs;
  std::atomic<int> runs[4096];       // by task: how often it ran
  std::atomic<int> pid_of_task[64];  // by task: the worker that ran it
};
Shared* shared() { return &test_support::shared_across_forks<Shared>(); }
std::atomic<int>& slot_forger_runs() { return shared()->slot_forger_runs; }

int square(int x) { return x * x; }
int add(int a, int b) { return a + b; }
int my_pid(int) { return getpid(); }
int fail_on_seven(int x) {
  if (x == 7) throw std::invalid_argument("seven is not allowed");
  return x;
}
int sleep_ms(int ms) {
  std::this_thread::sleep_for(std::chrono::milliseconds(ms));
  return ms;
}
// Announces its pid, then runs until killed (or `ms` passes).
int announce_then_sleep(int ms) {
  shared()->running_pid.store(getpid());
  return sleep_ms(ms);
}
int die_in_first_worker_attempt(int x) {
  // The first time through, the worker kills itself; a retry finds the flag set and answers.
  if (shared()->running_pid.exchange(1) == 0) raise(SIGKILL);
  return x * 10;
}
void count_initializer() { shared()->initializer_runs.fetch_add(1); }
// Counts its run, notes its worker, then sleeps `ms`: returns its task number.
int count_run_then_sleep(int task, int ms) {
  shared()->runs[task].fetch_add(1);
  if (task < 64) shared()->pid_of_task[task].store(getpid());
  std::this_thread::sleep_for(std::chrono::microseconds(ms * 1000));
  return task;
}
// How many of tasks 0..count-1 have run (started), read from shared memory only.
int tasks_that_ran(int count) {
  int ran = 0;
  for (int i = 0; i < count; ++i) ran += shared()->runs[i].load() > 0 ? 1 : 0;
  return ran;
}
// Counts its run, then spins for `us` microseconds (shorter than a sleep can be).
int count_run_then_spin(int task, int us) {
  shared()->runs[task].fetch_add(1);
  auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(us);
  while (std::chrono::steady_clock::now() < until) {}
  return task;
}
std::string describe(std::string name, int times) {
  std::string out;
  for (int i = 0; i < times; ++i) out += name;
  return out;
}
void exit_with_three(int) { std::exit(3); }
int crash(int) {
  raise(SIGABRT);
  return 0;
}
void throwing_initializer() { throw std::domain_error("no GPU here"); }
// A hostile task: writes a frame of an unknown kind on the worker's channel (descriptor 3).
std::string echo_string(std::string s) { return s; }
// The worker's link, found in this process's mappings (a task runs in the worker).
std::byte* link_region() {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line))
    if (line.find("forkpool-link") != std::string::npos)
      return reinterpret_cast<std::byte*>(std::stoull(line.substr(0, line.find('-')), nullptr, 16));
  return nullptr;
}
// A task that dies as its worker would in the middle of writing a reply: half an entry is in
// the ring where the next reply goes, never published.
int die_in_the_middle_of_a_ring_write(int) {
  detail::RingView to_parent = detail::ring_in_region(link_region(), detail::kLinkRingCapacity, detail::kToParent);
  std::uint64_t head = to_parent.control->head.load();
  std::memset(to_parent.entries + head % to_parent.capacity, 0x5a, detail::kRingAlign / 2);
  raise(SIGKILL);
  return 0;
}
// A hostile task: writes an impossible position where its worker publishes its replies, and
// wakes the parent (it writes every eventfd its worker holds) so that it looks now.
int scribble_on_its_ring(int x) {
  std::byte* region = link_region();
  if (!region) return -1;
  detail::RingView to_parent = detail::ring_in_region(region, detail::kLinkRingCapacity, detail::kToParent);
  to_parent.control->head.store((std::uint64_t{1} << 60) + 7);
  for (auto& entry : std::filesystem::directory_iterator("/proc/self/fd")) {
    std::error_code error;
    if (std::filesystem::read_symlink(entry.path(), error).string() != "anon_inode:[eventfd]") continue;
    std::uint64_t one = 1;
    (void)!write(std::stoi(entry.path().filename().string()), &one, sizeof one);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  return x;
}
// A hostile task: tells the parent, as the worker would, that the pool's initializer failed.
int forge_an_initializer_error(int x) {
  detail::Channel line{UniqueFd(dup(3))};
  try {
    throw std::domain_error("forged");
  } catch (...) {
    line.send(detail::kErrorMessage, 0, detail::encode_current_exception().bytes());
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  return x;
}
// A hostile task: says (in the worker's running slot) that nothing was taken up, then dies, as
// if its worker had died before starting it. Counts its runs.
std::atomic<int>& slot_forger_runs();
int zero_the_running_slot_and_die(int) {
  slot_forger_runs().fetch_add(1);
  std::ifstream maps("/proc/self/maps");
  for (std::string line; std::getline(maps, line);) {
    if (line.find("forkpool-running-slot") == std::string::npos) continue;
    auto* slot = reinterpret_cast<detail::RunningSlot*>(std::stoull(line, nullptr, 16));
    slot->request_id.store(0);
  }
  raise(SIGKILL);
  return 0;
}

// A hostile task: moves its worker's position in the ring the parent writes to past anything
// written (as if it had read more than was sent), then sleeps with its jobs queued behind it.
int break_the_ring_position_and_sleep(int) {
  std::ifstream maps("/proc/self/maps");
  for (std::string line; std::getline(maps, line);) {
    if (line.find("forkpool-link") == std::string::npos) continue;
    auto* region = reinterpret_cast<std::byte*>(std::stoull(line, nullptr, 16));
    detail::ring_in_region(region, detail::kLinkRingCapacity, detail::kToWorker).control->tail.store(1ull << 60);
  }
  std::this_thread::sleep_for(std::chrono::seconds(60));
  return 0;
}

// How many processes this one has as children, not counting the /dev/shm name tracker (one per
// process tree, for the life of the process).
int child_count() {
  int count = 0;
  for (pid_t child : test_support::children_of(getpid()))
    if (test_support::process_name(child) != "forkpool-shm") ++count;
  return count;
}
// A task that drives forkpool's own loop inside the worker.
int sleep_on_the_loop(int ms) {
  run(sleep_for(std::chrono::milliseconds(ms)));
  return ms;
}
// A pool inside a task: the worker becomes a parent of its own workers.
int nested_pool_sum(int n) {
  Pool inner({.processes = 2});
  std::vector<int> xs(n);
  std::iota(xs.begin(), xs.end(), 1);
  std::vector<int> squares = run(inner.map(square, xs));
  return std::accumulate(squares.begin(), squares.end(), 0);
}

// A stream made by a helper from its own local vector, which is gone when the stream is read.
Stream<int> squares_of_a_local_vector(Pool& pool) {
  std::vector<int> xs(2000);
  std::iota(xs.begin(), xs.end(), 0);
  return pool.imap(square, xs, 7);
}

// Input that throws when it reaches `bad`.
auto input_failing_at(int bad) {
  return std::views::iota(0, 20) | std::views::transform([bad](int x) {
           if (x == bad) throw std::out_of_range("input " + std::to_string(x) + " is unreadable");
           return x;
         });
}

// Everything a stream hands out, the input's error last ("!" and its message).
Task<std::vector<std::string>> drain_to_strings(Stream<int> stream) {
  std::vector<std::string> seen;
  for (;;) {
    try {
      std::optional<int> r = co_await stream.next();
      if (!r) break;
      seen.push_back(std::to_string(*r));
    } catch (const std::out_of_range& e) {
      seen.push_back(std::string("!") + e.what());
    }
  }
  co_return seen;
}

void check(bool condition, const char* what) {
  if (!condition) throw std::runtime_error(what);
}

class PoolTest : public ::testing::TestWithParam<StartMethod> {
 protected:
  void SetUp() override {
    shared()->initializer_runs = 0;
    shared()->running_pid = 0;
    shared()->slot_forger_runs = 0;
    for (auto& r : shared()->runs) r = 0;
    for (auto& p : shared()->pid_of_task) p = 0;
  }
  PoolOptions options(int processes = 2) { return {.processes = processes, .start_method = GetParam()}; }
};

TEST_P(PoolTest, MapKeepsInputOrder) {
  Pool pool(options());
  std::vector<int> xs(1000);
  std::iota(xs.begin(), xs.end(), 0);
  std::vector<int> ys = run(pool.map(square, xs));
  ASSERT_EQ(ys.size(), xs.size());
  for (int i = 0; i < 1000; ++i) EXPECT_EQ(ys[i], i * i);
}

TEST_P(PoolTest, MapOfAnEmptyInputIsEmpty) {
  Pool pool(options());
  EXPECT_TRUE(run(pool.map(square, std::vector<int>{})).empty());
}

TEST_P(PoolTest, MapGivesTheSameResultForEveryChunkSize) {
  Pool pool(options());
  std::vector<int> xs(101);
  std::iota(xs.begin(), xs.end(), -50);
  std::vector<int> expected;
  for (int x : xs) expected.push_back(x * x);
  // (Bounded waits: a chunksize near SIZE_MAX once wrapped the chunk count to 0 and never ended.)
  std::size_t largest = std::numeric_limits<std::size_t>::max();
  for (std::size_t chunksize : {std::size_t{1}, std::size_t{0}, std::size_t{7}, std::size_t{1000}, largest}) {
    EXPECT_EQ(pool.map_async(square, xs, chunksize).get(10s), expected) << "chunksize " << chunksize;
    // A Stream has no timeout of its own: in a child that SIGALRM ends.
    int status = test_support::run_in_child_within(20s, [&] {
      Pool own(options());
      std::vector<int> streamed;
      for (int y : own.imap(square, xs, chunksize)) streamed.push_back(y);
      if (streamed != expected) _exit(2);
    });
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "imap, chunksize " << chunksize << ": " << status;
  }
}

TEST(PoolOptionsTest, ANegativeOptionIsRefusedNamingTheField) {
  auto refusal = [](PoolOptions options) -> std::string {
    try {
      Pool pool(std::move(options));
    } catch (const std::invalid_argument& e) {
      return e.what();
    }
    return "made a pool";
  };
  auto has = [](const std::string& text, const char* field) { return text.find(field) != std::string::npos; };
  EXPECT_PRED2(has, refusal({.processes = -1}), "processes");
  EXPECT_PRED2(has, refusal({.processes = 1, .maxtasksperchild = -1}), "maxtasksperchild");
  EXPECT_PRED2(has, refusal({.processes = 1, .max_retries = -1}), "max_retries");
  EXPECT_PRED2(has, refusal({.processes = 1, .task_timeout = -1ns}), "task_timeout");
  // A negative spin was sent as the empty one's -1: adaptive spinning, silently.
  EXPECT_PRED2(has, refusal({.processes = 1, .spin = -1ns}), "spin");
}

TEST_P(PoolTest, MapTakesAnyInputRange) {
  Pool pool(options());
  auto evens = std::views::iota(0, 20) | std::views::filter([](int x) { return x % 2 == 0; });
  std::vector<int> ys = run(pool.map(square, evens));
  EXPECT_EQ(ys, (std::vector<int>{0, 4, 16, 36, 64, 100, 144, 196, 256, 324}));
}

TEST_P(PoolTest, MapRunsOnEveryWorker) {
  Pool pool(options(2));
  std::vector<int> ids = run(pool.map(
      [](int) {
        std::this_thread::sleep_for(2ms);
        return static_cast<int>(getpid());
      },
      std::vector<int>(40), 1));
  std::set<int> distinct(ids.begin(), ids.end());
  EXPECT_EQ(distinct.size(), 2u);
  for (int pid : distinct) EXPECT_NE(pid, getpid());
}

TEST_P(PoolTest, ApplyAsyncReturnsTheValue) {
  Pool pool(options());
  EXPECT_EQ(run([&]() -> Task<int> { co_return co_await pool.apply_async(square, 7); }()), 49);
  EXPECT_EQ(pool.apply_async(add, 2, 3).get(), 5);
  EXPECT_EQ(pool.apply_async(describe, std::string("ab"), 3).get(), "ababab");
}

TEST_P(PoolTest, ApplyAsyncOfAVoidFunctionCompletes) {
  Pool pool(options());
  AsyncResult<void> done = pool.apply_async([](int) {}, 1);
  done.get();
  EXPECT_TRUE(done.successful());
}

TEST_P(PoolTest, StarmapSpreadsTuplesAsArguments) {
  Pool pool(options());
  std::vector<std::tuple<int, int>> pairs{{1, 2}, {3, 4}, {5, 6}};
  EXPECT_EQ(run(pool.starmap(add, pairs)), (std::vector<int>{3, 7, 11}));
  std::vector<std::pair<int, int>> std_pairs{{10, 1}};
  EXPECT_EQ(run(pool.starmap(add, std_pairs)), (std::vector<int>{11}));
}

TEST_P(PoolTest, AnExceptionInATaskIsARemoteErrorWithTypeMessageAndPid) {
  Pool pool(options());
  auto pids = pool.worker_pids();
  try {
    run(pool.map(fail_on_seven, std::vector<int>{1, 7, 3}));
    FAIL() << "no exception";
  } catch (const RemoteError& e) {
    EXPECT_EQ(e.type_name(), "std::invalid_argument");
    EXPECT_EQ(e.message(), "seven is not allowed");
    EXPECT_NE(std::find(pids.begin(), pids.end(), e.worker_pid()), pids.end());
    // what() says all three, as spawn's exceptions do.
    EXPECT_EQ(std::string(e.what()), "forkpool: worker " + std::to_string(e.worker_pid()) +
                                         " raised std::invalid_argument: seven is not allowed");
  }
  // The worker that threw goes on serving.
  EXPECT_EQ(pool.apply_async(fail_on_seven, 5).get(), 5);
}

// A program that only polls, as Python's users do (`while not r.ready()`): ready() outside a
// coroutine runs what the loop has ready, so the results arrive and the jobs behind the first
// ones go out. (Python's result-handler thread does this there.)
TEST_P(PoolTest, AProgramThatOnlyPollsReadySeesAllItsWorkFinish) {
  Pool pool(options());
  std::vector<AsyncResult<int>> results;
  for (int i = 0; i < 20; ++i) results.push_back(pool.apply_async(sleep_ms, 1));  // more than the workers hold
  auto deadline = std::chrono::steady_clock::now() + 10s;
  std::size_t ready = 0;
  while (ready < results.size() && std::chrono::steady_clock::now() < deadline) {
    ready = 0;
    for (const AsyncResult<int>& r : results) ready += r.ready() ? 1 : 0;
  }
  EXPECT_EQ(ready, results.size()) << "polling ready() alone never saw the work end";
  for (const AsyncResult<int>& r : results) EXPECT_EQ(r.get(0ms), 1);
}

// 400 tasks of 1 ms given from plain code (200 a worker: more than the 64 it holds of short
// ones) all run while the program computes, then every result is read (in one drain or a few).
void expect_work_given_from_plain_code_to_run_meanwhile(Pool& pool, const std::string& round) {
  constexpr int kTasks = 400;
  for (auto& r : shared()->runs) r = 0;
  std::vector<AsyncResult<int>> results;
  for (int i = 0; i < kTasks; ++i) results.push_back(pool.apply_async(count_run_then_sleep, i, 1));
  // The program's own work: it reads shared memory and sleeps, and calls nothing of forkpool's.
  test_support::eventually([] { return tasks_that_ran(kTasks) == kTasks; }, 10s);
  ASSERT_EQ(tasks_that_ran(kTasks), kTasks) << round << "only the jobs sent before the program went computing ran";
  for (int i = 0; i < kTasks; ++i) ASSERT_EQ(results[i].get(10s), i);
}

// Work given from plain code runs while the program computes without calling forkpool at all,
// as Python's pool works on in its threads: each worker is sent all it may hold at once, up to
// 1024 jobs while they are long (or not yet measured).
TEST_P(PoolTest, WorkGivenFromPlainCodeRunsWhileTheProgramComputes) {
  Pool pool(options());
  expect_work_given_from_plain_code_to_run_meanwhile(pool, "");
}

// Round after round: the results of a round arrive in one drain at its waits, which must not
// make its long jobs look short (finished all at once) and the next round's go out 64 a worker.
TEST_P(PoolTest, WorkGivenFromPlainCodeRunsWhileTheProgramComputesRoundAfterRound) {
  Pool pool(options());
  for (int round = 0; round < 3; ++round)
    ASSERT_NO_FATAL_FAILURE(
        expect_work_given_from_plain_code_to_run_meanwhile(pool, "round " + std::to_string(round) + ": "));
}

// More than the workers may hold at once: what is still queued when a wait returns goes out
// then, so it too runs while the program computes. The workers' windows are first widened by
// trivial jobs, so that they are sent 64 each at the call (the window for short jobs); the wait
// then finds these jobs long.
TEST_P(PoolTest, WorkStillQueuedWhenAWaitReturnsRunsWhileTheProgramComputes) {
  Pool pool(options());
  std::vector<AsyncResult<int>> trivial;
  for (int i = 0; i < 2000; ++i) trivial.push_back(pool.apply_async(square, i));
  for (auto& r : trivial) r.get(10s);
  if (detail::PoolInternals::core(pool).jobs_wanted() <= 2 * 2)
    GTEST_SKIP() << "trivial jobs ran too slowly here to count as short: every job goes out at the call";
  constexpr int kTasks = 300;  // 1 ms each; two workers are sent 64 each at first
  std::vector<AsyncResult<int>> results;
  for (int i = 0; i < kTasks; ++i) results.push_back(pool.apply_async(count_run_then_sleep, i, 1));
  EXPECT_EQ(results[40].get(10s), 40);
  test_support::eventually([] { return tasks_that_ran(kTasks) == kTasks; }, 10s);
  EXPECT_EQ(tasks_that_ran(kTasks), kTasks) << "the jobs queued when the wait returned waited for the next call";
  for (int i = 0; i < kTasks; ++i) EXPECT_EQ(results[i].get(10s), i);
}

// A long task holds up the jobs sent to its worker behind it; once the other worker has run
// dry, it takes them over. Nothing runs twice.
TEST_P(PoolTest, AWorkerThatRunsDryTakesOverJobsWaitingBehindAnothersLongTask) {
  Pool pool(options());
  constexpr int kTasks = 16;
  std::vector<AsyncResult<int>> results;
  results.push_back(pool.apply_async(count_run_then_sleep, 0, 1000));
  for (int i = 1; i < kTasks; ++i) results.push_back(pool.apply_async(count_run_then_sleep, i, 10));
  for (int i = 0; i < kTasks; ++i) EXPECT_EQ(results[i].get(10s), i);
  pid_t long_task_worker = shared()->pid_of_task[0].load();
  int on_that_worker = 0;
  for (int i = 0; i < kTasks; ++i) {
    EXPECT_EQ(shared()->runs[i].load(), 1) << "task " << i;
    on_that_worker += shared()->pid_of_task[i].load() == long_task_worker ? 1 : 0;
  }
  // 15 short tasks take the other worker 0.15 s of the long task's 1 s.
  EXPECT_EQ(on_that_worker, 1) << "jobs waited behind the long task while the other worker was idle";
}

// Taking a job back races with the worker taking it up: whichever wins, the job runs once and
// its result arrives. Tasks of uneven lengths, given in bursts from plain code and awaited in
// between, move between workers many times.
TEST_P(PoolTest, NoTaskRunsTwiceOrIsLostWhileJobsMoveBetweenWorkers) {
  Pool pool(options());
  constexpr int kRounds = 40, kPerRound = 32;
  for (int round = 0; round < kRounds; ++round) {
    std::vector<AsyncResult<int>> results;
    for (int i = 0; i < kPerRound; ++i) {
      int task = round * kPerRound + i;
      results.push_back(pool.apply_async(count_run_then_spin, task, (task * 7919) % 13 == 0 ? 2000 : (task % 5) * 20));
    }
    for (int i = 0; i < kPerRound; ++i) ASSERT_EQ(results[i].get(10s), round * kPerRound + i);
  }
  for (int task = 0; task < kRounds * kPerRound; ++task) ASSERT_EQ(shared()->runs[task].load(), 1) << "task " << task;
}

// Inside a coroutine the loop is already running: ready() only looks (it neither throws nor
// drives the loop from within).
TEST_P(PoolTest, ReadyInsideACoroutineOnlyLooks) {
  Pool pool(options());
  auto body = [&]() -> Task<void> {
    AsyncResult<int> r = pool.apply_async(sleep_ms, 50);
    EXPECT_FALSE(r.ready());
    int value = co_await r;
    EXPECT_EQ(value, 50);
    EXPECT_TRUE(r.ready());
  };
  run(body());
}

TEST_P(PoolTest, GetWithATimeoutThatRunsOutThrowsTimeoutError) {
  Pool pool(options());
  AsyncResult<int> slow = pool.apply_async(sleep_ms, 500);
  auto started = std::chrono::steady_clock::now();
  EXPECT_THROW(slow.get(20ms), TimeoutError);
  EXPECT_LT(std::chrono::steady_clock::now() - started, test_support::scaled(400ms));
  EXPECT_FALSE(slow.ready());
  EXPECT_FALSE(slow.wait(1ms));
  EXPECT_EQ(slow.get(5s), 500);
  EXPECT_TRUE(slow.ready());
  EXPECT_TRUE(slow.successful());
}

TEST_P(PoolTest, SuccessfulBeforeReadyIsALogicError) {
  Pool pool(options());
  AsyncResult<int> slow = pool.apply_async(sleep_ms, 100);
  EXPECT_THROW(slow.successful(), std::logic_error);
  slow.wait();
  EXPECT_TRUE(slow.successful());
}

TEST(AsyncResultTest, AMovedFromResultIsALogicErrorAndNeverACrash) {
  Pool pool({.processes = 1});
  AsyncResult<int> moved = pool.apply_async(square, 3);
  AsyncResult<int> kept = std::move(moved);
  EXPECT_EQ(kept.get(10s), 9);
  // (Each read a null state: a segfault, as ASan showed.) As a moved-from std::future throws.
  using test_support::expect_moved_from_error;
  expect_moved_from_error("AsyncResult", [&] { moved.get(1s); });
  expect_moved_from_error("AsyncResult", [&] { moved.wait(); });
  expect_moved_from_error("AsyncResult", [&] { moved.ready(); });
  expect_moved_from_error("AsyncResult", [&] { moved.cancel(); });
  expect_moved_from_error("AsyncResult", [&] { run([&]() -> Task<int> { co_return co_await moved; }()); });
  expect_moved_from_error("AsyncResult", [&] { run([&]() -> Task<int> { co_return co_await std::move(moved); }()); });
}

// A blocking get in a done-callback (which the loop runs inside its turn) would deadlock: it is
// refused, and the message names callbacks (it spoke of coroutines only).
TEST(AsyncResultTest, ABlockingGetInsideADoneCallbackIsALogicErrorNamingCallbacks) {
  Pool pool({.processes = 1});
  AsyncResult<int> first = pool.apply_async(square, 2);
  AsyncResult<int> second = pool.apply_async(square, 3);
  std::string error;
  first.add_done_callback([&](AsyncResult<int>&) {
    try {
      second.get(10s);
    } catch (const std::logic_error& e) {
      error = e.what();
    }
  });
  EXPECT_EQ(first.get(10s), 4);
  EXPECT_NE(error.find("or a callback the loop runs"), std::string::npos) << error;
  EXPECT_EQ(second.get(10s), 9);
}

// As AsyncResult's: a Stream's state was read through null (SEGV in StreamNext::await_ready).
TEST(StreamTest, AMovedFromStreamIsALogicErrorNamingItAndTheKeptOneServesOn) {
  int status = test_support::run_in_child_within(20s, [] {
    Pool pool({.processes = 1});
    std::vector<int> inputs{1, 2, 3};
    Stream<int> moved = pool.imap(square, inputs);
    Stream<int> kept = std::move(moved);
    test_support::expect_moved_from_error("Stream", [&] { run(moved.next()); });
    test_support::expect_moved_from_error("Stream", [&] { moved.progress(); });
    test_support::expect_moved_from_error("Stream", [&] {
      for (int value : moved) (void)value;
    });
    std::vector<int> got;
    while (std::optional<int> value = run(kept.next())) got.push_back(*value);
    EXPECT_EQ(got, (std::vector<int>{1, 4, 9}));
  });
  test_support::expect_ended_well(status, "hung: the kept stream stopped serving");
}

TEST_P(PoolTest, GetFromInsideACoroutineIsALogicError) {
  Pool pool(options());
  auto body = [&]() -> Task<bool> {
    AsyncResult<int> r = pool.apply_async(square, 2);
    bool refused = false;
    try {
      r.get();
    } catch (const std::logic_error&) {
      refused = true;
    }
    co_return refused && (co_await r) == 4;
  };
  EXPECT_TRUE(run(body()));
}

TEST_P(PoolTest, TerminateWhileBusyFailsPendingWorkWithPoolTerminated) {
  Pool pool(options());
  std::vector<AsyncResult<int>> results;
  for (int i = 0; i < 6; ++i) results.push_back(pool.apply_async(sleep_ms, 2000));
  auto pids = pool.worker_pids();
  auto started = std::chrono::steady_clock::now();
  pool.terminate();
  for (auto& r : results) EXPECT_THROW(r.get(), PoolTerminated);
  run(pool.join());
  EXPECT_LT(std::chrono::steady_clock::now() - started, test_support::scaled(1s));
  for (pid_t pid : pids) EXPECT_FALSE(test_support::process_alive(pid)) << "worker " << pid << " still runs";
  EXPECT_THROW(pool.apply_async(square, 1), PoolClosed);
}

TEST_P(PoolTest, CloseThenJoinDrainsTheQueue) {
  Pool pool(options());
  AsyncResult<std::vector<int>> all = pool.map_async(sleep_ms, std::vector<int>(10, 5), 1);
  pool.close();
  EXPECT_THROW(pool.apply_async(square, 1), PoolClosed);
  run(pool.join());
  EXPECT_TRUE(all.ready());
  EXPECT_EQ(all.get(), std::vector<int>(10, 5));
  EXPECT_TRUE(pool.worker_pids().empty());
}

TEST_P(PoolTest, JoinBeforeCloseIsALogicError) {
  Pool pool(options());
  EXPECT_THROW(run(pool.join()), std::logic_error);
}

TEST_P(PoolTest, MaxTasksPerChildReplacesWorkers) {
  PoolOptions o = options(2);
  o.maxtasksperchild = 2;
  Pool pool(o);
  std::vector<int> pids = run(pool.map(my_pid, std::vector<int>(20), 1));
  std::set<int> distinct(pids.begin(), pids.end());
  EXPECT_GE(distinct.size(), 10u);  // 20 tasks, at most 2 per worker
  for (int pid : distinct) EXPECT_LE(std::count(pids.begin(), pids.end(), pid), 2);
}

TEST_P(PoolTest, InitializerRunsOnceInEachWorker) {
  PoolOptions o = options(3);
  o.initializer = count_initializer;
  Pool pool(o);
  run(pool.map(square, std::vector<int>(30), 1));
  EXPECT_EQ(shared()->initializer_runs.load(), 3);
}

TEST_P(PoolTest, ImapOverAnEndlessInputYieldsInOrder) {
  Pool pool(options());
  auto body = [&]() -> Task<long> {
    Stream<int> squares = pool.imap(square, std::views::iota(0), 3);
    long sum = 0;
    for (int i = 0; i < 1000; ++i) {
      std::optional<int> next = co_await squares.next();
      EXPECT_EQ(*next, i * i);
      sum += *next;
    }
    co_return sum;
  };
  long expected = 0;
  for (long i = 0; i < 1000; ++i) expected += i * i;
  EXPECT_EQ(run(body()), expected);
}

TEST_P(PoolTest, AConsumerThatFallsBehindKeepsAtMostAWindowOfResultsUnread) {
  Pool pool(options());
  std::size_t read = 0;  // items of the input taken by the stream, in this process
  auto counted = std::views::iota(0, 100'000) | std::views::transform([&read](int x) {
                   ++read;
                   return x;
                 });
  auto slow_consumer = [&]() -> Task<std::size_t> {
    Stream<int> squares = pool.imap(square, counted);
    EXPECT_EQ(co_await squares.next(), 0);
    std::size_t read_at_first = read;
    for (int i = 1; i <= 10; ++i) {
      co_await sleep_for(20ms);  // the workers finish all they hold meanwhile
      EXPECT_EQ(co_await squares.next(), i * i);
    }
    co_return read - read_at_first;
  };
  // Each result taken lets one more item in, plus at most a window (16 chunks per worker while
  // tasks are short). Each slow next() used to send a whole new window (about 300 here).
  EXPECT_LE(run(slow_consumer()), 10u + 2 * 16);
}

TEST_P(PoolTest, ImapUnorderedYieldsEveryResultOnce) {
  Pool pool(options());
  auto body = [&]() -> Task<std::multiset<int>> {
    std::vector<int> xs(200);
    std::iota(xs.begin(), xs.end(), 0);
    Stream<int> results = pool.imap_unordered(square, xs, 4);
    std::multiset<int> seen;
    while (std::optional<int> r = co_await results.next()) seen.insert(*r);
    co_return seen;
  };
  std::multiset<int> seen = run(body());
  ASSERT_EQ(seen.size(), 200u);
  for (int i = 0; i < 200; ++i) EXPECT_EQ(seen.count(i * i), 1u);
}

TEST_P(PoolTest, ImapRethrowsAFailedTaskAtItsPlaceAndGoesOn) {
  Pool pool(options());
  auto body = [&]() -> Task<std::vector<std::string>> {
    Stream<int> results = pool.imap(fail_on_seven, std::views::iota(5, 10));
    std::vector<std::string> seen;
    for (;;) {
      try {
        std::optional<int> r = co_await results.next();
        if (!r) break;
        seen.push_back(std::to_string(*r));
      } catch (const RemoteError& e) {
        seen.push_back(e.type_name());
      }
    }
    co_return seen;
  };
  EXPECT_EQ(run(body()), (std::vector<std::string>{"5", "6", "std::invalid_argument", "8", "9"}));
}

TEST_P(PoolTest, AKilledWorkerFailsItsTaskWithWorkerLostAndThePoolCarriesOn) {
  Pool pool(options());
  AsyncResult<int> doomed = pool.apply_async(announce_then_sleep, 10'000);
  while (shared()->running_pid.load() == 0) std::this_thread::sleep_for(1ms);
  pid_t victim = shared()->running_pid.load();
  auto killed_at = std::chrono::steady_clock::now();
  kill(victim, SIGKILL);
  try {
    doomed.get();
    FAIL() << "no WorkerLost";
  } catch (const WorkerLost& e) {
    EXPECT_EQ(e.pid(), victim);
    EXPECT_EQ(e.signal(), SIGKILL);
    EXPECT_EQ(e.exit_code(), -1);
  }
  EXPECT_LT(std::chrono::steady_clock::now() - killed_at, test_support::scaled(1s));
  EXPECT_EQ(run(pool.map(square, std::vector<int>{1, 2, 3})), (std::vector<int>{1, 4, 9}));
  auto pids = pool.worker_pids();
  EXPECT_EQ(pids.size(), 2u);
  EXPECT_EQ(std::find(pids.begin(), pids.end(), victim), pids.end());
}

TEST_P(PoolTest, AWorkerThatExitsReportsItsExitCode) {
  Pool pool(options());
  try {
    pool.apply_async(exit_with_three, 0).get();
    FAIL() << "no WorkerLost";
  } catch (const WorkerLost& e) {
    EXPECT_EQ(e.exit_code(), 3);
    EXPECT_EQ(e.signal(), 0);
  }
}

TEST_P(PoolTest, MaxRetriesRunsTheTaskAgainAfterAWorkerDies) {
  PoolOptions o = options();
  o.max_retries = 2;
  Pool pool(o);
  EXPECT_EQ(pool.apply_async(die_in_first_worker_attempt, 4).get(), 40);
}

TEST_P(PoolTest, WorkersAreNamedAndHoldOnlyTheirChannelAndTheTrackersSocket) {
  Pool pool(options());
  run(pool.map(square, std::vector<int>{1, 2}));
  for (pid_t pid : pool.worker_pids()) {
    std::ifstream comm("/proc/" + std::to_string(pid) + "/comm");
    std::string name;
    std::getline(comm, name);
    EXPECT_EQ(name, "forkpool-worker");  // comm keeps 15 characters
    std::ifstream cmdline("/proc/" + std::to_string(pid) + "/cmdline");
    std::string full;
    std::getline(cmdline, full, '\0');
    EXPECT_EQ(full.rfind("forkpool-worker-", 0), 0u) << full;
    // stdio (0-2), the channel (3), the /dev/shm name tracker's socket (64) and its link's two
    // eventfds (one it sleeps on, one that wakes the parent), nothing else.
    int eventfds = 0;
    for (auto& entry : std::filesystem::directory_iterator("/proc/" + std::to_string(pid) + "/fd")) {
      int fd = std::stoi(entry.path().filename().string());
      std::string target = std::filesystem::read_symlink(entry.path()).string();
      if (target == "anon_inode:[eventfd]") {
        ++eventfds;
        continue;
      }
      EXPECT_TRUE(fd <= 3 || fd == 64) << "descriptor " << fd << " -> " << target;
    }
    EXPECT_EQ(eventfds, 2);
  }
}

TEST_P(PoolTest, WorkersDieWithTheirParent) {
  // A child process makes a pool, reports its workers' pids, and is SIGKILLed.
  int report[2];
  ASSERT_EQ(pipe(report), 0);
  StartMethod method = GetParam();
  pid_t parent = fork();
  if (parent == 0) {
    Pool pool({.processes = 2, .start_method = method});
    run(pool.map(square, std::vector<int>{1, 2}));
    std::vector<pid_t> pids = pool.worker_pids();
    (void)!write(report[1], pids.data(), sizeof(pid_t) * pids.size());  // one write: one read
    pause();
    _exit(0);
  }
  close(report[1]);
  std::vector<pid_t> workers(2);
  ASSERT_EQ(read(report[0], workers.data(), sizeof(pid_t) * 2), static_cast<ssize_t>(sizeof(pid_t) * 2));
  close(report[0]);
  kill(parent, SIGKILL);
  waitpid(parent, nullptr, 0);
  auto deadline = std::chrono::steady_clock::now() + 1s;
  for (pid_t w : workers) {
    while (test_support::process_alive(w) && std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(5ms);
    EXPECT_FALSE(test_support::process_alive(w)) << "worker " << w << " outlived its parent";
  }
}

TEST_P(PoolTest, AHundredThousandTasksLeaveDescriptorsAndMemoryFlat) {
  Pool pool(options());
  auto batch = [&](int n) {
    auto body = [&]() -> Task<void> {
      std::vector<AsyncResult<int>> results;
      for (int i = 0; i < n; ++i) {
        results.push_back(pool.apply_async(square, i % 1000));
        if (results.size() == 64) {
          for (auto& r : results) co_await r;
          results.clear();
        }
      }
      for (auto& r : results) co_await r;
    };
    run(body());
  };
  batch(10'000);  // warm up allocator and caches
  int fds_before = test_support::open_fd_count();
  long rss_before = test_support::rss_kib();
  batch(100'000);
  EXPECT_EQ(test_support::open_fd_count(), fds_before);
#if !defined(__SANITIZE_ADDRESS__)  // ASan's quarantine keeps freed memory resident on purpose
  EXPECT_LT(test_support::rss_kib() - rss_before, 8 * 1024) << "RSS grew by more than 8 MiB";
#else
  (void)rss_before;
#endif
}

TEST_P(PoolTest, CapturingLambdasAreRejectedAtCompileTime) {
  int captured = 3;
  auto capturing = [captured](int x) { return x + captured; };
  EXPECT_FALSE(detail::is_sendable_function_v<decltype(capturing)>);
  EXPECT_TRUE(detail::is_sendable_function_v<decltype(&square)>);
  auto plain = [](int x) { return x; };
  EXPECT_TRUE(detail::is_sendable_function_v<decltype(plain)>);
}

TEST_P(PoolTest, DestroyingABusyPoolReapsEveryWorker) {
  std::vector<pid_t> pids;
  {
    Pool pool(options());
    pool.apply_async(sleep_ms, 5000);
    pids = pool.worker_pids();
  }
  for (pid_t pid : pids) EXPECT_FALSE(test_support::process_alive(pid));
}

TEST_P(PoolTest, ATaskMayRunForkpoolsOwnLoop) {
  Pool pool(options());
  EXPECT_EQ(pool.apply_async(sleep_on_the_loop, 3).get(), 3);
  EXPECT_EQ(run(pool.map(sleep_on_the_loop, std::vector<int>{1, 2, 1, 2})), (std::vector<int>{1, 2, 1, 2}));
}

TEST_P(PoolTest, APoolInsideATaskWorks) {
  Pool pool(options());
  // The host has watched the loop's descriptor too: the worker's loop must not inherit that.
  (void)Loop::current().fd();
  EXPECT_EQ(pool.apply_async(nested_pool_sum, 4).get(), 1 + 4 + 9 + 16);
  EXPECT_EQ(run(pool.map(nested_pool_sum, std::vector<int>{2, 3})), (std::vector<int>{5, 14}));
}

TEST_P(PoolTest, UseFromAnotherThreadIsALogicErrorNamingTheRule) {
  Pool pool(options());
  std::string message = test_support::logic_error_on_another_thread([&] { pool.apply_async(square, 2); });
  EXPECT_NE(message.find("a Pool belongs to the thread that made it"), std::string::npos) << message;
  EXPECT_NE(message.find("Loop::post"), std::string::npos) << "the message names the way out: " << message;
  // Each call names itself (starmap and imap_unordered said "Pool::map" and "Pool::imap").
  std::vector<int> inputs{1, 2};
  std::vector<std::pair<std::string, std::function<void()>>> calls{
      {"Pool::map", [&] { pool.map_async(square, inputs); }},
      {"Pool::starmap",
       [&] {
         pool.starmap_async(add, std::vector<std::tuple<int, int>>{{1, 2}});
       }},
      {"Pool::imap", [&] { pool.imap(square, inputs); }},
      {"Pool::imap_unordered", [&] { pool.imap_unordered(square, inputs); }},
      {"Pool::close", [&] { pool.close(); }},
      {"Pool::terminate", [&] { pool.terminate(); }},
      {"Pool::worker_pids", [&] { pool.worker_pids(); }},
  };
  for (auto& [name, call] : calls) {
    std::string refusal = test_support::logic_error_on_another_thread(call);
    EXPECT_NE(refusal.find("forkpool: " + name + " called from another thread"), std::string::npos) << refusal;
  }
  EXPECT_EQ(pool.apply_async(square, 3).get(), 9);  // and it still serves its own thread
}

TEST_P(PoolTest, APoolDestroyedOnAnotherThreadHandsItsShutdownToItsOwnThreadWithoutWaiting) {
  // (~Pool drove the destroying thread's loop, waiting for workers that only the pool's own
  // loop reaps: it hung for ever.)
  int status = test_support::run_in_child_within(20s, [&] {
    auto pool = std::make_unique<Pool>(options());
    EXPECT_EQ(pool->apply_async(square, 3).get(10s), 9);
    std::vector<pid_t> pids = pool->worker_pids();
    std::thread([&] { pool.reset(); }).join();  // this thread waits for that one: ~Pool must not wait for it
    run(sleep_for(1ms));                        // the pool's loop turns: the shutdown runs, run() waits for the reaping
    for (pid_t pid : pids) EXPECT_FALSE(test_support::process_alive(pid)) << "worker " << pid << " still runs";
  });
  test_support::expect_ended_well(status, "hung: ~Pool on another thread waited for ever");
}

TEST_P(PoolTest, AResultNotYetReadyIsWaitedForOnItsPoolsThreadAloneAndAReadyOneAnywhere) {
  // (get() on a plain std::thread waited for ever, and on a thread with a loop of its own drove
  // that loop, which the result never reaches; a co_await there resumed its coroutine on the
  // pool's thread, or never.)
  int status = test_support::run_in_child_within(20s, [&] {
    Pool pool(options());
    AsyncResult<int> pending = pool.apply_async(sleep_ms, 100);
    const std::string rule = " called on another thread (or process) than its pool's, before the result is ready";
    auto refused = [&](const std::string& call, auto use) {
      std::string message = test_support::logic_error_on_another_thread(use);
      EXPECT_NE(message.find(call + rule), std::string::npos) << message;
      EXPECT_NE(message.find("Loop::post"), std::string::npos) << "the message names the way out: " << message;
    };
    refused("AsyncResult::wait", [&] { pending.get(); });
    refused("AsyncResult::wait", [&] {
      run(sleep_for(1ms));  // this thread now has a loop of its own
      pending.wait(5s);
    });
    refused("co_await AsyncResult", [&] { run([&]() -> Task<int> { co_return co_await pending; }()); });
    refused("co_await AsyncResult", [&] { run([&]() -> Task<int> { co_return co_await std::move(pending); }()); });
    refused("AsyncResult::async_wait", [&] { run(pending.async_wait(5s)); });
    refused("AsyncResult::add_done_callback", [&] { pending.add_done_callback([](AsyncResult<int>&) {}); });
    // Refused, nothing was lost (the moved-from co_await left the handle whole): once the pool's
    // loop has delivered it, any thread reads it.
    ASSERT_TRUE(pending.wait(10s));
    int got = 0;
    bool ready_there = false;
    std::thread([&] {
      ready_there = run(pending.async_wait(1s));
      got = pending.get();
    }).join();
    EXPECT_TRUE(ready_there);
    EXPECT_EQ(got, 100);
  });
  test_support::expect_ended_well(status, "hung: a wait on another thread than the pool's");
}

TEST_P(PoolTest, AStreamIsUsedOnItsPoolsThreadAloneAlsoWhenItsResultIsThere) {
  // (A stream's next() on another thread took a result that was there, and submitted the next
  // chunks to the pool from that thread, beside the pool's own: a data race; one not there
  // waited for ever.)
  int status = test_support::run_in_child_within(20s, [&] {
    Pool pool(options());
    Stream<int> stream = pool.imap(sleep_ms, std::vector<int>{100, 1, 2});
    std::vector<AsyncResult<int>> results{pool.apply_async(sleep_ms, 50)};
    Stream<std::size_t> completed = as_completed(results);
    for (bool arrived : {false, true}) {
      if (arrived) run(sleep_for(300ms));  // the pool's loop turns: the results arrive
      std::string blocking = test_support::logic_error_on_another_thread([&] {
        for (int value : stream) (void)value;
      });
      EXPECT_NE(blocking.find("Stream::next called from another thread"), std::string::npos) << blocking;
      std::string awaited = test_support::logic_error_on_another_thread(
          [&] { run([&]() -> Task<void> { (void)co_await stream.next(); }()); });
      EXPECT_NE(awaited.find("Stream::next called from another thread"), std::string::npos) << awaited;
      std::string order = test_support::logic_error_on_another_thread([&] { (void)run(completed.next()); });
      EXPECT_NE(order.find("Stream::next of as_completed called from another thread"), std::string::npos) << order;
    }
    // Nothing was taken or lost: the pool's thread reads every result.
    std::vector<int> got;
    for (int value : stream) got.push_back(value);
    EXPECT_EQ(got, (std::vector<int>{100, 1, 2}));
    EXPECT_EQ(run(completed.next()), std::optional<std::size_t>(0));
  });
  test_support::expect_ended_well(status, "hung: a stream read on another thread");
}

TEST_P(PoolTest, APoolWhoseThreadExitsHasItsWorkersEndedWithThatThreadsLoop) {
  // (Its workers ran on, and ~Pool later, on another thread, hung.)
  int status = test_support::run_in_child_within(20s, [&] {
    std::unique_ptr<Pool> pool;
    std::vector<pid_t> pids;
    std::thread([&] {
      pool = std::make_unique<Pool>(options());
      EXPECT_EQ(pool->apply_async(square, 3).get(10s), 9);
      pids = pool->worker_pids();
    }).join();
    for (pid_t pid : pids) EXPECT_FALSE(test_support::process_alive(pid)) << "worker " << pid << " still runs";
    pool.reset();  // its loop is gone: nothing is left to do
  });
  test_support::expect_ended_well(status, "hung: ~Pool after its thread's loop ended");
}

TEST_P(PoolTest, AForkedChildThatDestroysAPoolLeavesTheParentsWorkersAlone) {
  Pool pool(options());
  auto pids = pool.worker_pids();
  // (_exit: the child's copies of the parent's suspended coroutines are nobody's to free.)
  pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    pool.~Pool();
    _exit(0);
  }
  int child_status = 0;
  ASSERT_EQ(waitpid(child, &child_status, 0), child);
  EXPECT_TRUE(WIFEXITED(child_status) && WEXITSTATUS(child_status) == 0);
  for (pid_t pid : pids) EXPECT_TRUE(test_support::process_alive(pid)) << "worker " << pid << " was killed";
  EXPECT_EQ(run(pool.map(square, std::vector<int>{1, 2, 3})), (std::vector<int>{1, 4, 9}));
}

TEST_P(PoolTest, OnlyTheTaskThatRanFailsWhenItsWorkerCrashesWithWorkQueuedBehindIt) {
  Pool pool(options(1));
  auto crashed = pool.apply_async(crash, 0);
  auto first = pool.apply_async(square, 3);  // queued at the same worker behind the crash
  auto second = pool.apply_async(square, 4);
  EXPECT_EQ(first.get(), 9);
  EXPECT_EQ(second.get(), 16);
  try {
    crashed.get();
    FAIL() << "the crash did not fail its task";
  } catch (const WorkerLost& e) {
    EXPECT_EQ(e.signal(), SIGABRT);
  }
}

int block_for_ever(int) {
  for (;;) pause();
}

// Issue 58.4: after a burst of short tasks (windows grown), a long task held up the tasks queued
// behind it on its worker while the other worker idled, for as long as it ran.
TEST(SchedulerTest, QueuedTasksNeverWaitBehindAStuckTaskWhileAnotherWorkerIdles) {
  Pool pool({.processes = 2});
  ASSERT_EQ(pool.map_async(square, std::vector<int>(1000, 2), 1).get(20s), std::vector<int>(1000, 4));  // warm
  AsyncResult<int> stuck = pool.apply_async(block_for_ever, 0);
  for (int round = 0; round < 3; ++round) {
    EXPECT_EQ(pool.map_async(square, std::vector<int>(20, 3), 1).get(20s), std::vector<int>(20, 9))
        << "round " << round << ": tasks waited behind the stuck one";
    EXPECT_EQ(pool.apply_async(square, 5).get(20s), 25);
  }
  EXPECT_FALSE(stuck.ready());
  pool.terminate();
}

// Warms `pool` (both workers serve) with `tasks` tasks of `ms_each` ms (0: a few microseconds),
// then stops its first worker (SIGSTOP) and waits until it is stopped, before anything more is
// sent (a task it took up before would wait for it: it runs there). Its pid.
pid_t stop_first_worker_after(Pool& pool, int tasks, int ms_each = 0) {
  EXPECT_EQ(pool.map_async(sleep_ms, std::vector<int>(tasks, ms_each), 1).get(20s), std::vector<int>(tasks, ms_each));
  pid_t stopped = pool.worker_pids().at(0);
  EXPECT_EQ(kill(stopped, SIGSTOP), 0);
  EXPECT_TRUE(test_support::eventually([&] { return test_support::process_state(stopped) == 'T'; }));
  return stopped;
}

// A stopped worker (SIGSTOP) holds the tasks it was sent: the other worker takes them.
TEST(SchedulerTest, AMapFinishesWhileOneWorkerIsStopped) {
  Pool pool({.processes = 2});
  pid_t stopped = stop_first_worker_after(pool, 1000);
  ASSERT_FALSE(HasFailure());
  std::vector<int> inputs(200);
  std::iota(inputs.begin(), inputs.end(), 0);
  std::vector<int> squares = pool.map_async(square, inputs, 1).get(20s);
  kill(stopped, SIGCONT);
  for (int i = 0; i < 200; ++i) EXPECT_EQ(squares[i], i * i);
}

// The last job at a stopped worker, with nothing else in flight: no reply comes to make the pool
// look at it again, so it must look again by itself once the job could be stuck. Whether the
// workers' jobs so far were short (a wide window) or long (a window of two, as under a sanitizer
// or on a loaded machine, where a job of a few microseconds is judged long).
class StoppedWorkerTest : public ::testing::TestWithParam<int> {};
INSTANTIATE_TEST_SUITE_P(JobsSoFar, StoppedWorkerTest, ::testing::Values(0, 2),
                         [](const auto& info) { return info.param == 0 ? "short" : "long"; });

TEST_P(StoppedWorkerTest, AJobLeftAloneAtAStoppedWorkerRunsElsewhere) {
  Pool pool({.processes = 2});
  pid_t stopped = stop_first_worker_after(pool, 100, GetParam());
  ASSERT_FALSE(HasFailure());
  // Two at once: one is sent to each worker (both are idle). A job is judged stuck after
  // kStuckJob (1 ms): a second is ample, where a job passed back and forth between the two until
  // the stopped worker ran out of claim words took 2 s.
  for (int round = 0; round < 5; ++round) {
    auto started = std::chrono::steady_clock::now();
    auto first = pool.apply_async(square, round);
    auto second = pool.apply_async(square, round + 1);
    EXPECT_EQ(first.get(10s), round * round);
    EXPECT_EQ(second.get(10s), (round + 1) * (round + 1));
    EXPECT_LT(std::chrono::steady_clock::now() - started, test_support::scaled(1s)) << "round " << round;
  }
  kill(stopped, SIGCONT);
}

TEST_P(PoolTest, WorkSentToAWorkerThatDiedWhileTheLoopWasIdleRunsElsewhere) {
  Pool pool(options(1));
  pid_t worker = pool.worker_pids().at(0);
  ASSERT_EQ(kill(worker, SIGKILL), 0);
  while (test_support::process_alive(worker)) std::this_thread::sleep_for(1ms);
  // The loop has not run since: the pool still counts the dead worker as its own.
  EXPECT_EQ(pool.apply_async(square, 5).get(), 25);
  EXPECT_NE(pool.worker_pids().at(0), worker);
}

TEST_P(PoolTest, RequeuedWorkCostsNoRetries) {
  PoolOptions o = options(1);
  o.max_retries = 0;
  Pool pool(o);
  std::vector<AsyncResult<int>> behind;
  auto crashed = pool.apply_async(crash, 0);
  for (int i = 0; i < 5; ++i) behind.push_back(pool.apply_async(square, i));
  EXPECT_THROW(crashed.get(), WorkerLost);
  for (int i = 0; i < 5; ++i) EXPECT_EQ(behind[i].get(), i * i);
}

TEST_P(PoolTest, AStreamMadeBeforeCloseDeliversAllItsResults) {
  Pool pool(options());
  std::vector<int> xs(50);
  std::iota(xs.begin(), xs.end(), 0);
  Stream<int> stream = pool.imap(square, xs);
  pool.close();
  auto drain = [](Stream<int>& s) -> Task<std::vector<int>> {
    std::vector<int> out;
    while (auto y = co_await s.next()) out.push_back(*y);
    co_return out;
  };
  std::vector<int> ys = run(drain(stream));
  ASSERT_EQ(ys.size(), xs.size());
  for (int x : xs) EXPECT_EQ(ys[x], x * x);
  run(pool.join());
}

TEST_P(PoolTest, ImapAndImapUnorderedAfterCloseOrTerminateThrowPoolClosedAsMapDoes) {
  std::vector<int> xs{1, 2, 3};
  Pool pool(options());
  pool.close();
  EXPECT_THROW(pool.imap(square, xs), PoolClosed);
  EXPECT_THROW(pool.imap_unordered(square, xs), PoolClosed);
  EXPECT_THROW(pool.map_async(square, xs), PoolClosed);
  run(pool.join());
  EXPECT_THROW(pool.imap(square, std::views::iota(0)), PoolClosed);
  EXPECT_TRUE(pool.worker_pids().empty()) << "imap started workers after join()";

  Pool terminated(options());
  terminated.terminate();
  EXPECT_THROW(terminated.apply_async(square, 2), PoolClosed);
  EXPECT_THROW(terminated.imap(square, xs), PoolClosed);
}

TEST_P(PoolTest, AStreamOwnsACopyOfAnLvalueContainerItReadsLazily) {
  Pool pool(options());
  Stream<int> stream = squares_of_a_local_vector(pool);
  std::vector<int> scribble(4000, -1);  // likely where the helper's vector was
  std::vector<int> got;
  while (std::optional<int> y = run(stream.next())) got.push_back(*y);
  ASSERT_EQ(got.size(), 2000u);
  for (int i = 0; i < 2000; ++i) ASSERT_EQ(got[i], i * i);
  EXPECT_EQ(scribble[0], -1);
}

// This and the other stream tests whose regression would be a crash or a waiter never resumed
// run in a child with an alarm (run_in_child_within): such a regression fails the test instead
// of hanging or killing the suite.
TEST_P(PoolTest, ANextWhoseCoroutineIsDestroyedWhileItWaitsIsForgottenAndTheStreamServesOn) {
  int status = test_support::run_in_child_within(std::chrono::seconds(20), [&] {
    Pool pool(options());
    Stream<int> stream = pool.imap(square, std::views::iota(0, 50));
    int taken = -1;
    auto consume_one = [&]() -> Task<void> {
      if (std::optional<int> y = co_await stream.next()) taken = *y;
    };
    {
      Task<void> abandoned = consume_one();
      abandoned.handle().resume();  // to its co_await: the loop has not run, so nothing has arrived
      check(!abandoned.handle().done(), "the next() did not wait");
    }  // destroyed while it waits: the arrival that would have answered it must not resume it
    run(sleep_for(std::chrono::milliseconds(200)));  // results arrive meanwhile
    std::vector<int> got;
    while (std::optional<int> y = run(stream.next())) got.push_back(*y);
    check(taken == -1, "the destroyed coroutine was resumed");
    check(got.size() == 50, "results were lost");
    for (int i = 0; i < 50; ++i) check(got[i] == i * i, "a result out of order");
  });
  test_support::expect_ended_well(status, "hung: the stream stopped serving");
}

TEST_P(PoolTest, ANextIsATaskWhereATaskIsWanted) {
  int status = test_support::run_in_child_within(std::chrono::seconds(20), [&] {
    Pool pool(options());
    Stream<int> stream = pool.imap(square, std::views::iota(1, 4));
    Task<std::optional<int>> first = stream.next();  // made now, run when awaited
    auto [a, b] = run(when_all(std::move(first), Task<std::optional<int>>(stream.next())));
    check(a == std::optional<int>(1) && b == std::optional<int>(4), "the two next()s were not answered in turn");
    check(run(stream.next()) == std::optional<int>(9), "the third result was lost");
    check(run(stream.next()) == std::nullopt, "the stream did not end");
  });
  test_support::expect_ended_well(status, "hung: a next() waiting beside another was never answered");
}

TEST_P(PoolTest, TwoConsumersOfOneStreamShareItsResultsInOrder) {
  int status = test_support::run_in_child_within(std::chrono::seconds(20), [&] {
    Pool pool(options());
    Stream<int> stream = pool.imap(square, std::views::iota(0, 500));
    auto consume = [&](std::vector<int>& got) -> Task<void> {
      while (std::optional<int> y = co_await stream.next()) got.push_back(*y);
    };
    std::vector<int> a, b;
    run(when_all(consume(a), consume(b)));
    check(std::ranges::is_sorted(a) && std::ranges::is_sorted(b), "a consumer got results out of order");
    check(!a.empty() && !b.empty(), "one consumer got nothing");
    std::vector<int> all = a;
    all.insert(all.end(), b.begin(), b.end());
    std::ranges::sort(all);
    check(all.size() == 500, "results were lost or doubled");
    for (int i = 0; i < 500; ++i) check(all[i] == i * i, "a wrong result");
  });
  test_support::expect_ended_well(status, "hung: a consumer's next() was never answered");
}

TEST_P(PoolTest, AnErrorFromImapsInputComesAfterEveryEarlierResult) {
  Pool pool(options());
  std::vector<std::string> expected;
  for (int i = 0; i < 13; ++i) expected.push_back(std::to_string(i));
  expected.push_back("!input 13 is unreadable");
  EXPECT_EQ(run(drain_to_strings(pool.imap(sleep_ms, input_failing_at(13)))), expected);

  std::vector<std::string> unordered = run(drain_to_strings(pool.imap_unordered(sleep_ms, input_failing_at(13))));
  ASSERT_EQ(unordered.size(), expected.size());
  EXPECT_EQ(unordered.back(), expected.back());
  std::sort(unordered.begin(), unordered.end() - 1, [](auto& a, auto& b) { return std::stoi(a) < std::stoi(b); });
  EXPECT_EQ(unordered, expected);
}

TEST_P(PoolTest, MapTakesRangesWhoseSentinelIsNotAnIterator) {
  Pool pool(options());
  auto below_ten = std::views::iota(0) | std::views::take_while([](int x) { return x < 10; });
  std::vector<int> expected;
  for (int i = 0; i < 10; ++i) expected.push_back(i * i);
  EXPECT_EQ(run(pool.map(square, below_ten)), expected);
  std::istringstream text("1 2 3 4");
  EXPECT_EQ(run(pool.map(square, std::views::istream<int>(text))), (std::vector<int>{1, 4, 9, 16}));
  std::vector<std::pair<int, int>> pairs{{1, 2}, {3, 4}, {5, 6}};
  auto first_two = pairs | std::views::take_while([](auto& p) { return p.first < 4; });
  EXPECT_EQ(run(pool.starmap(add, first_two)), (std::vector<int>{3, 7}));
}

// The documented progress pattern, when_all(consume, show_progress), with a consumer that stops
// early: show_progress ends too, and the consumer's error reaches the caller.
TEST_P(PoolTest, ShowProgressEndsWhenTheConsumerBesideItThrowsOrBreaksOut) {
  int status = test_support::run_in_child_within(std::chrono::seconds(20), [&] {
    Pool pool(options());
    auto consume_then_throw = [](Stream<int>& s) -> Task<int> {
      co_await s.next();
      throw std::domain_error("a corrupt sample");
    };
    auto consume_then_break = [](Stream<int>& s) -> Task<int> {
      std::optional<int> first = co_await s.next();
      co_return *first;
    };
    Stream<int> endless = pool.imap(square, std::views::iota(0));
    bool rethrown = false;
    try {
      run(when_all(consume_then_throw(endless), show_progress(endless, "throws")));
    } catch (const std::domain_error&) {
      rethrown = true;
    }
    check(rethrown, "the consumer's error did not reach the caller");
    Stream<int> long_one = pool.imap(square, std::views::iota(3, 100000));
    auto [first, shown] = run(when_all(consume_then_break(long_one), show_progress(long_one, "breaks")));
    check(first == 9, "the consumer's value was lost");
    auto map = pool.map_async(sleep_ms, std::vector<int>(40, 50));
    auto give_up = []() -> Task<void> { throw std::domain_error("no patience"); };
    rethrown = false;
    try {
      run(when_all(give_up(), show_progress(map, "map")));
    } catch (const std::domain_error&) {
      rethrown = true;
    }
    check(rethrown, "the error beside show_progress(AsyncResult) did not reach the caller");
  });
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
      << (WIFSIGNALED(status) && WTERMSIG(status) == SIGALRM ? "hung: show_progress never ended" : "failed");
}

TEST_P(PoolTest, AStreamStartsWorkAtTheCall) {
  Pool pool(options());
  std::vector<int> xs{50};
  Stream<int> stream = pool.imap(announce_then_sleep, xs);
  // Nothing drives the loop here, yet the task is already running in a worker.
  auto deadline = std::chrono::steady_clock::now() + 2s;
  while (shared()->running_pid.load() == 0 && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(1ms);
  EXPECT_NE(shared()->running_pid.load(), 0);
  EXPECT_EQ(*run(stream.next()), 50);
}

TEST_P(PoolTest, AStreamThatOutlivesItsPoolReportsPoolTerminated) {
  std::vector<int> many(1000, 1);  // the input outlives the stream, as it must
  std::optional<Stream<int>> stream;
  {
    Pool pool(options(1));
    stream.emplace(pool.imap(sleep_ms, std::views::all(many) | std::views::transform([](int x) { return x; })));
  }
  auto drain = [](Stream<int>& s) -> Task<void> {
    while (co_await s.next()) {}
  };
  EXPECT_THROW(run(drain(*stream)), PoolTerminated);
}

TEST_P(PoolTest, AThrowingInitializerIsAnInitializerErrorAndThePoolStopsRestartingWorkers) {
  PoolOptions o = options(1);
  o.initializer = throwing_initializer;
  Pool pool(o);
  try {
    pool.apply_async(square, 2).get(std::chrono::seconds(10));
    FAIL() << "no exception";
  } catch (const InitializerError& e) {
    EXPECT_EQ(e.type_name(), "std::domain_error");
    EXPECT_EQ(e.message(), "no GPU here");
    EXPECT_NE(std::string(e.what()).find("no GPU here"), std::string::npos);
  }
  // Later work fails at once, with the same reason; no worker is started for it.
  EXPECT_THROW(pool.apply_async(square, 2), InitializerError);
  EXPECT_TRUE(pool.worker_pids().empty());
}

// What a task writes must not steer the pool: messages it writes to the worker's socket itself
// (here: four that pose as a failing initializer) are announced by no ring entry and dropped
// unread, also when the worker's next message travels on the socket.
TEST_P(PoolTest, MessagesATaskWritesToTheSocketItselfAreIgnoredAndThePoolServesOn) {
  Pool pool(options(1));
  pid_t before = pool.worker_pids().at(0);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(pool.apply_async(forge_an_initializer_error, i).get(10s), i);
  EXPECT_EQ(pool.apply_async(square, 6).get(10s), 36);
  std::string large(detail::ring_payload_max(detail::kLinkRingCapacity) + 1, 'x');  // on the socket
  EXPECT_EQ(pool.apply_async(echo_string, large).get(10s), large);
  EXPECT_EQ(pool.worker_pids().at(0), before);
}

TEST_P(PoolTest, ATaskThatForgesNotHavingStartedIsNotRunAgainForEver) {
  Pool pool(options(1));
  EXPECT_EQ(pool.apply_async(square, 2).get(10s), 4);  // the worker answered: a later lie shows
  EXPECT_THROW(pool.apply_async(zero_the_running_slot_and_die, 0).get(30s), WorkerLost);
  EXPECT_EQ(slot_forger_runs().load(), 1);
  slot_forger_runs() = 0;
  // On fresh workers the lie cannot be told from a death before the start: a bounded few runs.
  Pool fresh(options(1));
  EXPECT_THROW(fresh.apply_async(zero_the_running_slot_and_die, 0).get(60s), WorkerLost);
  EXPECT_LE(slot_forger_runs().load(), 17);
  EXPECT_EQ(fresh.apply_async(square, 3).get(10s), 9);
}

// How many of the pool's per-worker mappings this worker holds: its own rings and running slot
// only, never a sibling's (workers started together are forked after all their mappings exist).
int per_worker_mappings_here(int) {
  std::ifstream maps("/proc/self/maps");
  int found = 0;
  for (std::string line; std::getline(maps, line);)
    if (line.find("forkpool-link") != std::string::npos || line.find("forkpool-running-slot") != std::string::npos)
      ++found;
  return found;
}

TEST_P(PoolTest, AWorkerMapsOnlyItsOwnRingsAndRunningSlot) {
  Pool pool(options(4));  // started together
  std::vector<AsyncResult<int>> counts;
  for (int i = 0; i < 16; ++i) counts.push_back(pool.apply_async(per_worker_mappings_here, i));
  for (auto& count : counts) EXPECT_EQ(count.get(20s), 2);
}

// A worker's own position is its word, but only the job it ran may pay for a lie: the jobs
// queued behind that one never started, whatever the slot says (issue 58.9).
TEST_P(PoolTest, ATaskThatForgesItsSlotAndDiesTakesNoQueuedJobWithIt) {
  Pool pool(options(1));
  EXPECT_EQ(pool.apply_async(square, 2).get(10s), 4);  // the worker answered: the lie shows
  auto forger = pool.apply_async(zero_the_running_slot_and_die, 0);
  std::vector<AsyncResult<int>> behind;
  for (int i = 0; i < 3; ++i) behind.push_back(pool.apply_async(square, i));
  EXPECT_THROW(forger.get(30s), WorkerLost);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(behind[i].get(30s), i * i);
}

// A task that breaks its worker's ring position is caught when its job turns stuck, not when the
// ring next fills: the worker is rejected, and the jobs queued behind it run elsewhere.
TEST_P(PoolTest, AWorkerThatBreaksItsRingPositionIsRejectedWhileItsJobRuns) {
  Pool pool(options(2));
  auto hostile = pool.apply_async(break_the_ring_position_and_sleep, 0);
  std::this_thread::sleep_for(100ms);  // its job has run past kStuckJob when the next are sent
  std::vector<AsyncResult<int>> others;
  for (int i = 0; i < 8; ++i) others.push_back(pool.apply_async(square, i));
  for (int i = 0; i < 8; ++i) EXPECT_EQ(others[i].get(30s), i * i);
  EXPECT_THROW(hostile.get(20s), ProtocolError);
}

// A spawn mark left in the environment (exported by a shell, inherited from a worker) is not
// ours: the program runs as itself.
TEST_P(PoolTest, AStraySpawnMarkInTheEnvironmentIsIgnored) {
  for (const char* mark : {"3", "3:1", "0:0", "garbage"}) {
    int status = test_support::run_in_child_within(std::chrono::seconds(20), [&] {
      setenv("FORKPOOL_SPAWNED_WORKER", mark, 1);
      Pool pool(options(1));
      check(pool.apply_async(square, 5).get() == 25, "a wrong result");
    });
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
        << "with FORKPOOL_SPAWNED_WORKER=" << mark << ": status " << status;
  }
}

TEST_P(PoolTest, APoolWhoseConstructorThrowsLeavesNothingBehind) {
  int status = test_support::run_in_child([&] {
    (void)Loop::current();  // the thread's loop is made once and kept: not the pool's
    int fds_before = test_support::open_fd_count();
    rlimit original{};
    getrlimit(RLIMIT_NOFILE, &original);
    rlimit limit{64, original.rlim_max};
    if (setrlimit(RLIMIT_NOFILE, &limit) != 0) std::exit(2);
    try {
      Pool pool(options(40));
      std::exit(3);  // 40 workers cannot fit in 64 descriptors
    } catch (const std::exception&) {}
    if (int now = test_support::open_fd_count(); now != fds_before) {
      std::fprintf(stderr, "descriptors: %d before, %d after\n", fds_before, now);
      for (const auto& fd : std::filesystem::directory_iterator("/proc/self/fd"))
        std::fprintf(stderr, "  %s -> %s\n", fd.path().c_str(), std::filesystem::read_symlink(fd.path()).c_str());
      std::exit(4);
    }
    if (child_count() != 0) std::exit(5);
    // And, with descriptors to spare again, the next pool works (ASan's own needs do not fit in 64).
    setrlimit(RLIMIT_NOFILE, &original);
    Pool pool(options(2));
    if (pool.apply_async(square, 6).get() != 36) std::exit(6);
  });
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
}

// Who ran the task: (id, num_workers, pid, seed), after a nap so that every worker gets some.
std::tuple<int, int, int, std::uint64_t> who_am_i(int ms) {
  std::this_thread::sleep_for(std::chrono::milliseconds(ms));
  std::optional<WorkerInfo> info = worker_info();
  if (!info) return {-1, -1, -1, 0};
  return {info->id, info->num_workers, info->pid, info->seed};
}

// Every worker's (id -> seed) in a pool of three with `seed`, checking what each says of itself.
std::map<int, std::uint64_t> seeds_of_a_pool(PoolOptions o) {
  Pool pool(o);
  std::vector<pid_t> pids = pool.worker_pids();
  std::map<int, std::uint64_t> seeds;
  for (auto [id, workers, pid, seed] : run(pool.map(who_am_i, std::vector<int>(30, 20), 1))) {
    EXPECT_EQ(workers, 3);
    EXPECT_NE(std::find(pids.begin(), pids.end(), pid), pids.end());
    seeds[id] = seed;
  }
  return seeds;
}

TEST_P(PoolTest, WorkerInfoGivesIdsFromZeroAndDistinctSeedsThatTheSameSeedRepeats) {
  EXPECT_FALSE(worker_info().has_value());  // the parent is no worker
  PoolOptions o = options(3);
  o.seed = 42;
  std::map<int, std::uint64_t> first = seeds_of_a_pool(o), second = seeds_of_a_pool(o);
  ASSERT_EQ(first.size(), 3u);
  EXPECT_EQ(first.begin()->first, 0);
  EXPECT_EQ(first.rbegin()->first, 2);
  std::set<std::uint64_t> distinct;
  for (auto& [id, seed] : first) distinct.insert(seed);
  EXPECT_EQ(distinct.size(), 3u);
  EXPECT_EQ(first, second);  // the same PoolOptions::seed: the same seeds, run after run
  o.seed = 43;
  EXPECT_NE(seeds_of_a_pool(o), first);
}

TEST_P(PoolTest, AReplacementKeepsItsPredecessorsIdAndGetsANewSeed) {
  Pool pool(options(1));
  auto [id, workers, pid, seed] = pool.apply_async(who_am_i, 0).get();
  EXPECT_EQ(id, 0);
  kill(pid, SIGKILL);
  std::tuple<int, int, int, std::uint64_t> after;
  ASSERT_TRUE(test_support::eventually([&] {
    try {
      after = pool.apply_async(who_am_i, 0).get();
      return std::get<2>(after) != pid;
    } catch (const WorkerLost&) {
      return false;
    }
  }));
  EXPECT_EQ(std::get<0>(after), 0);
  EXPECT_NE(std::get<3>(after), seed);
}

// A worker killed in the middle of writing an entry published nothing: its task is WorkerLost
// (nothing half-written is read), and the pool serves on.
TEST_P(PoolTest, AWorkerKilledInTheMiddleOfARingWriteLosesOnlyItsTask) {
  Pool pool(options(1));
  EXPECT_EQ(pool.apply_async(square, 3).get(10s), 9);
  EXPECT_THROW(pool.apply_async(die_in_the_middle_of_a_ring_write, 0).get(10s), WorkerLost);
  EXPECT_EQ(pool.apply_async(square, 4).get(10s), 16);
}

// A task that writes garbage into its worker's ring: the parent finds it when it looks, the
// task fails with ProtocolError, the task queued behind it runs on the replacement.
TEST_P(PoolTest, AWorkerThatBreaksItsRingIsReplacedAndItsTaskFailsWithProtocolError) {
  Pool pool(options(1));
  pid_t before = pool.worker_pids().at(0);
  AsyncResult<int> hostile = pool.apply_async(scribble_on_its_ring, 1);
  std::this_thread::sleep_for(std::chrono::milliseconds(100));  // it has scribbled and sleeps
  AsyncResult<int> next = pool.apply_async(square, 7);
  EXPECT_THROW(hostile.get(10s), ProtocolError);
  EXPECT_EQ(next.get(10s), 49);
  EXPECT_NE(pool.worker_pids().at(0), before);
}

INSTANTIATE_TEST_SUITE_P(StartMethods, PoolTest, test_support::all_start_methods(), test_support::start_method_name);

}  // namespace
}  // namespace forkpool
