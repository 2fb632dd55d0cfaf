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
#include <stdexcept>
#include <utility>
#include <vector>

#include <forkpool/pool/internal/job.hpp>
#include <forkpool/worker/internal/protocol.hpp>
#include <forkpool/runtime/async_result.hpp>
#include <forkpool/runtime/task.hpp>

namespace forkpool::detail {

template <class R>
class StreamState : public JobSink, public std::enable_shared_from_this<StreamState<R>> {
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
  // std::logic_error naming `who` when the calling thread may not take results (a pool's stream
  // belongs to the pool's thread: taking one submits the next chunks to the pool).
  virtual void check_consumer(const char* /*who*/) const {}

  // One next() that waits: the coroutine to resume, and what it is answered with.
  struct Waiter {
    std::coroutine_handle<> handle;
    std::optional<R> result;
    std::exception_ptr error;
    Waiter* next = nullptr;  // the one waiting after it
  };

  // Answers a next() at once if it can: true with `result` set (a value; empty at the end), false
  // when it must wait for a chunk. A task's error (or the input's) is thrown, at its place.
  bool try_next(std::optional<R>& result) {
    for (;;) {
      if (position_ < current_.size()) {
        result.emplace(std::move(current_[position_++]));
        return true;
      }
      fill_window();
      if (std::optional<Outcome> outcome = take_ready()) {
        --in_flight_;
        fill_window();  // its place in the window is free again (bound_unconsumed)
        keep_spare(std::move(current_));
        position_ = 0;
        if (outcome->error) std::rethrow_exception(outcome->error);
        current_ = std::move(outcome->values);
        continue;  // its values, or (none: a shard that had ended) the next chunk's
      }
      if (in_flight_ == 0 && exhausted_) {
        if (input_error_) std::rethrow_exception(std::exchange(input_error_, {}));
        result.reset();
        return true;
      }
      return false;
    }
  }
  // Whether next()s are waiting: a new one goes behind them (answered in the order asked).
  bool has_waiters() const noexcept { return first_waiter_ != nullptr; }
  // `waiter` is answered and resumed from the arrival that lets try_next() answer it. Several
  // next()s may wait at once (consumers sharing the stream): they are answered in turn.
  void wait(Waiter* waiter) noexcept {
    waiter->next = nullptr;
    (last_waiter_ ? last_waiter_->next : first_waiter_) = waiter;
    last_waiter_ = waiter;
  }
  // `waiter` is gone (its coroutine was destroyed while it waited).
  void stop_waiting(Waiter* waiter) noexcept {
    for (Waiter *before = nullptr, *at = first_waiter_; at; before = at, at = at->next) {
      if (at != waiter) continue;
      (before ? before->next : first_waiter_) = at->next;
      if (last_waiter_ == at) last_waiter_ = before;
      return;
    }
  }

