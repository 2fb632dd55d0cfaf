#pragma once
// A spawned worker is a fresh run of the program's own executable. Its parent marks it with an
// environment variable whose value is the descriptor of the worker's bootstrap socket and the
// parent's pid (a mark from anyone else is ignored); the
// program becomes the worker when it reaches forkpool::init(), forkpool::run() or a Pool.
// runtime/ only finds the mark: what a worker does is registered by pool/ (the layer above).

#include <string>
#include <vector>

namespace forkpool::detail {

inline constexpr char kSpawnMarker[] = "FORKPOOL_SPAWNED_WORKER";

// Serves as a spawned worker on `bootstrap_fd`; never returns.
using SpawnedWorkerEntry = void (*)(int bootstrap_fd);
void set_spawned_worker_entry(SpawnedWorkerEntry entry) noexcept;

// The environment entry (NAME=value) that makes a child exec'd from this process, with its
// bootstrap socket at `bootstrap_fd`, a spawned worker.
std::string spawn_marker(int bootstrap_fd);

// When this process is a spawned worker: removes the mark from the environment (its own children
// must not see it) and serves, never returning. Elsewhere returns at once.
void serve_if_spawned_worker();

// Environment variables (NAME=value) for a fresh program started from this process: ours, less
// those that would make the child join an MPI job (OMPI_*, PMIX_*, PMI_*, HYDRA_*: an exec'd
// child that inherits them and calls MPI_Init hangs the job), plus `extra`.
std::vector<std::string> environment_for_child(const std::vector<std::string>& extra);

}  // namespace forkpool::detail
