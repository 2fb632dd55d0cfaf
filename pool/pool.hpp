#pragma once
// Pool: Python's multiprocessing.Pool for C++ coroutines. Tasks run on forked worker
// processes; arguments and results cross through codec<T> (tensors as shared memory).
// `F` is a function pointer or a lambda without captures.
//
// A Pool belongs to the thread that made it: every call from another thread (or from a forked
// child) throws std::logic_error at once. Work starts at the call. Awaiting a result or a stream
// resumes the awaiting coroutine inside the loop's turn that received the worker's reply.

#include <sys/types.h>

#include <algorithm>
#include <iterator>
#include <memory>
#include <optional>
#include <ranges>
#include <tuple>
#include <type_traits>
#include <vector>

#include <forkpool/pool/internal/pool_core.hpp>
#include <forkpool/pool/internal/pool_sinks.hpp>
#include <forkpool/pool/pool_options.hpp>
#include <forkpool/pool/stream.hpp>
#include <forkpool/runtime/async_result.hpp>
#include <forkpool/runtime/task.hpp>

namespace forkpool {
namespace detail {
struct PoolInternals;  // pool/internal/pool_internals.hpp: what the DataLoader, tests and diagnostics read
}  // namespace detail

// Python's multiprocessing.Pool for coroutines.
//
// Thread: a Pool belongs to the thread that made it (and to that process). Every member called
// from another thread, or in a forked child, throws std::logic_error naming the rule.
// Resumption: what it returns (AsyncResult, Task, Stream) completes on that thread's loop; an
// awaiting coroutine resumes inline, inside the loop's turn that received the result.
// Errors: a submitting call (imap too) throws PoolClosed after close() or terminate(), and
// InitializerError once the initializer has failed in a row too often; what a task does wrong
// arrives with its result (RemoteError, WorkerLost, ProtocolError; see docs/pool.md).
//
//   fp::Pool pool({.processes = 4});
//   std::vector<int> squares = co_await pool.map(square, inputs);
class Pool {
 public:
  // Starts the workers now (and, for forkserver, the fork server). Throws std::system_error when
  // they cannot be started (descriptors or processes exhausted), leaving nothing behind, and
  // std::invalid_argument for negative options.
  explicit Pool(PoolOptions options = {});
  // For Process: a pool whose one worker is the process (WorkerSpec::process_name).
  Pool(PoolOptions options, std::string process_name);
  // For spawn's ranks: a rank whose worker dies fails (WorkerLost) and is never run again.
  Pool(PoolOptions options, detail::JobsDieWithWorker);
  // For Process: the pidfd of its one worker (its own descriptor).
  UniqueFd worker_pidfd(pid_t pid) const { return core_->worker_pidfd(pid); }
  // terminate(), as leaving Python's `with Pool()` block; outside a coroutine it also waits
  // until every worker is reaped (inside one, run() waits for that before it returns). In a
  // forked child of the process that made the pool, it touches nothing of the parent's. On
  // another thread than the pool's, the shutdown is posted to the pool's thread (Loop::post) and
  // not waited for; if that thread has exited, its loop ended the workers then.
  ~Pool();
  Pool(const Pool&) = delete;
  Pool& operator=(const Pool&) = delete;

  // f(args...) on a worker, started at once.
  template <class F, class... Args>
  auto apply_async(F f, Args... args) {
    detail::check_sendable<F>();
    core_->check_owner("Pool::apply_async");
    using Element = std::tuple<Args...>;
    using R = detail::CallResult<F, Element, true>;
    auto call = std::make_shared<detail::ApplySink<R>>();
    detail::connect_cancel(*call, core_, static_cast<const detail::JobSink*>(call.get()));
    Element element(std::move(args)...);
    const Element* it = &element;
    core_->submit(detail::make_job<F, Element, true>(f, it, &element + 1, 1, call, 0));
    return AsyncResult<R>(std::move(call));
  }

  // f on every input, results in input order, started at once. chunksize 0: inputs / (4 ×
  // processes), rounded up, as CPython.
  template <class F, std::ranges::input_range Range>
  auto map_async(F f, Range&& inputs, std::size_t chunksize = 0) {
    return map_chunks<false>(f, std::forward<Range>(inputs), chunksize);
  }
  template <class F, std::ranges::input_range Range>
  auto map(F f, Range&& inputs, std::size_t chunksize = 0) {
    return detail::await_result(map_async(f, std::forward<Range>(inputs), chunksize));
  }
  // As map, each input a tuple (or pair) of arguments.
  template <class F, std::ranges::input_range Range>
  auto starmap(F f, Range&& inputs, std::size_t chunksize = 0) {
    return detail::await_result(map_chunks<true>(f, std::forward<Range>(inputs), chunksize));
  }
  template <class F, std::ranges::input_range Range>
  auto starmap_async(F f, Range&& inputs, std::size_t chunksize = 0) {
    return map_chunks<true>(f, std::forward<Range>(inputs), chunksize);
  }

