// forkpool::mpi under a real mpirun: each test starts tests/mpi/mpi_job (FORKPOOL_MPI_JOB) on
// 3 ranks with one scenario and checks what rank 0 printed and how mpirun ended. Skipped when
// there is no mpirun. Open MPI is run with the ob1 transport (its default picks libfabric's
// slow `net` provider here), oversubscribed (2 cores), and allowed to run as root.

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

namespace {

using Clock = std::chrono::steady_clock;

struct Outcome {
  int exit_code = -1;  // of mpirun; -1 when it had to be killed
  std::string output;  // stdout and stderr
  double seconds = 0;
};

std::string job_path(const char* variable) {
  const char* path = std::getenv(variable);
  return path ? path : "";
}

bool have_mpirun() { return std::system("command -v mpirun >/dev/null 2>&1") == 0; }

bool is_open_mpi() { return std::system("mpirun --version 2>&1 | grep -q 'Open MPI'") == 0; }

std::vector<std::string> mpirun_prefix() {
  std::vector<std::string> argv{"mpirun"};
  if (is_open_mpi()) {
    for (const char* flag : {"--mca", "pml", "ob1", "--oversubscribe"}) argv.push_back(flag);
    if (geteuid() == 0) argv.push_back("--allow-run-as-root");
  }
  return argv;
}

// Runs mpirun with `args`; kills its process group after `limit`. `during` runs while it does,
// given mpirun's pid and the output so far.
template <class During>
Outcome run_mpirun(std::vector<std::string> args, std::chrono::seconds limit, std::vector<std::string> env,
                   During during) {
  std::vector<std::string> argv = mpirun_prefix();
  argv.insert(argv.end(), args.begin(), args.end());
  int out[2];
  if (pipe2(out, O_CLOEXEC) != 0) return {};
  auto start = Clock::now();
  pid_t pid = fork();
  if (pid == 0) {
    setpgid(0, 0);
    dup2(out[1], 1);
    dup2(out[1], 2);
    for (auto& setting : env) putenv(setting.data());
    std::vector<char*> cargv;
    for (auto& a : argv) cargv.push_back(a.data());
    cargv.push_back(nullptr);
    execvp(cargv[0], cargv.data());
    _exit(127);
  }
  close(out[1]);
  Outcome outcome;
  char buffer[4096];
  bool eof = false;
  while (!eof && Clock::now() - start < limit) {
    pollfd p{out[0], POLLIN, 0};
    if (poll(&p, 1, 50) > 0) {
      ssize_t n = read(out[0], buffer, sizeof buffer);
      if (n <= 0)
        eof = true;
      else
        outcome.output.append(buffer, static_cast<std::size_t>(n));
    }
    during(pid, outcome.output);
  }
  int status = 0;
  if (!eof) kill(-pid, SIGKILL);
  while (waitpid(pid, &status, eof ? 0 : 0) < 0 && errno == EINTR) {}
  close(out[0]);
  outcome.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  if (eof && WIFEXITED(status))
    outcome.exit_code = WEXITSTATUS(status);
  else if (eof)
    outcome.exit_code = 128 + WTERMSIG(status);
  return outcome;
}

Outcome run_job(const std::string& scenario, bool node_per_rank,
                std::chrono::seconds limit = std::chrono::seconds(60)) {
  std::vector<std::string> env;
  if (node_per_rank) env.push_back("FORKPOOL_MPI_NODE_PER_RANK=1");
  return run_mpirun({"-n", "3", job_path("FORKPOOL_MPI_JOB"), scenario}, limit, env, [](pid_t, const std::string&) {});
}

class MpiTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!have_mpirun()) GTEST_SKIP() << "no mpirun on this machine";
    if (job_path("FORKPOOL_MPI_JOB").empty()) GTEST_SKIP() << "FORKPOOL_MPI_JOB not set (run through meson test)";
  }
};

void expect_all_ok(const Outcome& outcome) {
  EXPECT_EQ(outcome.exit_code, 0) << outcome.output;
  EXPECT_EQ(outcome.output.find("FAIL"), std::string::npos) << outcome.output;
  EXPECT_NE(outcome.output.find("ok "), std::string::npos) << outcome.output;
}

TEST_F(MpiTest, MapAndApplyAsyncOverThreeNodesGiveTheLocalResultsInOrder) {
  Outcome outcome = run_job("map", true);
  expect_all_ok(outcome);
  EXPECT_NE(outcome.output.find("ok every node ran calls (3 of 3)"), std::string::npos) << outcome.output;
}

TEST_F(MpiTest, ThreeRanksOnOneMachineAreOneNode) {
  Outcome outcome = run_job("map", false);
  expect_all_ok(outcome);
  EXPECT_NE(outcome.output.find("ok every node ran calls (1 of 1)"), std::string::npos) << outcome.output;
}

TEST_F(MpiTest, ATensorCrossesNodesByteIdentical) {
  Outcome outcome = run_job("tensors", true);
  expect_all_ok(outcome);
  EXPECT_NE(outcome.output.find("ok some copies were made on another node"), std::string::npos) << outcome.output;
}

TEST_F(MpiTest, OnOneNodeATensorArrivesAsTheSameMemory) { expect_all_ok(run_job("tensors", false)); }