  void chunk_done(std::size_t chunk, const ElementRange& range, Reader& results) override {
    if (!awaited(chunk)) return;  // failed already
    std::size_t expected = slot_of(chunk)->size;
    if (range.size() == expected) {
      Outcome outcome;
      outcome.values = take_spare();
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
    if (slots_.empty()) first_slot_ = index;
    while (first_slot_ + slots_.size() <= index) slots_.emplace_back().taken = true;  // none skipped, as a rule
    Slot& slot = slots_[index - first_slot_];
    slot = Slot{};
    slot.size = size;
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

  // One chunk from its submission until it is handed out.
  struct Slot {
    std::size_t size = 0;  // its elements
    bool arrived = false;
    bool taken = false;  // handed out (unordered: maybe before chunks submitted earlier)
    Outcome outcome;
  };

  struct Parts {
    std::vector<std::optional<R>> values;
    std::uint64_t filled = 0;
  };

  // Submitted and not handed out: its slot, else null.
  Slot* slot_of(std::size_t chunk) {
    if (chunk < first_slot_ || chunk - first_slot_ >= slots_.size()) return nullptr;
    Slot& slot = slots_[chunk - first_slot_];
    return slot.taken ? nullptr : &slot;
  }
  // Submitted, and neither arrived nor handed out yet.
  bool awaited(std::size_t chunk) {
    Slot* slot = slot_of(chunk);
    return slot && !slot->arrived;
  }
  bool arrived(std::size_t chunk) {
    Slot* slot = slot_of(chunk);
    return slot && slot->arrived;
  }

  // Result vectors are reused: a stream of chunks of one costs no allocation per result.
  static constexpr std::size_t kMaxSpares = 64;
  static constexpr std::size_t kMaxSpareBytes = 4096;
  std::vector<R> take_spare() {
    if (spares_.empty()) return {};
    std::vector<R> values = std::move(spares_.back());
    spares_.pop_back();
    return values;
  }
  void keep_spare(std::vector<R>&& values) {
    values.clear();
    if (values.capacity() == 0 || values.capacity() * sizeof(R) > kMaxSpareBytes || spares_.size() >= kMaxSpares)
      return;
    spares_.push_back(std::move(values));
  }

  void fill_window() {
    const std::size_t limit = window();  // read once: if it grows meanwhile, the next call fills it
    auto has_room = [&] { return !exhausted_ && occupied() < limit && in_flight_ - running_ < kReorderLimit; };
    if (!has_room()) return;  // most calls while a stream runs: nothing to hold or release
    hold_submits();
    while (has_room()) {
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
    if (Slot* recorded = slot_of(next_chunk_)) {
      submitted_elements_ -= recorded->size;
      slots_.pop_back();  // the last recorded: chunks are recorded in order
    }
  }

  std::optional<Outcome> take_ready() {
    std::size_t chunk;
    if (ordered_) {
      if (!arrived(next_to_yield_)) return std::nullopt;
      chunk = next_to_yield_++;
      --ordered_takeable_;
    } else {
      if (arrival_order_.empty()) return std::nullopt;
      chunk = arrival_order_.front();
      arrival_order_.pop_front();
    }
    Slot& slot = *slot_of(chunk);
    Outcome outcome = std::move(slot.outcome);
    slot.taken = true;
    while (!slots_.empty() && slots_.front().taken) {
      slots_.pop_front();
      ++first_slot_;
    }
    return outcome;
  }

  void arrive(std::size_t chunk, Outcome outcome) {
    Slot* slot = slot_of(chunk);
    if (!slot) throw std::logic_error("forkpool: a stream's chunk arrived that was never submitted");
    --running_;
    done_elements_ += slot->size;
    slot->arrived = true;
    slot->outcome = std::move(outcome);
    if (ordered_) {
      while (arrived(next_to_yield_ + ordered_takeable_)) ++ordered_takeable_;  // a gap may have closed
    } else {
      arrival_order_.push_back(chunk);
    }
    answer_waiters();
  }

  // A chunk arrived: the waiting next()s, oldest first, are answered and resumed while there is
  // an answer (an arrival ahead of a gap, or a shard that had ended, leaves them waiting).
  void answer_waiters() {
    if (!first_waiter_ || answering_) return;
    if (first_waiter_->next) return answer_several();
    // One waits (the common case). Out of the list while try_next() runs: a chunk that arrives
    // inside it (one that failed as it was submitted) is taken there.
    Waiter* waiter = std::exchange(first_waiter_, nullptr);
    last_waiter_ = nullptr;
    if (!answer(*waiter)) {
      first_waiter_ = last_waiter_ = waiter;
      return;
    }
    waiter->handle.resume();  // the last thing: the consumer may let go of the stream
  }

  // Consumers sharing the stream: each resumed one may wait again (at the back) or drop its
  // Stream, and what arrives meanwhile is found by the loop's next try_next(), not re-entered.
  [[gnu::noinline]] void answer_several() {
    std::shared_ptr<StreamState> keep = this->shared_from_this();
    answering_ = true;
    while (Waiter* waiter = first_waiter_) {
      if (!answer(*waiter)) break;
      first_waiter_ = waiter->next;
      if (!first_waiter_) last_waiter_ = nullptr;
      waiter->handle.resume();
    }
    answering_ = false;
  }

  // Gives `waiter` its answer (a result, the end, or the error to rethrow) if there is one now.
  bool answer(Waiter& waiter) {
    try {
      return try_next(waiter.result);
    } catch (...) {
      waiter.error = std::current_exception();
      return true;
    }
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
  std::deque<Slot> slots_;          // chunks [first_slot_, first_slot_ + size): submitted, some handed out
  std::size_t first_slot_ = 0;      // the oldest chunk not yet handed out
  std::vector<std::vector<R>> spares_;
  std::map<std::size_t, Parts> parts_;  // chunks whose parts are arriving separately
  std::deque<std::size_t> arrival_order_;
  std::vector<R> current_;
  std::size_t position_ = 0;
  Waiter* first_waiter_ = nullptr;  // next()s waiting for a chunk, oldest first (by Waiter::next)
  Waiter* last_waiter_ = nullptr;
  bool answering_ = false;  // inside answer_several()
};

}  // namespace forkpool::detail
