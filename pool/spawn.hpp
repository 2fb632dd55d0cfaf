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
#include <utility>
#include <vector>

#include <forkpool/pool/pool.hpp>
#include <forkpool/pool/pool_options.hpp>
#include <forkpool/runtime/error.hpp>
#include <forkpool/runtime/unique_fd.hpp>
#include <forkpool/sync/queue.hpp>

namespace forkpool {

namespace detail {
template <class T>
inline constexpr bool has_codec_v = requires(Writer& w, const T& value) {
  codec<T>::encode(w, value);
};

// A rank run as a pool task: whether it ended, and how it failed (null: it did not).
struct RankOutcome {
  std::function<bool()> ready;
  std::function<std::exception_ptr()> failure;
};
template <class R>
RankOutcome outcome_of(AsyncResult<R> result) {
  return {[result] { return result.ready(); },
          [result]() -> std::exception_ptr {
            if (result.successful()) return nullptr;
            try {
              result.get();
            } catch (...) {
              return std::current_exception();
            }
            return nullptr;
          }};
}
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
  // For start_processes under forkserver and spawn, and spawn() of a function returning a value:
  // a pool of nprocs workers started by `method`, and `submit(pool, rank)` gives each rank's
  // task to it.
  static ProcessContext start_in_pool(int nprocs, StartMethod method,
                                      const std::function<detail::RankOutcome(Pool&, int rank)>& submit);

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
  std::unique_ptr<Pool> pool_;              // under forkserver and spawn: its workers are the ranks
  std::vector<detail::RankOutcome> ranks_;  // each rank's task, by rank
  std::vector<pid_t> pool_pids_;
};

// Starts fn(rank, args...) for rank in [0, nprocs); with options.join, joins before returning.
template <class F, class... Args>
ProcessContext start_processes(F fn, int nprocs, SpawnOptions options, Args... args) {
  auto start = [&] {
    if (options.start_method == StartMethod::fork)
      return ProcessContext::start(nprocs, [&](int rank) { fn(rank, args...); });
    if constexpr (detail::is_sendable_function_v<F> && (detail::has_codec_v<Args> && ...)) {
      return ProcessContext::start_in_pool(nprocs, options.start_method, [&](Pool& pool, int rank) {
        return detail::outcome_of(pool.apply_async(fn, rank, args...));
      });
    }
    throw std::invalid_argument(
        "forkpool: under StartMethod::forkserver and spawn, start_processes needs a function pointer or a "
        "lambda without captures, with arguments a codec<T> can send");
  };
  ProcessContext context = start();
  if (options.join)
    while (!context.join()) {}
  return context;
}

// start_processes with join: returns when all ended, rethrows the first failure. Where fn returns
// a value, returns each rank's, by rank; then fn must be what a task may be (the values come
// back as task results), under every start method.
template <class F, class... Args>
auto spawn(F fn, int nprocs, SpawnOptions options, Args... args) {
  using R = std::invoke_result_t<F&, int, Args&...>;
  options.join = true;
  if constexpr (std::is_void_v<R>) {
    start_processes(fn, nprocs, options, args...);
  } else if constexpr (!detail::is_sendable_function_v<F>) {
    // A callable with state, under fork: each rank is forked with it, and its value comes back
    // on a queue made before the forks.
    static_assert(detail::has_codec_v<R>, "forkpool::spawn: a rank's value crosses to the caller: R needs a codec");
    if (options.start_method != StartMethod::fork)
      throw std::invalid_argument(
          "forkpool: spawn of a callable with state needs StartMethod::fork (under forkserver and spawn, fn must "
          "be a function pointer or a lambda without captures)");
    Queue<std::pair<int, R>> returned;
    ProcessContext context = ProcessContext::start(nprocs, [&](int rank) { returned.put({rank, fn(rank, args...)}); });
    while (!context.join()) {}
    std::vector<std::optional<R>> by_rank(static_cast<std::size_t>(nprocs));
    for (int i = 0; i < nprocs; ++i) {
      std::optional<std::pair<int, R>> value = returned.get_nowait();  // every rank put before it exited
      if (!value || value->first < 0 || value->first >= nprocs)
        throw ProtocolError("forkpool: spawn: a rank ended well without its value");
      by_rank[static_cast<std::size_t>(value->first)] = std::move(value->second);
    }
    std::vector<R> values;
    for (auto& value : by_rank) values.push_back(std::move(*value));
    return values;
  } else {
    detail::check_sendable<F>();
    std::vector<AsyncResult<R>> results;
    ProcessContext context = ProcessContext::start_in_pool(nprocs, options.start_method, [&](Pool& pool, int rank) {
      results.push_back(pool.apply_async(fn, rank, args...));
      return detail::outcome_of(results.back());
    });
    while (!context.join()) {}
    std::vector<R> values;
    for (auto& result : results) values.push_back(result.get());
    return values;
  }
}
template <class F, class... Args>
requires(!std::is_same_v<std::decay_t<std::tuple_element_t<0, std::tuple<Args..., void*>>>, SpawnOptions>) auto spawn(
    F fn, int nprocs, Args... args) {
  return spawn(fn, nprocs, SpawnOptions{}, args...);
}

}  // namespace forkpool
