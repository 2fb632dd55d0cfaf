// Start methods: functions are found in every worker, however it started; spawned workers are
// fresh runs of this executable that serve from forkpool::init() (the suite's main calls it).

#include <dlfcn.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <forkpool/pool/pool.hpp>
#include <forkpool/runtime/error.hpp>
#include <forkpool/runtime/loop.hpp>
#include <forkpool/shm/tensor.hpp>
#include <forkpool/shm/tensor_codec.hpp>

#include "support.hpp"

extern "C" int linked_quadruple(int x);

namespace forkpool {
namespace {

using namespace std::chrono_literals;

constexpr const char* kMarker = "FORKPOOL_SPAWNED_WORKER";  // the spawn marker, as the docs name it

struct Counters {
  std::atomic<int> initialized;
};
Counters* counters() { return &test_support::shared_across_forks<Counters>(); }

int square(int x) { return x * x; }
void count_initialization() { counters()->initialized.fetch_add(1); }

class StartMethodTest : public ::testing::TestWithParam<StartMethod> {
 protected:
  void SetUp() override { counters()->initialized = 0; }
  PoolOptions options(int processes = 1) { return {.processes = processes, .start_method = GetParam()}; }
};

TEST_P(StartMethodTest, AFunctionInALibraryLinkedAtBuildTimeRuns) {
  Pool pool(options());
  EXPECT_EQ(pool.apply_async(linked_quadruple, 5).get(), 20);
}

TEST_P(StartMethodTest, ALambdaWithoutCapturesRuns) {
  Pool pool(options());
  EXPECT_EQ(pool.apply_async([](int x) { return x + 100; }, 1).get(), 101);
}

TEST_P(StartMethodTest, AFunctionInAPluginLoadedBeforeThePoolWasMadeRuns) {
  auto plugin = std::filesystem::read_symlink("/proc/self/exe").parent_path() / "libtest_plugin_1.so";
  void* handle = dlopen(plugin.c_str(), RTLD_NOW);
  ASSERT_NE(handle, nullptr) << dlerror();
  auto triple = reinterpret_cast<int (*)(int)>(dlsym(handle, "plugin_triple"));
  {
    Pool pool(options());
    EXPECT_EQ(pool.apply_async(triple, 7).get(), 21);
  }
  dlclose(handle);
}

TEST_P(StartMethodTest, CodeInNoLoadedObjectIsAnErrorAtTheCall) {
  // lea eax, [rdi + rdi*2]; ret: code made at run time, as a JIT makes it.
  const unsigned char code[] = {0x8d, 0x04, 0x7f, 0xc3};
  void* page = mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(page, MAP_FAILED);
  std::memcpy(page, code, sizeof code);
  if (mprotect(page, 4096, PROT_READ | PROT_EXEC) != 0) {
    munmap(page, 4096);
    GTEST_SKIP() << "no executable anonymous memory here";
  }
  auto jitted = reinterpret_cast<int (*)(int)>(page);
  ASSERT_EQ(jitted(3), 9);
  Pool pool(options());
  try {
    pool.apply_async(jitted, 3).get();
    ADD_FAILURE() << "code made at run time was sent to a worker";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("no loaded object"), std::string::npos) << e.what();
  }
  EXPECT_EQ(pool.apply_async(square, 3).get(), 9);  // and the pool serves on
  munmap(page, 4096);
}

TEST_P(StartMethodTest, APlainInitializerRunsOnceInEachWorker) {
  PoolOptions o = options(2);
  o.initializer = [] { count_initialization(); };  // a lambda without captures: plain
  {
    Pool pool(o);
    EXPECT_EQ(run(pool.map(square, std::vector<int>{1, 2, 3, 4})), (std::vector<int>{1, 4, 9, 16}));
  }
  EXPECT_EQ(counters()->initialized.load(), 2);
}

TEST_P(StartMethodTest, ATensorCrossesBothWaysIntact) {
  Pool pool(options());
  Tensor t = Tensor::zeros({1000}, DType::i32);
  for (int i = 0; i < 1000; ++i) t.data<std::int32_t>()[i] = i;
  auto doubled = [](Tensor in) {
    Tensor out = Tensor::empty({in.numel()}, in.dtype());
    for (std::int64_t i = 0; i < in.numel(); ++i) out.data<std::int32_t>()[i] = 2 * in.data<std::int32_t>()[i];
    return out;
  };
  for (int round = 0; round < 3; ++round) {
    Tensor back = pool.apply_async(doubled, t).get();
    ASSERT_EQ(back.numel(), 1000);
    for (int i = 0; i < 1000; ++i) ASSERT_EQ(back.data<std::int32_t>()[i], 2 * i);
  }
}

// A mutex that a thread of the parent holds while the pool is made and used, and that the
// task's code takes too.
std::mutex held_by_a_thread;
int under_the_lock(int x) {
  std::lock_guard lock(held_by_a_thread);
  return x + 1;
}

// Under fork this would deadlock: the worker is a copy of the parent taken while another thread
// held the mutex, so its copy is locked for ever. It is not run under fork for that reason.
TEST_P(StartMethodTest, AParentWithEightThreadsOneHoldingALockTheTaskTakesIsServed) {
  if (GetParam() == StartMethod::fork) GTEST_SKIP() << "fork copies the held lock: the worker would deadlock";
  std::mutex m;
  std::condition_variable cv;
  bool locked = false, done = false;
  std::vector<std::thread> threads;
  threads.emplace_back([&] {
    std::lock_guard hold(held_by_a_thread);
    std::unique_lock lock(m);
    locked = true;
    cv.notify_all();
    cv.wait(lock, [&] { return done; });
  });
  for (int i = 0; i < 7; ++i)
    threads.emplace_back([&] {
      std::unique_lock lock(m);
      cv.wait(lock, [&] { return done; });
    });
  {
    std::unique_lock lock(m);
    cv.wait(lock, [&] { return locked; });
  }
  std::vector<int> got;
  {
    Pool pool(options(2));
    auto result = pool.map_async(under_the_lock, std::vector<int>{1, 2, 3, 4}, 1);
    try {
      got = result.get(20s);
    } catch (const std::exception& e) {
      ADD_FAILURE() << e.what();
      pool.terminate();
    }
  }
  {
    std::lock_guard lock(m);
    done = true;
  }
  cv.notify_all();
  for (auto& t : threads) t.join();
  EXPECT_EQ(got, (std::vector<int>{2, 3, 4, 5}));
}

// The program's fork server is one socket: pools made on several threads at once share it.
// Not under fork: forking workers from a process whose other threads run copies the locks they
// hold (ASan's allocator's, say) into the worker, which can then deadlock: what forkserver and
// spawn are for.
TEST_P(StartMethodTest, PoolsMadeOnEightThreadsAtOnceEachServe) {
  if (GetParam() == StartMethod::fork) GTEST_SKIP() << "fork from a threaded process may copy held locks";
  std::atomic<int> served{0};
  std::vector<std::thread> threads;
  for (int i = 0; i < 8; ++i)
    threads.emplace_back([&, i] {
      Pool pool(options());
      if (pool.apply_async(square, i).get() == i * i) served.fetch_add(1);
    });
  for (auto& t : threads) t.join();
  EXPECT_EQ(served.load(), 8);
}

INSTANTIATE_TEST_SUITE_P(StartMethods, StartMethodTest, test_support::all_start_methods(),
                         test_support::start_method_name);

// What a spawned worker sees of its environment: 1 marker, 2 a child of it sees the marker,
// 4 an MPI variable, 8 the variable the test set that is not MPI's.
int what_the_worker_sees(int) {
  int seen = 0;
  if (std::getenv(kMarker)) seen |= 1;
  if (std::system("test -n \"$FORKPOOL_SPAWNED_WORKER\"") == 0) seen |= 2;
  for (const char* name : {"OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "HYDRA_HOST_FILE"})
    if (std::getenv(name)) seen |= 4;
  if (std::getenv("FORKPOOL_TEST_KEPT")) seen |= 8;
  return seen;
}

TEST(SpawnTest, WorkersAndTheirChildrenSeeNoMarkerAndNoMpiJobVariables) {
  const char* mpi[] = {"OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "HYDRA_HOST_FILE"};
  for (const char* name : mpi) setenv(name, "3", 1);
  setenv("FORKPOOL_TEST_KEPT", "yes", 1);
  int seen = -1;
  {
    Pool pool({.processes = 1, .start_method = StartMethod::spawn});
    seen = pool.apply_async(what_the_worker_sees, 0).get();
  }
  for (const char* name : mpi) unsetenv(name);
  unsetenv("FORKPOOL_TEST_KEPT");
  EXPECT_EQ(seen, 8);
}

TEST(SpawnTest, AMainThatExitsBeforeInitIsAnErrorNamingTheCauseWithinTwoSeconds) {
  setenv("FORKPOOL_TEST_EXIT_BEFORE_INIT", "1", 1);  // the suite's main exits 3 in a spawned worker
  auto started = std::chrono::steady_clock::now();
  try {
    Pool pool({.processes = 2, .start_method = StartMethod::spawn});
    ADD_FAILURE() << "a pool whose workers never started";
  } catch (const Error& e) {
    std::string what = e.what();
    EXPECT_NE(what.find("exited with code 3"), std::string::npos) << what;
    EXPECT_NE(what.find("call forkpool::init() first in main"), std::string::npos) << what;
  }
  unsetenv("FORKPOOL_TEST_EXIT_BEFORE_INIT");
  EXPECT_LT(std::chrono::steady_clock::now() - started, test_support::scaled(2s));
  EXPECT_TRUE(test_support::eventually([] { return test_support::children_named("forkpool-worker-0").empty(); }));
}

TEST(SpawnTest, SpawnedWorkersStartAtTheSameTime) {
  test_support::shared_across_forks<test_support::SpawnMeeting>().arrived.store(0);
  setenv("FORKPOOL_TEST_MEET_BEFORE_INIT", "3", 1);  // each waits in main for the other two
  int sum = 0;
  try {
    Pool pool({.processes = 3, .start_method = StartMethod::spawn});
    unsetenv("FORKPOOL_TEST_MEET_BEFORE_INIT");
    for (int x : run(pool.map(square, std::vector<int>{1, 2, 3}))) sum += x;
  } catch (const Error& e) {
    ADD_FAILURE() << e.what();
  }
  unsetenv("FORKPOOL_TEST_MEET_BEFORE_INIT");
  EXPECT_EQ(sum, 14);
}

// Set in each worker by its initializer, from the bytes the pool was given.
std::string initialized_with;
void initialize_with(std::string_view bytes) { initialized_with = std::string(bytes) + " in worker"; }
std::string initialized_with_what(int) { return initialized_with; }

TEST(SpawnTest, AnInitializerWithBytesReachesASpawnedWorker) {
  Pool pool({.processes = 1,
             .maxtasksperchild = 1,  // a second worker, started after the first, gets them too
             .initializer = Initializer::with_bytes(&initialize_with, std::string("config\0bytes", 12)),
             .start_method = StartMethod::spawn});
  std::string expected = std::string("config\0bytes", 12) + " in worker";
  EXPECT_EQ(pool.apply_async(initialized_with_what, 0).get(), expected);
  EXPECT_EQ(pool.apply_async(initialized_with_what, 0).get(), expected);
  EXPECT_EQ(initialized_with, "");  // the parent's own is untouched
}

TEST(SpawnTest, AnInitializerHoldingStateIsRejectedAtConstruction) {
  int state = 1;
  try {
    Pool pool({.processes = 1, .initializer = [&state] { ++state; }, .start_method = StartMethod::spawn});
    ADD_FAILURE() << "a capturing initializer was accepted under spawn";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("plain function"), std::string::npos) << e.what();
  }
}

// Run in a copy of this executable (see the next test): deletes that copy, then starts a new
// spawned worker for every task.
TEST(SpawnTest, HelperServesAfterItsExecutableIsDeleted) {
  const char* self = std::getenv("FORKPOOL_TEST_DELETE_SELF");
  if (!self) GTEST_SKIP() << "run by TheExecutableMayBeDeletedWhileThePoolRuns";
  Pool pool({.processes = 1, .maxtasksperchild = 1, .start_method = StartMethod::spawn});
  ASSERT_EQ(pool.apply_async(square, 2).get(), 4);
  ASSERT_EQ(unlink(self), 0);
  EXPECT_EQ(run(pool.map(square, std::vector<int>{1, 2, 3, 4, 5}, 1)), (std::vector<int>{1, 4, 9, 16, 25}));
}

TEST(SpawnTest, TheExecutableMayBeDeletedWhileThePoolRuns) {
  auto built = std::filesystem::read_symlink("/proc/self/exe");
  auto copy = built.parent_path() / ("start_method_test.copy-" + std::to_string(getpid()));
  std::filesystem::copy_file(built, copy, std::filesystem::copy_options::overwrite_existing);
  pid_t pid = fork();
  if (pid == 0) {
    setenv("FORKPOOL_TEST_DELETE_SELF", copy.c_str(), 1);
    unsetenv("FORKPOOL_TEST_RUN");  // a run of its own
    execl(copy.c_str(), copy.c_str(), "--gtest_filter=SpawnTest.HelperServesAfterItsExecutableIsDeleted",
          static_cast<char*>(nullptr));
    _exit(127);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  bool deleted = !std::filesystem::exists(copy);
  std::filesystem::remove(copy);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
  EXPECT_TRUE(deleted);
}

}  // namespace
}  // namespace forkpool
