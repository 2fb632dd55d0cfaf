// spawn / start_processes on real forked processes, as torch.multiprocessing.spawn.

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <forkpool/runtime/error.hpp>
#include <forkpool/pool/spawn.hpp>
#include <forkpool/worker/worker_info.hpp>
#include "support.hpp"

namespace forkpool {
namespace {

using namespace std::chrono_literals;

struct Slots {
  std::atomic<int> by_rank[16];
};
std::atomic<int>* shared_slots() { return test_support::shared_across_forks<Slots>().by_rank; }

void record(int rank, int base) { shared_slots()[rank].store(base + rank); }

// What the rank's worker_info() says: id * 10 + num_workers.
void record_info(int rank) {
  std::optional<WorkerInfo> info = worker_info();
  shared_slots()[8 + rank].store(info ? info->id * 10 + info->num_workers : -1);
}

int rank_times(int rank, int k) { return rank * k; }

void fail_on_rank_one(int rank) {
  if (rank == 1) throw std::runtime_error("bad rank");
  std::this_thread::sleep_for(10s);
}

class Spawn : public ::testing::TestWithParam<StartMethod> {
 protected:
  SpawnOptions options(bool join = true) { return {.join = join, .start_method = GetParam()}; }
};

TEST_P(Spawn, RunsEveryRankWithItsArguments) {
  for (int i = 0; i < 4; ++i) shared_slots()[i] = -1;
  spawn(record, 4, options(), 100);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(shared_slots()[i].load(), 100 + i);
}

TEST_P(Spawn, EachRanksWorkerInfoIsItsRankAndTheNumberOfRanks) {
  for (int i = 0; i < 3; ++i) shared_slots()[8 + i] = -2;
  spawn(record_info, 3, options());
  for (int i = 0; i < 3; ++i) EXPECT_EQ(shared_slots()[8 + i].load(), i * 10 + 3);
}

TEST_P(Spawn, AFunctionReturningAValueGivesEachRanksByRank) {
  std::vector<int> values = spawn(rank_times, 3, options(), 10);
  EXPECT_EQ(values, (std::vector<int>{0, 10, 20}));
}

TEST_P(Spawn, AFailingRankRaisesProcessRaisedExceptionAndStopsTheOthers) {
  auto started = std::chrono::steady_clock::now();
  ProcessContext context = start_processes(fail_on_rank_one, 3, options(false));
  std::vector<pid_t> pids = context.pids();
  try {
    while (!context.join()) {}
    FAIL() << "no exception";
  } catch (const ProcessRaisedException& e) {
    EXPECT_EQ(e.rank(), 1);
    EXPECT_EQ(e.pid(), pids[1]);
    EXPECT_EQ(e.type_name(), "std::runtime_error");
    EXPECT_NE(std::string(e.what()).find("bad rank"), std::string::npos);
  }
  EXPECT_LT(std::chrono::steady_clock::now() - started, test_support::scaled(5s));
  for (pid_t pid : pids) EXPECT_FALSE(test_support::process_alive(pid));
}

TEST_P(Spawn, AKilledRankRaisesProcessExitedExceptionWithTheSignalName) {
  try {
    spawn(
        [](int rank) {
          if (rank == 0) raise(SIGKILL);
          std::this_thread::sleep_for(10s);
        },
        2, options());
    FAIL() << "no exception";
  } catch (const ProcessExitedException& e) {
    EXPECT_EQ(e.rank(), 0);
    EXPECT_EQ(e.signal(), SIGKILL);
    EXPECT_EQ(e.signal_name(), "SIGKILL");
  }
}

// torch's test_signal_raises: a rank killed at once (before it took up its function, as likely
// as not) is that rank's failure; it is never run again in a new process.
TEST_P(Spawn, ARankKilledRightAfterTheStartIsReportedAndNotRunAgain) {
  for (int round = 0; round < 3; ++round) {
    ProcessContext context = start_processes([](int) { std::this_thread::sleep_for(10s); }, 2, options(false));
    std::vector<pid_t> pids = context.pids();
    ASSERT_EQ(kill(pids[0], SIGKILL), 0);
    auto started = std::chrono::steady_clock::now();
    try {
      while (!context.join(5s))
        ASSERT_LT(std::chrono::steady_clock::now() - started, test_support::scaled(5s)) << "the rank ran again";
      FAIL() << "no exception";
    } catch (const ProcessExitedException& e) {
      EXPECT_EQ(e.rank(), 0);
      EXPECT_EQ(e.pid(), pids[0]);
      EXPECT_EQ(e.signal(), SIGKILL);
    }
  }
}

TEST_P(Spawn, AnExitCodeIsReported) {
  try {
    spawn([](int) { std::_Exit(3); }, 1, options());
    FAIL() << "no exception";
  } catch (const ProcessExitedException& e) {
    EXPECT_EQ(e.exit_code(), 3);
    EXPECT_EQ(e.signal(), 0);
  }
}

TEST_P(Spawn, JoinWithATimeoutSaysWhetherAllEnded) {
  ProcessContext context = start_processes([](int) { std::this_thread::sleep_for(200ms); }, 2, options(false));
  EXPECT_FALSE(context.join(10ms));
  auto deadline = std::chrono::steady_clock::now() + 5s;
  bool done = false;
  while (!done && std::chrono::steady_clock::now() < deadline) done = context.join(100ms);
  EXPECT_TRUE(done);
}

// Issue 58.5: under fork, spawn of a callable with state that returns a value did not compile.
TEST(SpawnTest, AStatefulCallableUnderForkReturnsEachRanksValue) {
  std::string prefix = "rank-";
  std::vector<std::string> names = spawn([prefix](int rank) { return prefix + std::to_string(rank); }, 3);
  EXPECT_EQ(names, (std::vector<std::string>{"rank-0", "rank-1", "rank-2"}));
}

TEST(SpawnOptionsTest, AFunctionHoldingStateIsForkOnly) {
  int calls = 0;
  auto counting = [&calls](int) { ++calls; };
  EXPECT_THROW(start_processes(counting, 1, {.start_method = StartMethod::spawn}), std::invalid_argument);
  spawn(counting, 1);  // forked: a copy of the caller, captures and all
}

INSTANTIATE_TEST_SUITE_P(StartMethods, Spawn, test_support::all_start_methods(), test_support::start_method_name);

}  // namespace
}  // namespace forkpool
