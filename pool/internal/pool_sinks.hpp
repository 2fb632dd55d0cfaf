#pragma once
// What a Pool's calls build (pool/pool.hpp): their jobs, the sinks that take their results, and
// the stream of a lazy map.

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
#include <forkpool/pool/internal/task_encoding.hpp>
#include <forkpool/pool/stream.hpp>
#include <forkpool/runtime/async_result.hpp>
#include <forkpool/runtime/task.hpp>

namespace forkpool {
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

template <class T>
Task<T> await_result(AsyncResult<T> result) {
  co_return co_await std::move(result);
}

}  // namespace detail

}  // namespace forkpool
