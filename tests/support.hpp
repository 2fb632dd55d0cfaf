#pragma once
// Helpers for tests that use real processes and descriptors.

#include <sys/types.h>

#include <functional>

namespace forkpool::test_support {

// How many descriptors this process has open (counted in /proc/self/fd).
int open_fd_count();

// Resident set size of this process in KiB (VmRSS in /proc/self/status).
long rss_kib();

// Whether process `pid` still runs (a zombie, waiting for a reaper that may never come in a
// container without an init, counts as gone).
bool process_alive(pid_t pid);

// Runs `body` in a forked child and returns its exit status as waitpid() reports it. The child
// exits 0 if `body` returns normally, 1 if it throws.
int run_in_child(const std::function<void()>& body);

}  // namespace forkpool::test_support
