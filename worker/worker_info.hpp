#pragma once
// worker_info(): who this process is among its pool's workers (or spawn()'s ranks), as torch's
// DataLoader get_worker_info(), with a seed of its own (every DataLoader worker otherwise starts
// from the same random state: pytorch#5059).

#include <sys/types.h>

#include <cstdint>
#include <optional>

namespace forkpool {

struct WorkerInfo {
  int id;  // 0 .. num_workers - 1; a replacement keeps the id of the worker it replaces
  int num_workers;
  pid_t pid;
  std::uint64_t seed;  // differs between workers and between a worker and its replacement; the
                       // same from run to run for the same PoolOptions::seed
};

// In a pool worker or a rank of spawn()/start_processes(): who it is. Empty elsewhere (in the
// parent, say). Any thread.
//   int sample(int index) {
//     std::mt19937_64 rng(forkpool::worker_info()->seed ^ index);
//     ...
//   }
std::optional<WorkerInfo> worker_info();

namespace detail {
void set_worker_info(WorkerInfo info);
// In a worker: the process that started it (its pool's owner), recorded as it starts.
void set_starting_parent(pid_t parent);
std::optional<pid_t> starting_parent();
// The seed of the `generation`th worker to hold `id` in a pool whose seed is `base`.
std::uint64_t worker_seed(std::uint64_t base, int id, std::uint64_t generation) noexcept;
// PoolOptions::seed, or a random base when it is 0.
std::uint64_t pool_seed_base(std::uint64_t requested);
}  // namespace detail

}  // namespace forkpool
