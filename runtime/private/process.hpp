#pragma once
// Process plumbing for workers: starting them well-behaved, watching and reaping them.

#include <sys/types.h>

#include <string>
#include <vector>

#include <forkpool/runtime/unique_fd.hpp>

namespace forkpool::detail {

// How a process ended: exit_code >= 0 and signal == 0, or exit_code == -1 and the signal.
struct ExitStatus {
  int exit_code = -1;
  int signal = 0;
};

// getpid() without a system call: cached, and refreshed in every forked child.
pid_t current_pid() noexcept;

// A pidfd for `pid`, close-on-exec. Throws std::system_error.
UniqueFd open_pidfd(pid_t pid);

// The pidfd of our new child `pid` (unreaped, so its pid cannot be recycled meanwhile). When none
// can be opened the child is killed and reaped, and the error rethrown: a child we cannot watch
// must not run. A child already reaped by someone else (the host ignores SIGCHLD) is no error:
// a descriptor that is readable at once stands in, and its status is unknown.
UniqueFd watch_child(pid_t pid);

// Reaps the exited child behind `pidfd` (which must be readable). If it is not our child (or
// a host's SIGCHLD handling reaped it first), the status is unknown: exit code -1, signal 0.
ExitStatus reap(int pidfd);

// Sends `signal` through a pidfd: never hits a recycled pid.
void send_signal(int pidfd, int signal) noexcept;

// Makes the calling (freshly forked) process die with `expected_parent` (PR_SET_PDEATHSIG), and
// exit at once if the parent is already gone; 0: not (a process whose lifeline is a socket from
// another process than its parent). Names it `name` (comm and cmdline).
void die_with_parent(pid_t expected_parent) noexcept;
void set_process_name(const std::string& name) noexcept;

// Makes the calling (freshly forked) process a well-behaved helper of `expected_parent`:
// dies with it (PR_SET_PDEATHSIG, and exits at once if it is already gone), default signal
// dispositions but SIGINT and SIGQUIT ignored (the terminal's, sent to the whole process group,
// are the parent's to handle), an empty mask, named `name` (comm and cmdline), and no descriptors open but
// stdio and `keep`, which ends up as descriptor 3. Returns 3.
int become_helper_process(const std::string& name, pid_t expected_parent, int keep) noexcept;

// Starts a fresh run of this program's executable (/proc/self/exe: the file may have been
// replaced or deleted since) with our arguments and working directory, `environment`
// (NAME=value), and descriptor `keep` left open at its number; every other descriptor of ours is
// close-on-exec. The child starts with default signal dispositions but SIGINT and SIGQUIT
// ignored, as a helper. Returns its pid (exec failing: it exits 127). Throws std::system_error.
pid_t spawn_self(int keep, const std::vector<std::string>& environment);

// What spawn_self() runs instead of this program's executable and arguments: `command`, its
// executable first (an embedding interpreter names itself and the code that serves: forkpool for
// Python). Empty: this program again. Any thread.
void set_spawn_program(std::vector<std::string> command);

// Exit codes of our own helpers' failures.
inline constexpr int kExitOrphaned = 121;  // the parent died before PR_SET_PDEATHSIG
inline constexpr int kExitInitializerFailed = 122;
inline constexpr int kExitBadMessage = 123;

// fork(), with stdio flushed first: output buffered in the parent must not be written twice.
pid_t fork_flushed() noexcept;

// fork_flushed() for a helper process: the child starts with every signal blocked, so that no
// signal meets the parent's handlers there; it unblocks them once its own dispositions are set
// (become_helper_process does). The parent's mask is as it was.
pid_t fork_helper() noexcept;

// Closes every descriptor >= first except those in `keep` (sorted).
void close_descriptors_from(int first, const std::vector<int>& keep) noexcept;

// Flushes stdio and ends the process without running destructors (ours are the parent's).
[[noreturn]] void exit_helper(int code) noexcept;

}  // namespace forkpool::detail
