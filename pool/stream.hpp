#pragma once
// Stream<R>: results that arrive one by one (Pool::imap, imap_unordered). co_await next() gives
// the next result, or an empty optional at the end. The input is read lazily, with a bounded
// number of chunks in flight, so an endless input works and memory stays flat.
//
// Plain code iterates it with range-for (begin()/end() below). A Stream is used on the thread of
// the pool that made it (next() elsewhere is std::logic_error: taking a result submits the next
// chunks to the pool); next()'s awaiter resumes inside the loop's turn that received the result
// it returns.

#include <coroutine>
#include <cstddef>
#include <exception>
#include <iterator>
#include <memory>
#include <optional>
#include <string>

#include <forkpool/pool/internal/stream_state.hpp>
#include <forkpool/runtime/internal/progress_line.hpp>
#include <forkpool/runtime/internal/shared_handle.hpp>
#include <forkpool/runtime/loop.hpp>
#include <forkpool/runtime/task.hpp>

namespace forkpool {

template <class R>
class StreamNext;

template <class R>
class Stream {
 public:
  explicit Stream(std::shared_ptr<detail::StreamState<R>> state) : state_(std::move(state)) {}

  // The next result (in input order for imap, as finished for imap_unordered); empty at the
  // end. A task that threw rethrows here, at its place; the stream goes on after it.
  // `co_await s.next()` in a coroutine, `run(s.next())` in plain code. Coroutines that share
  // the stream (when_all of two consumers) are answered in the order they asked.
  StreamNext<R> next() { return StreamNext<R>(state_.shared()); }

  // Items finished so far, of the total (known once the input has been read).
  Progress progress() const { return state_->progress(); }
  // Every result has been handed out by next().
  bool finished() const { return state_->finished(); }

  // Blocking range-for, for plain code (not inside a coroutine on this loop: run() refuses):
  //   for (Tensor& batch : pool.imap(make_batch, indices)) train(batch);
  // Each step runs the loop until the next result; a task that threw rethrows at its place.
  class iterator {
   public:
    using iterator_category = std::input_iterator_tag;
    using value_type = R;
    using difference_type = std::ptrdiff_t;
    iterator() = default;
    explicit iterator(Stream* stream) : stream_(stream) { ++*this; }
    R& operator*() const { return *current_; }
    R* operator->() const { return &*current_; }
    iterator& operator++() {
      current_.reset();
      current_ = run(stream_->next());
      return *this;
    }
    void operator++(int) { ++*this; }
    bool operator==(std::default_sentinel_t) const noexcept { return !current_; }

   private:
    Stream* stream_ = nullptr;
    mutable std::optional<R> current_;
  };
  iterator begin() { return iterator(this); }
  std::default_sentinel_t end() const noexcept { return {}; }

 private:
  detail::SharedHandle<detail::StreamState<R>, "Stream"> state_;
};

// What Stream::next() returns: co_await it once, where it is made (a result that is already
// there costs no suspension and no allocation), or give it to run() in plain code.
template <class R>
class [[nodiscard]] StreamNext {
 public:
  explicit StreamNext(std::shared_ptr<detail::StreamState<R>> state) : state_(std::move(state)) {}
  StreamNext(StreamNext&&) noexcept = default;  // before it is awaited
  StreamNext& operator=(StreamNext&&) = delete;
  ~StreamNext() {
    if (state_) state_->stop_waiting(&waiter_);
  }

  bool await_ready() {
    state_->check_consumer("Stream::next");
    // Behind the next()s already waiting (consumers sharing the stream): a consumer that was
    // answered took the results that arrived while it ran, and the others got none.
    if (state_->has_waiters()) return false;
    return state_->try_next(waiter_.result);
  }
  void await_suspend(std::coroutine_handle<> awaiter) noexcept {
    waiter_.handle = awaiter;
    state_->wait(&waiter_);
  }
  std::optional<R> await_resume() {
    if (waiter_.error) std::rethrow_exception(waiter_.error);
    return std::move(waiter_.result);
  }

  // As a Task, for code that takes one (when_all).
  operator Task<std::optional<R>>() && { return awaited(std::move(*this)); }

 private:
  static Task<std::optional<R>> awaited(StreamNext next) { co_return co_await next; }

  std::shared_ptr<detail::StreamState<R>> state_;
  typename detail::StreamState<R>::Waiter waiter_;
};

// Runs the loop until the stream's next result (see run(Task)). On another thread than the
// pool's, std::logic_error (Stream::next).
template <class R>
std::optional<R> run(StreamNext<R> next) {
  return run(Task<std::optional<R>>(std::move(next)));
}

// As show_progress(AsyncResult): draws the stream's progress on stderr until every result has
// been handed out. Run it beside the loop that consumes the stream, with when_all: it also ends
// when that consumer ends early (it threw, or broke out). The stream must outlive it.
template <class R>
Task<void> show_progress(const Stream<R>& stream, std::string label = {}) {
  detail::ProgressLine line(std::move(label));
  // NOLINTNEXTLINE(bugprone-use-after-move): clang-tidy 14 takes a co_await for a use of `label`
  const detail::Company* company = co_await detail::current_company{};
  while (!stream.finished() && !(company && company->work_over())) {
    line.draw(stream.progress());
    co_await sleep_for(line.interval());
  }
  line.finish(stream.progress());
}

}  // namespace forkpool
