#pragma once
// spawn / start_processes: run fn(rank, args...) in nprocs forked processes, as
// torch.multiprocessing.spawn. When one fails, the others are terminated and join() throws
// ProcessRaisedException (it threw) or ProcessExitedException (it exited non-zero or was killed).

#include <sys/types.h>

#include <chrono>
#include <exception>
#include <functional>
#include <optional>
#include <vector>

#include <forkpool/runtime/internal/unique_fd.hpp>

namespace forkpool {

struct ProcessOptions {
  bool join = true;  // start_processes() joins before returning
};

class ProcessContext {
 public:
  ProcessContext(ProcessContext&&) noexcept = default;
  ProcessContext& operator=(ProcessContext&&) noexcept = default;
  // Kills and reaps whatever still runs.
  ~ProcessContext();

  // Waits up to `timeout` (for ever without one). True when every process has ended
  // successfully; false if some still run. Throws on the first failure (the others are
  // killed first).
  bool join(std::optional<std::chrono::nanoseconds> timeout = std::nullopt);
  std::vector<pid_t> pids() const;

  // For start_processes: forks process `rank` running `body`.
  static ProcessContext start(int nprocs, const std::function<void(int rank)>& body);

 private:
  struct Child {
    int rank;
    pid_t pid;
    UniqueFd pidfd;
    UniqueFd error_pipe;  // what the child threw, written before it exits
    bool done = false;
  };
  ProcessContext() = default;
  void kill_all() noexcept;
  std::vector<Child> children_;
};

// Starts fn(rank, args...) for rank in [0, nprocs); with options.join, joins before returning.
template <class F, class... Args>
ProcessContext start_processes(F fn, int nprocs, ProcessOptions options, Args... args) {
  ProcessContext context = ProcessContext::start(nprocs, [&](int rank) { fn(rank, args...); });
  if (options.join)
    while (!context.join()) {
    }
  return context;
}

// start_processes with join: returns when all ended, rethrows the first failure.
template <class F, class... Args>
void spawn(F fn, int nprocs, Args... args) {
  start_processes(fn, nprocs, ProcessOptions{.join = true}, args...);
}

}  // namespace forkpool
