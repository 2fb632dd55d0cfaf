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

#include <forkpool/pool/internal/core_stream.hpp>
#include <forkpool/pool/internal/pool_core.hpp>
#include <forkpool/pool/internal/task_message.hpp>
#include <forkpool/pool/pool_options.hpp>
#include <forkpool/pool/stream.hpp>
#include <forkpool/runtime/async_result.hpp>
#include <forkpool/runtime/task.hpp>

namespace forkpool {
template <class Dataset, class Batch>
class DataLoader;

namespace detail {

// Encodes up to `limit` elements from [it, end) as one job for `sink`'s chunk `index`.
template <class F, class Element, bool Spread, class It, class End>
std::shared_ptr<Job> make_job(F f, It& it, const End& end, std::size_t limit, std::shared_ptr<JobSink> sink,
                              std::size_t index, std::size_t* count_out = nullptr) {
  auto job = std::make_shared<Job>();
  std::size_t count = encode_task<F, Element, Spread>(*job, f, it, end, limit);
  if (count_out) *count_out = count;
  job->sink = std::move(sink);
  job->chunk = index;
  return job;
}

// Collects every chunk of a map into one vector, in input order.
template <class W>
class MapSink final : public JobSink {
  // Results are stored in place when W can be default-constructed, else in optionals.
  static constexpr bool kInPlace = std::is_default_constructible_v<W>;
  using Slot = std::conditional_t<kInPlace, W, std::optional<W>>;

 public:
  MapSink(std::vector<std::size_t> offsets, std::size_t total, std::shared_ptr<ResultState<std::vector<W>>> state)
      : offsets_(std::move(offsets)), slots_(total), remaining_(total), state_(std::move(state)) {
    state_->set_progress(0, total);
    if (remaining_ == 0) state_->set_value({});
  }

  void chunk_done(std::size_t chunk, const ElementRange& range, Reader& results) override {
    std::size_t begin = offsets_[chunk], size = range.size();
    if constexpr (Bitwise<W>) {
      expect_result_count(results, range, offsets_[chunk + 1] - begin);
      results.read_bytes(slots_.data() + begin + range.first, size * sizeof(W));
      results.expect_end();
    } else {
      read_results<W>(results, range, offsets_[chunk + 1] - begin,
                      [&](std::size_t i, W&& value) { slots_[begin + i] = std::move(value); });
    }
    remaining_ -= size;
    state_->set_progress(slots_.size() - remaining_, slots_.size());
    if (remaining_ == 0) state_->set_value(take_values());
  }
  // As Python's map: the first failure is the result; later chunks are ignored, and those not
  // yet sent are dropped.
  void chunk_failed(std::size_t, std::exception_ptr error) override { state_->set_error(std::move(error)); }
  bool abandoned() const override { return state_->ready(); }

 private:
  std::vector<W> take_values() {
    if constexpr (kInPlace) {
      return std::move(slots_);
    } else {
      std::vector<W> values;
      values.reserve(slots_.size());
      for (auto& slot : slots_) values.push_back(std::move(*slot));
      return values;
    }
  }

  std::vector<std::size_t> offsets_;  // chunk i covers [offsets_[i], offsets_[i + 1])
  std::vector<Slot> slots_;
  std::size_t remaining_;  // elements whose results have not arrived
  std::shared_ptr<ResultState<std::vector<W>>> state_;
};

// One apply_async call: its result and the sink that fills it, in one allocation (a million
// calls a second cannot afford two).
template <class R>
class ApplySink final : public ResultState<R>, public JobSink {
 public:
  void chunk_done(std::size_t, const ElementRange& range, Reader& results) override {
    std::optional<NonVoid<R>> value;
    read_results<NonVoid<R>>(results, range, 1, [&](std::size_t, NonVoid<R>&& v) { value.emplace(std::move(v)); });
    this->set_value(std::move(*value));
  }
  void chunk_failed(std::size_t, std::exception_ptr error) override { this->set_error(std::move(error)); }
  bool abandoned() const override { return this->ready(); }
};

// Lets `state`'s cancel() stop the jobs of `sink` on `core`.
template <class R>
void connect_cancel(ResultState<R>& state, const std::shared_ptr<PoolCore>& core, const JobSink* sink) {
  state.set_canceller(core, sink);
}

template <class F, class Element, bool Spread, class View>
class RangeStream : public CoreStream<NonVoid<CallResult<F, Element, Spread>>> {
  using Base = CoreStream<NonVoid<CallResult<F, Element, Spread>>>;

 public:
  // window 0: what the workers take (window() below; see StreamState for bound_unconsumed).
  RangeStream(std::shared_ptr<PoolCore> core, F f, View view, std::size_t chunksize, bool ordered, std::size_t window,
              bool bound_unconsumed)
      : Base(std::move(core), ordered, window, bound_unconsumed),
        f_(f),
        view_(std::move(view)),
        it_(std::ranges::begin(view_)),
        chunksize_(std::max<std::size_t>(chunksize, 1)) {
    if constexpr (std::ranges::sized_range<View>) this->set_known_total(std::ranges::size(view_));
  }

  // window 0: as many chunks as the workers take at once (two each; more while chunks are short).
  std::size_t window() const override {
    std::size_t given = Base::window();
    return given > 0 ? given : this->core().jobs_wanted();
  }

 private:
  bool submit_chunk(std::size_t index) override {
    if (this->core().terminated()) throw PoolTerminated();  // before reading any more input
    if (it_ == std::ranges::end(view_)) {
      this->end_input();
      return false;
    }
    try {
      std::size_t count = 0;
      auto job = make_job<F, Element, Spread>(f_, it_, std::ranges::end(view_), chunksize_, this->shared_from_this(),
                                              index, &count);
      this->record_chunk_size(index, count);
      this->core().submit_for_stream(std::move(job));
      return true;
    } catch (...) {
      this->end_input();  // the input (or the pool) failed: nothing more is read
      throw;
    }
  }

  F f_;
  View view_;
  std::ranges::iterator_t<View> it_;
  std::size_t chunksize_;
};

// What a stream reads lazily, owned by it: an lvalue container is copied (a stream returned from
// a helper would otherwise read a dead local); rvalues and views pass through.
template <class Range>
decltype(auto) owned_input(Range&& inputs) {
  using Plain = std::remove_cvref_t<Range>;
  if constexpr (std::is_lvalue_reference_v<Range> && !std::ranges::view<Plain> && std::copy_constructible<Plain>) {
    return Plain(inputs);
  } else {
    return std::forward<Range>(inputs);
  }
}

struct JobsDieWithWorker {};
struct PoolInternals;  // pool/internal/pool_internals.hpp: what the DataLoader, tests and diagnostics read

template <class T>
Task<T> await_result(AsyncResult<T> result) {
  co_return co_await std::move(result);
}

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
