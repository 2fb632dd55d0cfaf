// Failures around the pool's helpers: the fork server, the terminal's signals, full descriptor
// tables. Each runs with both start methods (where it applies) and on both backends.

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include <forkpool/pool/pool.hpp>
#include "support.hpp"

namespace forkpool {
namespace {

using namespace std::chrono_literals;
using test_support::children_named;
using test_support::children_of;
using test_support::process_alive;
using test_support::process_state;
using test_support::run_in_child;

int square(int x) { return x * x; }

// Polls `condition` for up to two seconds.
template <class F>
bool eventually(F condition) {
  for (int i = 0; i < 200; ++i) {
    if (condition()) return true;
    std::this_thread::sleep_for(10ms);
  }
  return condition();
}

pid_t the_fork_server() {
  std::vector<pid_t> servers = children_named("forkpool-zygote");
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

INSTANTIATE_TEST_SUITE_P(StartMethods, HelperFailureTest, ::testing::Values(StartMethod::fork, StartMethod::forkserver),
                         [](const auto& info) { return info.param == StartMethod::fork ? "fork" : "forkserver"; });

}  // namespace
}  // namespace forkpool
