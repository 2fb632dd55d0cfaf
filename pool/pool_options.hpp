#pragma once

#include <chrono>
#include <cstdint>
#include <optional>

#include <forkpool/worker/start_method.hpp>

namespace forkpool {

// Fields stay in this order: callers use designated initializers.
struct PoolOptions {
  int processes = 0;             // 0: one per online CPU
  int maxtasksperchild = 0;      // 0: a worker lives for ever; N: replaced after N tasks
  Initializer initializer = {};  // runs once in each worker before its first task
  StartMethod start_method = StartMethod::forkserver;
  int max_retries = 0;  // a task whose worker died is run again up to N times
  // 0: none. A task (a chunk, for maps) still running this long after its worker started it is
  // stopped (the worker is killed and replaced) and fails with TimeoutError; it is not retried.
  std::chrono::nanoseconds task_timeout = {};
  std::uint64_t seed = 0;  // base of every worker's seed (worker_info()); 0: random
  // How long the parent and a worker poll for the other's next message before sleeping in the
  // kernel (a wake-up across CPUs costs ~25 µs on VMs; a polled message ~0.1 µs). Empty:
  // adaptive, up to 50 µs, only while a message is expected, less when waits are long or the
  // machine is oversubscribed. Zero: never poll (shared machines: no CPU spent waiting).
  std::optional<std::chrono::nanoseconds> spin = {};
};

}  // namespace forkpool
