#pragma once
// Helpers for tests that use real processes and descriptors.

#include <sys/types.h>

#include <sys/mman.h>

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <stdexcept>
#include <new>
#include <string>
#include <type_traits>
#include <typeinfo>
#include <thread>
#include <vector>

#include <forkpool/pool/pool_options.hpp>

namespace forkpool::test_support {

// The start methods a pool test runs under, and their names in the test's name.
inline auto all_start_methods() {
  return ::testing::Values(StartMethod::fork, StartMethod::forkserver, StartMethod::spawn);
}
inline std::string start_method_name(const ::testing::TestParamInfo<StartMethod>& info) {
  switch (info.param) {
    case StartMethod::fork: return "fork";
    case StartMethod::forkserver: return "forkserver";
    case StartMethod::spawn: return "spawn";
  }
  return "unknown";
}

// How many descriptors this process has open (counted in /proc/self/fd).
int open_fd_count();

// Resident set size of this process in KiB (VmRSS in /proc/self/status).
long rss_kib();

// Limits this process's address space (RLIMIT_AS) to what it maps now and `extra_bytes` more,
// for a child that must not be able to make something large. Throws std::system_error.
void limit_address_space(std::size_t extra_bytes);

// RAM and swap together, as sysinfo() counts them; whether there is any swap.
std::uint64_t machine_memory_bytes();
bool machine_has_swap();
// Makes this process the OOM killer's first choice (oom_score_adj 1000): a child testing that
// something too large is refused, whose regression would take memory until the killer came,
// then takes only itself down.
void volunteer_to_the_oom_killer();

// CPU time (user + system, in the kernel's ticks) process `pid` has used so far.
std::chrono::milliseconds cpu_time_of(pid_t pid);

// Whether process `pid` still runs (a zombie, waiting for a reaper that may never come in a
// container without an init, counts as gone).
bool process_alive(pid_t pid);
// Whether active_children() lists `pid`.
bool is_active_child(pid_t pid);

// The children of process `pid` (of all its threads), its name (comm) and state letter ('R',
// 'S', 'Z'...; '?' when it is gone).
std::vector<pid_t> children_of(pid_t pid);
std::string process_name(pid_t pid);
char process_state(pid_t pid);

// The children of this process named `name` (comm), e.g. "forkpool-zygote".
std::vector<pid_t> children_named(const std::string& name);

// How many times longer a wall-clock bound may be here: FORKPOOL_TEST_TIME_SCALE, 1 unless set.
// meson.build's test setups set it with the same timeout multiplier (under a sanitizer everything
// is slower; with suites sharing the cores a wake-up can come late).
double time_scale();

// `bound` times time_scale(): every upper bound a test puts on elapsed time goes through it.
template <class Rep, class Period>
std::chrono::nanoseconds scaled(std::chrono::duration<Rep, Period> bound) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(bound * time_scale());
}

// Polls `condition` every 5 ms until it holds (true) or scaled(`limit`) passes (false).
template <class F>
bool eventually(F condition, std::chrono::milliseconds limit = std::chrono::seconds(3)) {
  for (auto deadline = std::chrono::steady_clock::now() + scaled(limit); std::chrono::steady_clock::now() < deadline;) {
    if (condition()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return condition();
}

// One zero-filled T in memory shared with every process the test starts (for counters that
// workers write and the test reads): forked ones inherit the mapping; a spawned worker (a fresh
// run of this executable) maps the same file, named after the run (see mark_test_run()).
void* shared_file(const char* name, std::size_t size);
template <class T>
T& shared_across_forks() {
  static_assert(std::is_trivially_destructible_v<T>);
  static T* value = static_cast<T*>(shared_file(typeid(T).name(), sizeof(T)));
  return *value;
}

// Counts this process among those meeting (in a shared_across_forks counter) and waits up to 5 s
// for `parties` of them: false when they did not all come.
struct SpawnMeeting {
  std::atomic<int> arrived;
};
bool meet_before_init(int parties);

// Names this run of the suite (in the environment, which spawned workers inherit), unless it is
// one of those workers. The suite's main calls it first.
void mark_test_run();

// The next item of `queue`, waiting at most `limit`: a test whose producer never puts fails
// (std::runtime_error) instead of hanging.
template <class Q>
auto get_within(Q& queue, std::chrono::nanoseconds limit = std::chrono::seconds(30)) {
  auto item = queue.get(limit);
  if (!item) throw std::runtime_error("forkpool test: nothing arrived on the queue in time");
  return std::move(*item);
}

// Expects `use` (a call on a handle that a move emptied) to throw std::logic_error naming
// `type` ("a Lock used after it was moved from"), the handles' documented error.
template <class F>
void expect_moved_from_error(const std::string& type, F use) {
  try {
    use();
    ADD_FAILURE() << "a moved-from " << type << " was used and nothing was thrown";
  } catch (const std::logic_error& error) {
    EXPECT_NE(std::string(error.what()).find(type + " used after it was moved from"), std::string::npos)
        << error.what();
  }
}

// Runs `call` on a new std::thread, joins it, and returns the message of the std::logic_error
// it threw there ("" if it threw none): the refusals of calls that belong to another thread.
// Another exception is returned as "not a logic_error: <what>", so the caller's check fails.
template <class F>
std::string logic_error_on_another_thread(F call) {
  std::string message;
  std::thread([&] {
    try {
      call();
    } catch (const std::logic_error& error) {
      message = error.what();
    } catch (const std::exception& error) {
      message = std::string("not a logic_error: ") + error.what();
    }
  }).join();
  return message;
}

// Runs `body` in a forked child and returns its exit status as waitpid() reports it. The child
// exits 0 if `body` returns normally, 1 if it throws or a gtest expectation failed in it.
int run_in_child(const std::function<void()>& body);

// As run_in_child, but the child is killed by SIGALRM if `body` has not returned after `limit`:
// a test of something that used to hang fails instead of hanging the suite.
int run_in_child_within(std::chrono::seconds limit, const std::function<void()>& body);
// A failure unless the child of run_in_child_within ended well; `hang` names what its alarm
// ending it means.
void expect_ended_well(int status, const char* hang);

// Runs the current test again, alone, in a new process (this executable exec'd: nothing that
// earlier tests started is there), and returns its exit status as waitpid() reports it. In that
// process `in_fresh_process()` is true. For tests about what a process starts once.
int rerun_in_fresh_process();
bool in_fresh_process();
// rerun_in_fresh_process(), and a failure here unless the test passed there. A test about
// what a process starts once begins: if (!in_fresh_process()) return expect_passes_in_fresh_process();
void expect_passes_in_fresh_process();

}  // namespace forkpool::test_support
