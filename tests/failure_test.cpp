// Failures around the pool's helpers (the fork server, the terminal's signals, full descriptor
// tables) and around its work (retries, failed maps, random kills). Each runs with both start
// methods (where it applies) and on both backends.

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include <sys/mman.h>

#include <atomic>
#include <chrono>
#include <numeric>
#include <optional>
#include <random>
#include <ranges>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <forkpool/pool/pool.hpp>
#include <forkpool/pool/process.hpp>
#include <forkpool/runtime/loop.hpp>
#include "support.hpp"

namespace forkpool {
namespace {

using test_support::eventually;

using namespace std::chrono_literals;
using test_support::children_named;
using test_support::children_of;
using test_support::process_alive;
using test_support::process_state;
using test_support::run_in_child;

int square(int x) { return x * x; }

// The pool's fork server: our child, or, once the suite's main called forkpool::init(), a child
// of the program's fork server.
pid_t the_fork_server() {
  std::vector<pid_t> servers = children_named("forkpool-zygote");
  for (pid_t program_server : children_named("forkpool-server"))
    for (pid_t child : children_of(program_server))
      if (test_support::process_name(child) == "forkpool-zygote") servers.push_back(child);
  return servers.size() == 1 ? servers[0] : -1;
}

#define SKIP_UNLESS_FORK_SERVER() \
  if (GetParam() != StartMethod::forkserver) GTEST_SKIP() << "only the forkserver start method has a fork server"

class HelperFailureTest : public ::testing::TestWithParam<StartMethod> {
 protected:
  PoolOptions options(int processes) { return {.processes = processes, .start_method = GetParam()}; }
};

volatile sig_atomic_t interrupts = 0;

TEST_P(HelperFailureTest, CtrlCSentToTheWholeProcessGroupIsTheParentsToHandle) {
  int status = run_in_child([&] {
    setpgid(0, 0);  // a process group of our own, as a terminal's foreground job has
    struct sigaction on_interrupt {};
    on_interrupt.sa_handler = [](int) { interrupts = interrupts + 1; };
    sigaction(SIGINT, &on_interrupt, nullptr);
    Pool pool(options(2));
    std::vector<pid_t> workers = pool.worker_pids();
    std::vector<pid_t> servers = children_named("forkpool-zygote");
    kill(0, SIGINT);  // what the terminal does on Ctrl-C
    std::this_thread::sleep_for(100ms);
    if (interrupts != 1) _exit(2);
    if (pool.apply_async(square, 5).get() != 25) _exit(3);
    if (pool.worker_pids() != workers) _exit(4);
    for (pid_t server : servers)
      if (!process_alive(server)) _exit(5);
  });
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
}

TEST_P(HelperFailureTest, AForkServerThatIsKilledIsReplacedAndThePoolServesOn) {
  SKIP_UNLESS_FORK_SERVER();
  Pool pool(options(2));
  ASSERT_EQ(pool.apply_async(square, 2).get(), 4);
  pid_t server = the_fork_server();
  ASSERT_GT(server, 0);
  std::vector<pid_t> workers = pool.worker_pids();
  kill(server, SIGKILL);
  // Its workers die with it.
  ASSERT_TRUE(eventually([&] { return !process_alive(workers[0]) && !process_alive(workers[1]); }));
  EXPECT_EQ(pool.apply_async(square, 3).get(10s), 9);
  pid_t replacement = the_fork_server();
  EXPECT_GT(replacement, 0);
  EXPECT_NE(replacement, server);
  EXPECT_EQ(process_state(server), '?');  // reaped, not a zombie
  std::vector<int> xs{1, 2, 3, 4};
  EXPECT_EQ(run(pool.map(square, xs)), (std::vector<int>{1, 4, 9, 16}));
}

int slow_square(int x) {
  std::this_thread::sleep_for(std::chrono::milliseconds(400));
  return x * x;
}

// CPython's test_forkserver_sigkill: work that runs finishes; only new starts need a new server.
TEST_P(HelperFailureTest, KillingTheProgramsForkServerLetsRunningWorkFinish) {
  SKIP_UNLESS_FORK_SERVER();
  if (!test_support::in_fresh_process())
    return test_support::expect_passes_in_fresh_process();  // the program's server is killed for good
  Pool pool(options(2));
  Process process = start_process({.start_method = StartMethod::forkserver}, slow_square, 3);
  std::vector<int> xs{1, 2, 3, 4};
  AsyncResult<std::vector<int>> running = pool.map_async(slow_square, xs, 1);
  std::vector<pid_t> servers = children_named("forkpool-server");
  ASSERT_EQ(servers.size(), 1u);
  kill(servers[0], SIGKILL);
  EXPECT_EQ(running.get(10s), (std::vector<int>{1, 4, 9, 16}));
  EXPECT_TRUE(process.join(10s));
  EXPECT_EQ(process.exitcode(), std::optional<int>(0));
  Pool later(options(1));  // starts its own fork server
  EXPECT_EQ(later.apply_async(square, 7).get(10s), 49);
  EXPECT_EQ(process_state(servers[0]), '?');  // reaped, not a zombie
}

TEST_P(HelperFailureTest, AForkErrorInTheForkServerFailsThatStartAndTheServerLives) {
  SKIP_UNLESS_FORK_SERVER();
  Pool pool(options(1));
  pid_t server = the_fork_server();
  ASSERT_GT(server, 0);
  pid_t worker = pool.worker_pids().at(0);
  // The server holds stdio, its channel (3) and the worker's pidfd (4). With room for 5, it
  // receives a new worker's channel end but cannot open the new worker's pidfd: EMFILE.
  rlimit original{};
  ASSERT_EQ(prlimit(server, RLIMIT_NOFILE, nullptr, &original), 0);
  rlimit tight{5, original.rlim_max};
  ASSERT_EQ(prlimit(server, RLIMIT_NOFILE, &tight, nullptr), 0);
  kill(worker, SIGKILL);
  try {
    pool.apply_async(square, 2).get(10s);
    FAIL() << "a worker started where none can be";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("fork server"), std::string::npos) << e.what();
  }
  ASSERT_TRUE(process_alive(server));
  ASSERT_EQ(prlimit(server, RLIMIT_NOFILE, &original, nullptr), 0);
  EXPECT_EQ(pool.apply_async(square, 4).get(10s), 16);
  EXPECT_EQ(the_fork_server(), server);
}

TEST_P(HelperFailureTest, EveryChildOfTheForkServerIsReapedWhenTheParentCannotTakeIt) {
  SKIP_UNLESS_FORK_SERVER();
  int status = run_in_child([&] {
    Pool pool(options(1));
    pid_t server = the_fork_server();
    pid_t worker = pool.worker_pids().at(0);
    // A full table but for three: the next worker's socket pair and running slot fit, its pidfd
    // does not.
    std::vector<int> fillers;
    for (int fd; (fd = dup(0)) >= 0;) fillers.push_back(fd);
    for (int i = 0; i < 3; ++i) {
      close(fillers.back());
      fillers.pop_back();
    }
    kill(worker, SIGKILL);
    bool failed = false;
    try {
      pool.apply_async(square, 2).get(10s);
    } catch (const Error&) {
      failed = true;
    }
    for (int fd : fillers) close(fd);
    if (!failed) _exit(2);
    // The worker the fork server made for us, unwatched by anyone here, is killed and reaped.
    if (!eventually([&] { return children_of(server).empty(); })) _exit(3);
    if (pool.apply_async(square, 3).get(10s) != 9) _exit(4);
  });
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
}

// Memory shared with every worker (mapped before any pool forks): per-element counters.
struct Counters {
  std::atomic<int> runs[256];
  std::atomic<int> calls;
  std::atomic<int> pid_of_task[4096];
};
Counters* counters() { return &test_support::shared_across_forks<Counters>(); }
void reset_counters() {
  for (auto& r : counters()->runs) r = 0;
  counters()->calls = 0;
  for (auto& p : counters()->pid_of_task) p = 0;
}

// Element 7 kills its worker the first two times it runs, element 15 the first time.
int crash_on_seven_twice_and_fifteen_once(int x) {
  int run = counters()->runs[x].fetch_add(1);
  if ((x == 7 && run < 2) || (x == 15 && run < 1)) abort();
  return x * 10;
}

int throw_on_zero_else_sleep(int x) {
  counters()->calls.fetch_add(1);
  if (x == 0) throw std::runtime_error("zero");
  std::this_thread::sleep_for(5ms);
  return x;
}

int record_pid_then_sleep(int task) {
  counters()->pid_of_task[task] = getpid();
  std::this_thread::sleep_for(std::chrono::microseconds(500 + (task * 37) % 1500));
  return task;
}

class WorkFailureTest : public ::testing::TestWithParam<StartMethod> {
 protected:
  void SetUp() override { reset_counters(); }
  PoolOptions options(int processes, int max_retries = 0) {
    PoolOptions o{.processes = processes, .start_method = GetParam()};
    o.max_retries = max_retries;
    return o;
  }
};

TEST_P(WorkFailureTest, ARetriedChunkChargesOnlyTheElementThatWasRunning) {
  // Whole chunks as the unit of retry: the chunk dies at 7, at 7 again, then at 15, and three
  // lost runs exceed max_retries = 2. Per element: 7 used two, 15 used one.
  Pool pool(options(1, 2));
  std::vector<int> xs(20);
  std::iota(xs.begin(), xs.end(), 0);
  std::vector<int> ys = run(pool.map(crash_on_seven_twice_and_fifteen_once, xs, 20));
  for (int i = 0; i < 20; ++i) EXPECT_EQ(ys[i], i * 10);
  EXPECT_EQ(counters()->runs[7].load(), 3);
  EXPECT_EQ(counters()->runs[15].load(), 2);
  EXPECT_LE(counters()->runs[3].load(), 4);  // ran again with its neighbours, never charged
}

TEST_P(WorkFailureTest, AnOrderedStreamReassemblesAChunkRetriedInParts) {
  Pool pool(options(2, 2));
  std::vector<int> xs(40);
  std::iota(xs.begin(), xs.end(), 0);
  auto stream = pool.imap(crash_on_seven_twice_and_fifteen_once, xs, 10);
  auto collect = [](decltype(stream)& s) -> Task<std::vector<int>> {
    std::vector<int> out;
    while (std::optional<int> y = co_await s.next()) out.push_back(*y);
    co_return out;
  };
  std::vector<int> ys = run(collect(stream));
  ASSERT_EQ(ys.size(), 40u);
  for (int i = 0; i < 40; ++i) EXPECT_EQ(ys[i], i * 10);
}

TEST_P(WorkFailureTest, AFailedMapsChunksThatHaveNotStartedAreDropped) {
  Pool pool(options(2));
  std::vector<int> xs(200);
  std::iota(xs.begin(), xs.end(), 0);
  EXPECT_THROW(run(pool.map(throw_on_zero_else_sleep, xs, 1)), RemoteError);
  // The next task does not wait behind 199 leftovers: only those already sent ran.
  EXPECT_EQ(pool.apply_async(square, 3).get(), 9);
  EXPECT_LT(counters()->calls.load(), 20);
}

// Random SIGKILLs of workers during a map: with retries every result is right; without, each
// task succeeds or fails with WorkerLost naming the worker it actually ran on.
TEST_P(WorkFailureTest, RandomKillsDuringAMapWithRetriesLoseNothing) {
  Pool pool(options(2, 1000));
  std::vector<int> xs(1500);
  std::iota(xs.begin(), xs.end(), 0);
  auto result = pool.map_async(record_pid_then_sleep, xs, 25);
  std::mt19937 random(12345);
  int kills = 0;
  while (!result.ready()) {
    result.wait(std::chrono::milliseconds(20 + random() % 40));
    std::vector<pid_t> pids = pool.worker_pids();
    if (!result.ready() && !pids.empty() && kill(pids[random() % pids.size()], SIGKILL) == 0) ++kills;
  }
  std::vector<int> ys = result.get();
  EXPECT_EQ(ys, xs);
  EXPECT_GT(kills, 5);
}

TEST_P(WorkFailureTest, RandomKillsWithoutRetriesFailOnlyTasksThatRanOnTheKilledWorker) {
  Pool pool(options(2, 0));
  std::vector<AsyncResult<int>> results;
  for (int task = 0; task < 1500; ++task) results.push_back(pool.apply_async(record_pid_then_sleep, task));
  std::mt19937 random(6789);
  std::set<pid_t> killed;
  for (AsyncResult<int>& last = results.back(); !last.ready();) {
    last.wait(std::chrono::milliseconds(20 + random() % 40));
    std::vector<pid_t> pids = pool.worker_pids();
    if (pids.empty() || last.ready()) continue;
    pid_t victim = pids[random() % pids.size()];
    if (kill(victim, SIGKILL) == 0) killed.insert(victim);
  }
  int lost = 0;
  for (int task = 0; task < 1500; ++task) {
    try {
      EXPECT_EQ(results[task].get(), task);
    } catch (const WorkerLost& e) {
      ++lost;
      // (0: killed between taking the task up and its first instruction.)
      pid_t ran_on = counters()->pid_of_task[task].load();
      EXPECT_TRUE(ran_on == e.pid() || ran_on == 0) << "task " << task << " failed for a worker it never ran on";
      EXPECT_TRUE(killed.contains(e.pid()));
    }
  }
  EXPECT_GT(killed.size(), 5u);
  EXPECT_LE(lost, static_cast<int>(killed.size()));  // at most the one task each killed worker ran
}

int kill_its_worker(int) {
  raise(SIGKILL);
  return 0;
}

// Tasks that kill their worker, and jobs sent behind them that wait their turn: each death sends
// the waiting jobs again for free, however many deaths they sit through (a deep window from plain
// code holds them all in flight). Only the task that ran is charged: with no retries, it fails.
TEST_P(WorkFailureTest, JobsWaitingBehindTasksThatKillTheirWorkerAreNotChargedForThoseDeaths) {
  Pool pool(options(1, 0));
  constexpr int kKillers = 24, kWaiting = 100;  // more deaths than a job's free requeues (16)
  std::vector<AsyncResult<int>> killers, waiting;
  for (int i = 0; i < kKillers; ++i) killers.push_back(pool.apply_async(kill_its_worker, i));
  for (int i = 0; i < kWaiting; ++i) waiting.push_back(pool.apply_async(square, i));
  for (auto& r : killers) EXPECT_THROW(r.get(30s), WorkerLost);
  for (int i = 0; i < kWaiting; ++i) EXPECT_EQ(waiting[i].get(30s), i * i) << "job " << i << " was charged for deaths";
}

INSTANTIATE_TEST_SUITE_P(StartMethods, WorkFailureTest, test_support::all_start_methods(),
                         test_support::start_method_name);

INSTANTIATE_TEST_SUITE_P(StartMethods, HelperFailureTest, test_support::all_start_methods(),
                         test_support::start_method_name);

}  // namespace
}  // namespace forkpool