TEST_F(MpiTest, CancelTimeoutsTerminateAndJoinWorkOnEveryNodeAndAPoolDestroyedOnAnotherThreadShutsDownOnItsOwn) {
  Outcome outcome = run_job("control", true);
  expect_all_ok(outcome);
  EXPECT_NE(outcome.output.find("ok cancel() stops a task on every node (3)"), std::string::npos) << outcome.output;
  EXPECT_NE(outcome.output.find("ok a Pool destroyed on another thread is shut down on its own"), std::string::npos)
      << outcome.output;
}

TEST_F(MpiTest, AWorkerKilledUnderARankIsWorkerLostOrARetryAndTheJobGoesOn) {
  auto marker = std::filesystem::temp_directory_path() / ("forkpool-mpi-marker-" + std::to_string(getpid()));
  std::filesystem::remove(marker);
  std::vector<std::string> env{"FORKPOOL_MPI_NODE_PER_RANK=1", "FORKPOOL_TEST_MARKER=" + marker.string()};
  Outcome outcome = run_mpirun({"-n", "3", job_path("FORKPOOL_MPI_JOB"), "worker_killed"}, std::chrono::seconds(60),
                               env, [](pid_t, const std::string&) {});
  std::filesystem::remove(marker);
  expect_all_ok(outcome);
  EXPECT_NE(outcome.output.find("ok a worker killed on another node is WorkerLost"), std::string::npos)
      << outcome.output;
}

TEST_F(MpiTest, ARankKilledMakesMpirunExitNonZeroWithinTenSeconds) {
  Outcome outcome = run_job("rank_killed", true, std::chrono::seconds(30));
  EXPECT_NE(outcome.exit_code, -1) << "mpirun still ran after 30 s\n" << outcome.output;
  EXPECT_NE(outcome.exit_code, 0) << outcome.output;
  EXPECT_LT(outcome.seconds, 10.0) << outcome.output;
}

TEST_F(MpiTest, ARankRunningAnotherBuildIsABuildMismatchAtInitOnEveryRank) {
  std::string job = job_path("FORKPOOL_MPI_JOB"), other = job_path("FORKPOOL_MPI_JOB_OTHER");
  Outcome outcome = run_mpirun({"-n", "2", job, "map", ":", "-n", "1", other, "map"}, std::chrono::seconds(60), {},
                               [](pid_t, const std::string&) {});
  EXPECT_EQ(outcome.exit_code, 0) << outcome.output;  // each rank caught it (mpi_job.cpp)
  std::size_t count = 0;
  for (std::size_t at = outcome.output.find("BuildMismatch: "); at != std::string::npos;
       at = outcome.output.find("BuildMismatch: ", at + 1))
    ++count;
  EXPECT_EQ(count, 3u) << outcome.output;
  EXPECT_NE(outcome.output.find("ranks 2 ("), std::string::npos) << outcome.output;
}

// The CPU time (ticks) of each of mpirun's children, the ranks.
std::vector<long> ranks_cpu_ticks(pid_t mpirun) {
  std::vector<long> ticks;
  std::ifstream children("/proc/" + std::to_string(mpirun) + "/task/" + std::to_string(mpirun) + "/children");
  pid_t child;
  while (children >> child) {
    std::ifstream stat("/proc/" + std::to_string(child) + "/stat");
    std::string line;
    std::getline(stat, line);
    std::istringstream fields(line.substr(line.rfind(')') + 2));
    std::string field;
    for (int i = 3; i <= 13; ++i) fields >> field;  // state .. cmajflt
    long utime = 0, stime = 0;
    fields >> utime >> stime;
    ticks.push_back(utime + stime);
  }
  return ticks;
}

TEST_F(MpiTest, IdleRanksUseUnderFivePercentCpu) {
  std::vector<long> before, after;
  Clock::time_point measured_from;
  double seconds = 0;
  Outcome outcome = run_mpirun(
      {"-n", "3", job_path("FORKPOOL_MPI_JOB"), "idle"}, std::chrono::seconds(60), {"FORKPOOL_MPI_NODE_PER_RANK=1"},
      [&](pid_t mpirun, const std::string& output) {
        if (before.empty() && output.find("idle\n") != std::string::npos) {
          before = ranks_cpu_ticks(mpirun);
          measured_from = Clock::now();
        } else if (!before.empty() && after.empty() && Clock::now() - measured_from > std::chrono::seconds(2)) {
          after = ranks_cpu_ticks(mpirun);
          seconds = std::chrono::duration<double>(Clock::now() - measured_from).count();
        }
      });
  expect_all_ok(outcome);
  ASSERT_EQ(before.size(), 3u) << outcome.output;
  ASSERT_EQ(after.size(), 3u) << outcome.output;
  for (std::size_t rank = 0; rank < 3; ++rank) {
    double cpu = static_cast<double>(after[rank] - before[rank]) / static_cast<double>(sysconf(_SC_CLK_TCK)) / seconds;
    EXPECT_LT(cpu, 0.05) << "an idle rank used " << cpu * 100 << "% of a core";
    std::printf("idle rank: %.2f%% of a core\n", cpu * 100);
  }
}

}  // namespace
