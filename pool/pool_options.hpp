#pragma once

#include <chrono>
#include <functional>

namespace forkpool {

enum class StartMethod {
  fork,        // each worker is forked from the parent
  forkserver,  // a zygote is forked when the pool is made; workers are forked from it
  spawn,       // not available yet: Pool throws std::invalid_argument
};

// Fields stay in this order: callers use designated initializers.
struct PoolOptions {
  int processes = 0;                       // 0: one per online CPU
  int maxtasksperchild = 0;                // 0: a worker lives for ever; N: replaced after N tasks
  std::function<void()> initializer = {};  // runs once in each worker before its first task
  StartMethod start_method = StartMethod::forkserver;
  int max_retries = 0;                     // a task whose worker died is run again up to N times
  // 0: none. A task (a chunk, for maps) still running this long after its worker started it is
  // stopped (the worker is killed and replaced) and fails with TimeoutError; it is not retried.
  std::chrono::nanoseconds task_timeout = {};
};

}  // namespace forkpool
