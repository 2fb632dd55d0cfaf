// Functions are named by address; one in a library the parent loaded after forking a worker is
// loaded by the worker too, and a library that is another build there is an Error, not a crash.

#include <dlfcn.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <string>
#include <vector>

#include <forkpool/pool/pool.hpp>
#include <forkpool/runtime/loop.hpp>
#include "support.hpp"

namespace forkpool {
namespace {

int square(int x) { return x * x; }

// A private copy of plugin `variant` (built beside this test) at `path`.
void copy_plugin(int variant, const std::filesystem::path& path) {
  auto built = std::filesystem::read_symlink("/proc/self/exe").parent_path() /
               ("libtest_plugin_" + std::to_string(variant) + ".so");
  std::filesystem::path staging = path.string() + ".new";
  std::filesystem::copy_file(built, staging, std::filesystem::copy_options::overwrite_existing);
  std::filesystem::rename(staging, path);  // a new file: a process that mapped the old keeps it
}

class FunctionRefTest : public ::testing::TestWithParam<StartMethod> {
 protected:
  void SetUp() override {
    directory_ = std::filesystem::temp_directory_path() / ("forkpool-plugin-" + std::to_string(getpid()));
    std::filesystem::create_directories(directory_);
  }
  void TearDown() override {
    if (handle_) dlclose(handle_);
    std::filesystem::remove_all(directory_);
  }
  PoolOptions options() { return {.processes = 1, .start_method = GetParam()}; }
  using Triple = int (*)(int);
  Triple load(const std::filesystem::path& path) {
    handle_ = dlopen(path.c_str(), RTLD_NOW);
    EXPECT_NE(handle_, nullptr) << dlerror();
    return handle_ ? reinterpret_cast<Triple>(dlsym(handle_, "plugin_triple")) : nullptr;
  }
  std::filesystem::path directory_;
  void* handle_ = nullptr;
};

TEST_P(FunctionRefTest, AFunctionFromALibraryLoadedAfterThePoolWasMadeRunsInItsWorkers) {
  Pool pool(options());
  ASSERT_EQ(pool.apply_async(square, 2).get(), 4);  // the worker was forked before the library came
  std::filesystem::path path = directory_ / "plugin.so";
  copy_plugin(1, path);
  Triple triple = load(path);
  ASSERT_NE(triple, nullptr);
  EXPECT_EQ(pool.apply_async(triple, 5).get(), 15);
  std::vector<int> xs{1, 2, 3};
  EXPECT_EQ(run(pool.map(triple, xs)), (std::vector<int>{3, 6, 9}));
  EXPECT_EQ(pool.apply_async(square, 3).get(), 9);
}

TEST_P(FunctionRefTest, ALibraryThatIsAnotherBuildInTheWorkerIsAnErrorNotACrash) {
  Pool pool(options());
  ASSERT_EQ(pool.apply_async(square, 2).get(), 4);
  pid_t worker = pool.worker_pids().at(0);
  std::filesystem::path path = directory_ / "plugin.so";
  copy_plugin(1, path);
  Triple triple = load(path);
  ASSERT_NE(triple, nullptr);
  copy_plugin(2, path);  // what the worker will find at that path: another build
  try {
    pool.apply_async(triple, 5).get();
    FAIL() << "the worker called a function of another build";
  } catch (const RemoteError& e) {
    EXPECT_NE(e.message().find("another build"), std::string::npos) << e.what();
  }
  EXPECT_EQ(pool.apply_async(square, 3).get(), 9);
  EXPECT_EQ(pool.worker_pids().at(0), worker);  // an error, not a crash
}

INSTANTIATE_TEST_SUITE_P(StartMethods, FunctionRefTest, test_support::all_start_methods(),
                         test_support::start_method_name);

}  // namespace
}  // namespace forkpool
