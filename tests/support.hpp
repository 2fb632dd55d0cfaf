#pragma once
// Helpers for tests that use real processes and descriptors.

#include <sys/types.h>

#include <sys/mman.h>

#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <new>
#include <string>
#include <thread>
#include <vector>

#include <forkpool/pool/pool_options.hpp>

namespace forkpool::test_support {

// The start methods a pool test runs under, and their names in the test's name.
inline auto both_start_methods() { return ::testing::Values(StartMethod::fork, StartMethod::forkserver); }
inline std::string start_method_name(const ::testing::TestParamInfo<StartMethod>& info) {
  return info.param == StartMethod::fork ? "fork" : "forkserver";
}

// How many descriptors this process has open (counted in /proc/self/fd).
int open_fd_count();

// Resident set size of this process in KiB (VmRSS in /proc/self/status).
long rss_kib();

// Whether process `pid` still runs (a zombie, waiting for a reaper that may never come in a
// container without an init, counts as gone).
bool process_alive(pid_t pid);

// The children of process `pid` (of all its threads), its name (comm) and state letter ('R',
// 'S', 'Z'...; '?' when it is gone).
std::vector<pid_t> children_of(pid_t pid);
std::string process_name(pid_t pid);
char process_state(pid_t pid);

// The children of this process named `name` (comm), e.g. "forkpool-zygote".
std::vector<pid_t> children_named(const std::string& name);

// Polls `condition` every 5 ms until it holds (true) or `limit` passes (false).
template <class F>
bool eventually(F condition, std::chrono::milliseconds limit = std::chrono::seconds(3)) {
  for (auto deadline = std::chrono::steady_clock::now() + limit; std::chrono::steady_clock::now() < deadline;) {
    if (condition()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return condition();
}

// One value-initialized T in memory shared with every process forked after the first call (for
// counters that workers write and the test reads). Call it before making a pool.
template <class T>
T& shared_across_forks() {
  static T* value = new (mmap(nullptr, sizeof(T), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0)) T{};
  return *value;
}

// Runs `body` in a forked child and returns its exit status as waitpid() reports it. The child
// exits 0 if `body` returns normally, 1 if it throws.
int run_in_child(const std::function<void()>& body);

// Runs the current test again, alone, in a new process (this executable exec'd: nothing that
// earlier tests started is there), and returns its exit status as waitpid() reports it. In that
// process `in_fresh_process()` is true. For tests about what a process starts once.
int rerun_in_fresh_process();
bool in_fresh_process();

}  // namespace forkpool::test_support
