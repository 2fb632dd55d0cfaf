#pragma once
// Launchers start worker processes and reap them: directly by fork(), or through a fork server
// (a zygote forked when the pool is made, so replacements never fork the busy parent).

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <set>

#include <forkpool/ipc/internal/channel.hpp>
#include <forkpool/runtime/internal/process.hpp>
#include <forkpool/runtime/internal/unique_fd.hpp>
#include <forkpool/pool/internal/worker.hpp>

namespace forkpool::detail {

struct SpawnedWorker {
  pid_t pid = -1;
  UniqueFd pidfd;  // readable once the worker has exited
  // The objects loaded (at these bases) in the process it was forked from, when it was forked:
  // it has their code at the same addresses.
  std::shared_ptr<const std::set<std::uintptr_t>> objects;
};

class Launcher {
 public:
  virtual ~Launcher() = default;
  // Starts worker `index` serving `channel` (the worker's end). Throws std::system_error.
  virtual SpawnedWorker spawn(int index, UniqueFd channel) = 0;
  // Collects the exit status of a worker whose pidfd turned readable.
  virtual ExitStatus reap(const SpawnedWorker& worker) = 0;
};

std::unique_ptr<Launcher> make_fork_launcher(WorkerSpec spec);
std::unique_ptr<Launcher> make_fork_server_launcher(WorkerSpec spec);

}  // namespace forkpool::detail
