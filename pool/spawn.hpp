#pragma once
// spawn / start_processes: run fn(rank, args...) in nprocs processes, as
// torch.multiprocessing.spawn. When one fails, the others are terminated and join() throws
// ProcessRaisedException (it threw) or ProcessExitedException (it exited non-zero or was killed).
//
// Under StartMethod::fork each rank is forked from the caller and `fn` may be any callable.
// Under forkserver and spawn each rank is a worker of a pool of nprocs started that way, and
// `fn` must be what a task may be (a function pointer or a lambda without captures), its
// arguments values a codec<T> can send.

#include <sys/types.h>

#include <chrono>
#include <exception>
#include <functional>
#include <optional>
#include <stdexcept>
#include <type_traits>
#include <vector>

#include <forkpool/pool/pool.hpp>
#include <forkpool/pool/pool_options.hpp>
#include <forkpool/runtime/internal/unique_fd.hpp>

namespace forkpool {

namespace detail {
template <class T>
inline constexpr bool has_codec_v = requires(Writer& w, const T& value) { codec<T>::encode(w, value); };
}  // namespace detail

struct SpawnOptions {
  bool join = true;  // start_processes() joins before returning
  StartMethod start_method = StartMethod::fork;
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
  // For start_processes under forkserver and spawn: a pool of nprocs workers started by
  // `method`, and `submit(pool, rank)` gives each rank's task to it.
  static ProcessContext start_in_pool(int nprocs, StartMethod method,
                                      const std::function<AsyncResult<void>(Pool&, int rank)>& submit);

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
  bool join_pool(std::optional<std::chrono::nanoseconds> timeout);
  std::vector<Child> children_;
  std::unique_ptr<Pool> pool_;               // under forkserver and spawn: its workers are the ranks
  std::vector<AsyncResult<void>> ranks_;     // each rank's task, by rank
  std::vector<pid_t> pool_pids_;
};

// Starts fn(rank, args...) for rank in [0, nprocs); with options.join, joins before returning.
template <class F, class... Args>
ProcessContext start_processes(F fn, int nprocs, SpawnOptions options, Args... args) {
  auto start = [&] {
    if (options.start_method == StartMethod::fork)
      return ProcessContext::start(nprocs, [&](int rank) { fn(rank, args...); });
    if constexpr (detail::is_sendable_function_v<F> && std::is_void_v<std::invoke_result_t<F&, int, Args&...>> &&
                  (detail::has_codec_v<Args> && ...)) {
      return ProcessContext::start_in_pool(nprocs, options.start_method,
                                           [&](Pool& pool, int rank) { return pool.apply_async(fn, rank, args...); });
    }
    throw std::invalid_argument(
        "forkpool: under StartMethod::forkserver and spawn, start_processes needs a function pointer or a "
        "lambda without captures, returning void, with arguments a codec<T> can send");
  };
  ProcessContext context = start();
  if (options.join)
    while (!context.join()) {
    }
  return context;
}

// start_processes with join: returns when all ended, rethrows the first failure.
template <class F, class... Args>
void spawn(F fn, int nprocs, Args... args) {
  start_processes(fn, nprocs, SpawnOptions{.join = true}, args...);
}
template <class F, class... Args>
void spawn(F fn, int nprocs, SpawnOptions options, Args... args) {
  options.join = true;
  start_processes(fn, nprocs, options, args...);
}

}  // namespace forkpool
