#pragma once
// Launchers start worker processes and reap them, one per start method: fork() of the parent;
// a fork server (forked when the pool is made, or asked of the program's fork server that
// forkpool::init() started, so that no worker is forked from a parent with threads); or spawn,
// a fresh run of the program's executable.

#include <sys/types.h>

#include <cstdint>
#include <exception>
#include <memory>
#include <set>
#include <span>

#include <forkpool/ipc/internal/channel.hpp>
#include <forkpool/runtime/private/process.hpp>
#include <forkpool/runtime/unique_fd.hpp>
#include <forkpool/worker/start_method.hpp>
#include <forkpool/worker/private/worker.hpp>

namespace forkpool::detail {

struct StartedWorker {
  pid_t pid = -1;
  UniqueFd pidfd;  // readable once the worker has exited
  // The parent's objects (by base) whose code the worker has at the same addresses, or can
  // translate already: those of the process it was forked from, when it was forked.
  std::shared_ptr<const std::set<std::uintptr_t>> objects;
};

class Launcher {
 public:
  virtual ~Launcher() = default;
  // Starts worker `index` serving `channel` (the worker's end). Throws std::system_error.
  virtual StartedWorker start(int index, UniqueFd channel) = 0;

  // One worker to start: filled in with its process, or with why it could not be started.
  struct Launch {
    int index = 0;
    UniqueFd channel;  // the worker's end
    StartedWorker process;
    std::exception_ptr error;
  };
  // Starts every one of `launches`. Here one after another; a launcher whose start-up waits
  // (spawn's) overrides it so that the waits overlap.
  virtual void start_all(std::span<Launch> launches) {
    for (Launch& launch : launches) {
      try {
        launch.process = start(launch.index, std::move(launch.channel));
      } catch (...) {
        launch.error = std::current_exception();
      }
    }
  }
  // Collects the exit status of a worker whose pidfd turned readable: through the pidfd, for a
  // worker that is our own child; a fork server launcher asks the server that forked it.
  virtual ExitStatus reap(const StartedWorker& worker) { return detail::reap(worker.pidfd.get()); }
};

// Starts the program's fork server (forkpool::init()), once: every later fork server launcher
// of this process asks it for the pool's fork server (unless the initializer holds state),
// rather than forking one from a process that may have threads by then. Throws std::system_error.
void start_program_fork_server();

std::unique_ptr<Launcher> make_fork_launcher(WorkerSpec spec);
std::unique_ptr<Launcher> make_fork_server_launcher(WorkerSpec spec);
// Each worker a fresh run of the program's executable, which serves from forkpool::init() (or
// run(), or its first Pool). start() returns once the worker got there; a worker that exits or
// stalls before is an Error naming the cause. Throws std::invalid_argument for an initializer
// that is not a plain function.
std::unique_ptr<Launcher> make_spawn_launcher(WorkerSpec spec);
// The launcher of `method`.
std::unique_ptr<Launcher> make_launcher(StartMethod method, WorkerSpec spec);

}  // namespace forkpool::detail
