#pragma once
// Helpers for tests that use real processes and descriptors.

#include <sys/types.h>

#include <functional>
#include <string>
#include <vector>

namespace forkpool::test_support {

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

// Runs `body` in a forked child and returns its exit status as waitpid() reports it. The child
// exits 0 if `body` returns normally, 1 if it throws.
int run_in_child(const std::function<void()>& body);

// Runs the current test again, alone, in a new process (this executable exec'd: nothing that
// earlier tests started is there), and returns its exit status as waitpid() reports it. In that
// process `in_fresh_process()` is true. For tests about what a process starts once.
int rerun_in_fresh_process();
bool in_fresh_process();

}  // namespace forkpool::test_support
