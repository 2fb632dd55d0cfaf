#pragma once
// StreamState: the chunks of one imap or imap_unordered, submitted lazily with a bounded number
// in flight, and handed out in input order or as they finish.

#include <coroutine>
#include <cstddef>
#include <deque>
#include <exception>
#include <map>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include <forkpool/pool/internal/job.hpp>
#include <forkpool/pool/internal/task_message.hpp>
#include <forkpool/runtime/async_result.hpp>
#include <forkpool/runtime/task.hpp>

namespace forkpool::detail {

template <class R>
class StreamState : public JobSink {
 public:
  // The window bounds the chunks running plus the results the consumer could take now and has
  // not: a consumer that falls behind stops the workers, so memory stays within the window (a
  // stream of 12 MiB tensors read slowly holds `window` of them, not kReorderLimit). Results
  // that arrive ahead of their turn (ordered) do not count: they wait in a reorder buffer of at
  // most kReorderLimit chunks, so one slow chunk does not leave the other workers idle
  // (head-of-line blocking). Counting them too was measured: at 64 KiB results it doubles the
  // rate (two workers take turns and leave a CPU to the parent), but it halves the rate of
  // trivial tasks, whose results from two workers arrive interleaved.
  static constexpr std::size_t kReorderLimit = 1024;

  // bound_unconsumed: the window bounds every chunk submitted and not yet handed out, results
  // waiting behind a slow chunk included, as a DataLoader's prefetch_factor does: memory stays
  // within the window, at the price of head-of-line blocking behind a slow chunk.
  StreamState(bool ordered, std::size_t window, bool bound_unconsumed = false)
      : ordered_(ordered), bound_unconsumed_(bound_unconsumed), window_(window) {}

  // Items finished (or failed) so far, of how many: the total is known once the input is read.
  Progress progress() const {
    if (exhausted_) return {done_elements_, submitted_elements_};
    return {done_elements_, known_total_};
  }
  // Every result has been handed out (or the stream failed for good).
  bool finished() const { return exhausted_ && in_flight_ == 0 && position_ >= current_.size() && !input_error_; }

  // Submits the first window of chunks.
  void start() { fill_window(); }
  // Chunks kept running (or unconsumed): the window given, unless a subclass knows better.
  virtual std::size_t window() const { return window_; }
  // Around submitting a window's chunks: a pool sends them as one batch.
  virtual void hold_submits() {}
  virtual void release_submits() {}

  static Task<std::optional<R>> next(std::shared_ptr<StreamState> self) {
    for (;;) {
      if (self->position_ < self->current_.size()) co_return std::move(self->current_[self->position_++]);
      self->fill_window();
      if (std::optional<Outcome> outcome = self->take_ready()) {
        --self->in_flight_;
        self->fill_window();  // its place in the window is free again (bound_unconsumed)
        self->current_.clear();
        self->position_ = 0;
        if (outcome->error) std::rethrow_exception(outcome->error);
        self->current_ = std::move(outcome->values);
        continue;
      }
      if (self->in_flight_ == 0 && self->exhausted_) {
        if (self->input_error_) std::rethrow_exception(std::exchange(self->input_error_, {}));
        co_return std::nullopt;
      }
      co_await ChunkArrival{self.get()};
    }
  }

  void chunk_done(std::size_t chunk, const ElementRange& range, Reader& results) override {
    if (!awaited(chunk)) return;  // failed already
    std::size_t expected = chunk_sizes_.at(chunk);
    if (range.size() == expected) {
      Outcome outcome;
      outcome.values.reserve(expected);
      read_results<R>(results, range, expected,
                      [&](std::size_t, R&& value) { outcome.values.push_back(std::move(value)); });
      arrive(chunk, std::move(outcome));
      return;
    }
    // A part of a chunk whose worker died: the chunk arrives when all its parts have.
    Parts& parts = parts_[chunk];
    parts.values.resize(expected);
    read_results<R>(results, range, expected, [&](std::size_t i, R&& value) { parts.values[i] = std::move(value); });
    if ((parts.filled += range.size()) < expected) return;
    Outcome outcome;
    outcome.values.reserve(expected);
    for (auto& value : parts.values) outcome.values.push_back(std::move(*value));
    parts_.erase(chunk);
    arrive(chunk, std::move(outcome));
  }

  void chunk_failed(std::size_t chunk, std::exception_ptr error) override {
    if (!awaited(chunk)) return;  // one failure per chunk: its other parts' are ignored
    parts_.erase(chunk);
    Outcome outcome;
    outcome.error = std::move(error);
    arrive(chunk, std::move(outcome));
  }

