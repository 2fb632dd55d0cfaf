#pragma once
// The worker side of a pool: a forked process that runs tasks until its channel closes.

#include <sys/types.h>

#include <functional>

#include <forkpool/runtime/internal/unique_fd.hpp>

namespace forkpool::detail {

struct WorkerSpec {
  int maxtasksperchild = 0;
  std::function<void()> initializer;
};

// Runs in a freshly forked process: sets it up, runs the initializer, then serves tasks from
// `channel` until it closes (or maxtasksperchild is reached). Never returns.
[[noreturn]] void worker_main(const WorkerSpec& spec, int index, pid_t parent, UniqueFd channel) noexcept;

}  // namespace forkpool::detail