  // Results one by one in input order; the input is read lazily. The stream owns what it reads:
  // an lvalue container is copied (std::move it in to spare the copy); a view is kept as it is,
  // so what a view refers to must outlive the stream.
  template <class F, std::ranges::viewable_range Range>
  auto imap(F f, Range&& inputs, std::size_t chunksize = 1) {
    return make_stream(f, std::forward<Range>(inputs), chunksize, true);
  }
  // As imap, results as they finish.
  template <class F, std::ranges::viewable_range Range>
  auto imap_unordered(F f, Range&& inputs, std::size_t chunksize = 1) {
    return make_stream(f, std::forward<Range>(inputs), chunksize, false);
  }

  // No new work; workers exit once the queue is empty.
  void close();
  // Stops the workers now; pending work fails with PoolTerminated, new work throws PoolClosed.
  void terminate();
  // After close() or terminate(): completes when every worker is reaped.
  Task<void> join();
  int processes() const;
  std::vector<pid_t> worker_pids() const;

 protected:
  // A pool with a core of another kind (mpi::Pool).
  explicit Pool(std::shared_ptr<detail::PoolCore> core) : core_(std::move(core)) {}

 private:
  template <bool Spread, class F, class Range>
  auto map_chunks(F f, Range&& inputs, std::size_t chunksize) {
    detail::check_sendable<F>();
    core_->check_owner(Spread ? "Pool::starmap" : "Pool::map");
    using Element = std::ranges::range_value_t<Range>;
    using W = detail::NonVoid<detail::CallResult<F, Element, Spread>>;
    if constexpr (!std::ranges::sized_range<Range> || !std::ranges::forward_range<Range>) {
      // One pass to learn the size; a single-pass range is kept in a vector first.
      // (Copied one by one: its sentinel may differ from its iterator, which may lack the old traits.)
      std::vector<Element> materialized;
      for (auto&& element : inputs) materialized.push_back(std::forward<decltype(element)>(element));
      return map_chunks<Spread>(f, materialized, chunksize);
    } else {
      std::size_t total = std::ranges::size(inputs);
      if (chunksize == 0) {
        std::size_t divisor = 4 * static_cast<std::size_t>(processes());
        chunksize = std::max<std::size_t>((total + divisor - 1) / divisor, 1);
      }
      chunksize = std::min(chunksize, std::max<std::size_t>(total, 1));  // (and the sums below cannot wrap)
      std::size_t chunks = (total + chunksize - 1) / chunksize;
      std::vector<std::size_t> offsets;
      for (std::size_t i = 0; i <= chunks; ++i) offsets.push_back(std::min(i * chunksize, total));
      auto state = std::make_shared<detail::ResultState<std::vector<W>>>();
      auto sink = std::make_shared<detail::MapSink<W>>(offsets, total, state);
      detail::connect_cancel(*state, core_, sink.get());
      auto it = std::ranges::begin(inputs);
      for (std::size_t c = 0; c < chunks; ++c) {
        core_->submit(detail::make_job<F, Element, Spread>(f, it, std::ranges::end(inputs), chunksize, sink, c));
      }
      return AsyncResult<std::vector<W>>(std::move(state));
    }
  }

  template <class F, class Range>
  auto make_stream(F f, Range&& inputs, std::size_t chunksize, bool ordered, std::size_t window = 0,
                   bool bound_unconsumed = false) {
    detail::check_sendable<F>();
    core_->check_owner(ordered ? "Pool::imap" : "Pool::imap_unordered");
    using Owned = decltype(detail::owned_input(std::forward<Range>(inputs)));
    using View = std::views::all_t<Owned>;
    using Element = std::ranges::range_value_t<View>;
    using W = detail::NonVoid<detail::CallResult<F, Element, false>>;
    auto state = std::make_shared<detail::RangeStream<F, Element, false, View>>(
        core_, f, std::views::all(detail::owned_input(std::forward<Range>(inputs))), chunksize, ordered, window,
        bound_unconsumed);
    state->start();  // work starts at the call, as Python's imap
    return Stream<W>(std::move(state));
  }

  friend struct detail::PoolInternals;
  std::shared_ptr<detail::PoolCore> core_;
};

}  // namespace forkpool