 protected:
  // Encodes and submits chunk `index` of the input, recording its size with record_chunk_size();
  // false when the input is exhausted. What it throws (the input's own error) is handed out
  // after every earlier result, as Python's imap does; the input then ends.
  virtual bool submit_chunk(std::size_t index) = 0;
  // The input's size, when it is known before it is read (a sized range).
  void set_known_total(std::size_t total) { known_total_ = total; }
  void record_chunk_size(std::size_t index, std::size_t size) {
    chunk_sizes_[index] = size;
    submitted_elements_ += size;
  }
  // Chunk `chunk` (recorded with size 1) arrives as `value`, without a worker.
  void deliver(std::size_t chunk, R value) {
    if (!awaited(chunk)) return;
    Outcome outcome;
    outcome.values.push_back(std::move(value));
    arrive(chunk, std::move(outcome));
  }
  // Chunk `chunk` arrives with nothing to hand out (an iterable shard that had ended).
  void skip(std::size_t chunk) {
    if (awaited(chunk)) arrive(chunk, Outcome{});
  }

 private:
  struct Outcome {
    std::vector<R> values;
    std::exception_ptr error;
  };

  struct Parts {
    std::vector<std::optional<R>> values;
    std::uint64_t filled = 0;
  };

  // Submitted, and neither arrived nor handed out yet.
  bool awaited(std::size_t chunk) const { return chunk_sizes_.contains(chunk) && !arrived_.contains(chunk); }

  struct ChunkArrival {
    StreamState* state;
    bool await_ready() const noexcept { return false; }
    void await_suspend(std::coroutine_handle<> h) noexcept { state->waiter_ = h; }
    void await_resume() const noexcept {}
  };

  void fill_window() {
    hold_submits();
    while (!exhausted_ && occupied() < window() && in_flight_ - running_ < kReorderLimit) {
      bool submitted;
      try {
        submitted = submit_chunk(next_chunk_);
      } catch (...) {
        fail_input(std::current_exception());
        break;
      }
      if (submitted) {
        ++next_chunk_;
        ++in_flight_;
        ++running_;
      } else {
        exhausted_ = true;
      }
    }
    release_submits();
  }

  // What counts against the window (see the constructor).
  std::size_t occupied() const {
    if (bound_unconsumed_) return in_flight_;
    return running_ + (ordered_ ? ordered_takeable_ : arrival_order_.size());
  }

  // The input threw (or its chunk could not be submitted): kept until every result submitted
  // before it has been handed out.
  void fail_input(std::exception_ptr error) {
    exhausted_ = true;
    input_error_ = std::move(error);
    if (auto recorded = chunk_sizes_.find(next_chunk_); recorded != chunk_sizes_.end()) {
      submitted_elements_ -= recorded->second;
      chunk_sizes_.erase(recorded);
    }
  }

  std::optional<Outcome> take_ready() {
    std::size_t chunk;
    if (ordered_) {
      if (!arrived_.contains(next_to_yield_)) return std::nullopt;
      chunk = next_to_yield_++;
      --ordered_takeable_;
    } else {
      if (arrival_order_.empty()) return std::nullopt;
      chunk = arrival_order_.front();
      arrival_order_.pop_front();
    }
    auto node = arrived_.extract(chunk);
    chunk_sizes_.erase(chunk);
    return std::move(node.mapped());
  }

  void arrive(std::size_t chunk, Outcome outcome) {
    --running_;
    done_elements_ += chunk_sizes_.at(chunk);
    arrived_.emplace(chunk, std::move(outcome));
    if (ordered_) {
      while (arrived_.contains(next_to_yield_ + ordered_takeable_)) ++ordered_takeable_;  // a gap may have closed
    } else {
      arrival_order_.push_back(chunk);
    }
    if (auto waiter = std::exchange(waiter_, {})) waiter.resume();
  }

  bool ordered_;
  bool bound_unconsumed_;
  std::size_t window_;
  std::size_t next_chunk_ = 0;     // next chunk of input to submit
  std::size_t next_to_yield_ = 0;  // ordered: next chunk to hand out
  std::size_t in_flight_ = 0;      // submitted and not yet handed out
  std::size_t running_ = 0;        // submitted and not yet arrived
  // Ordered: arrived in an unbroken run from next_to_yield_, the consumer's to take now (those
  // ahead of a gap are not). Unordered, every arrived chunk is: arrival_order_.size().
  std::size_t ordered_takeable_ = 0;
  std::size_t submitted_elements_ = 0;
  std::size_t done_elements_ = 0;
  std::optional<std::size_t> known_total_;
  bool exhausted_ = false;
  std::exception_ptr input_error_;  // handed out after every earlier result
  std::map<std::size_t, std::size_t> chunk_sizes_;
  std::map<std::size_t, Outcome> arrived_;
  std::map<std::size_t, Parts> parts_;  // chunks whose parts are arriving separately
  std::deque<std::size_t> arrival_order_;
  std::vector<R> current_;
  std::size_t position_ = 0;
  std::coroutine_handle<> waiter_;
};

}  // namespace forkpool::detail
