#pragma once
// AsyncResult<R>: the result of work started at once. co_await it, or block in get().

#include <chrono>
#include <coroutine>
#include <cstddef>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <stop_token>
#include <vector>
#include <stdexcept>
#include <type_traits>
#include <variant>

#include <forkpool/runtime/error.hpp>
#include <forkpool/runtime/internal/blocking_wait.hpp>
#include <forkpool/runtime/internal/one_shot.hpp>
#include <forkpool/runtime/internal/io.hpp>
#include <forkpool/runtime/internal/shared_handle.hpp>
#include <forkpool/runtime/loop.hpp>
#include <forkpool/runtime/task.hpp>

namespace forkpool {

// How far a map or stream has come: items finished, of `total` (empty while a lazy input is
// still being read).
struct Progress {
  std::size_t done = 0;
  std::optional<std::size_t> total;
};

namespace detail {

// Reports a callback's exception on stderr, naming whose (`whose`: "a done-callback", "a function
// given to Loop::post"): it must not break whoever ran it.
void report_callback_failure(const char* whose) noexcept;

// Who can stop the work behind a result (a pool). Called on the thread that cancels.
class Canceller {
 public:
  // Throws std::logic_error when the calling thread may not cancel (nor wait: check_waiter).
  virtual void check_cancel() const = 0;
  // Stops `work` (what set_canceller named), whose result has already failed.
  virtual void cancel_work(const void* work) = 0;

 protected:
  ~Canceller() = default;
};

// A result not yet ready is completed on its pool's thread, by that loop alone: a wait on
// another thread (or in a forked child) would last for ever, or resume its coroutine on the
// wrong thread. std::logic_error naming `who` when `owner` (the result's pool) refuses the
// calling thread.
void check_waiter(const Canceller& owner, const char* who);

template <class R>
class ResultState : public std::enable_shared_from_this<ResultState<R>> {
 public:
  using Stored = NonVoid<R>;
  using Callback = std::function<void(std::shared_ptr<ResultState>)>;

  bool ready() const noexcept { return done_.is_set(); }
  bool successful() const noexcept { return ready() && !error_; }

  // The first outcome wins; later ones are ignored.
  void set_value(Stored value) {
    if (ready()) return;
    value_.emplace(std::move(value));
    finish();
  }
  void set_error(std::exception_ptr error) {
    if (ready()) return;
    error_ = std::move(error);
    finish();
  }

  // Items done of the total (a map's sink counts them; otherwise 0 or 1 of 1).
  void set_progress(std::size_t done, std::size_t total) { progress_ = Progress{done, total}; }
  Progress progress() const {
    if (progress_.total) return progress_;
    return {ready() ? 1u : 0u, 1};
  }

  // Who can stop the work: `owner` (the pool that runs it) for its `work`. cancel() first asks
  // owner.check_cancel(), which throws (std::logic_error) when the caller may not cancel, and
  // then, once the result has failed with Cancelled, owner.cancel_work(work). Held weakly: a pool
  // that is gone cancels nothing. (No std::function: every apply_async sets one.)
  void set_canceller(std::weak_ptr<Canceller> owner, const void* work) {
    canceller_ = std::move(owner);
    cancel_work_ = work;
  }
  // One ordered operation: the check comes first, so a call that throws changes nothing (the
  // work runs on, no awaiter is resumed); then the result fails (the pool then sees it is not
  // wanted), then the work is stopped.
  void cancel() {
    std::shared_ptr<Canceller> owner = canceller_.lock();
    if (owner) owner->check_cancel();
    if (ready()) return;
    canceller_.reset();
    set_error(std::make_exception_ptr(Cancelled()));
    if (owner) owner->cancel_work(cancel_work_);
  }

  // Unless the outcome is set: std::logic_error naming `who` when the calling thread is not its
  // pool's (check_waiter). Before anything waits for it.
  void check_waiter(const char* who) const {
    if (ready()) return;
    if (std::shared_ptr<Canceller> owner = canceller_.lock()) detail::check_waiter(*owner, who);
  }

  // Runs `callback` once the outcome is set (now, if it is).
  void on_done(Callback callback) {
    if (ready()) {
      run(callback);
      return;
    }
    callbacks_.push_back(std::move(callback));
  }

  // Stops `timer` once the outcome is set (async_wait's wake-up). Timers whose wait is over are
  // dropped as new ones come, so a loop of short waits does not pile them up.
  void stop_on_done(const std::shared_ptr<std::stop_source>& timer) {
    std::erase_if(timers_, [](const auto& weak) { return weak.expired(); });
    timers_.push_back(timer);
  }

  detail::OneShot& done() noexcept { return done_; }

  R copy() const {
    if (error_) std::rethrow_exception(error_);
    if constexpr (!std::is_void_v<R>) return *value_;
  }
  R take() {
    if (error_) std::rethrow_exception(error_);
    if constexpr (!std::is_void_v<R>) return std::move(*value_);
  }

 private:
  void finish() {
    canceller_.reset();
    auto callbacks = std::exchange(callbacks_, {});
    auto timers = std::exchange(timers_, {});
    auto self = this->shared_from_this();  // a resumed waiter may drop its result
    done_.set();
    for (auto& weak : timers)
      if (auto timer = weak.lock()) timer->request_stop();
    for (auto& callback : callbacks) run(callback);
  }
  void run(const Callback& callback) {
    try {
      callback(this->shared_from_this());
    } catch (...) {
      report_callback_failure("a done-callback");
    }
  }

  std::optional<Stored> value_;
  std::exception_ptr error_;
  detail::OneShot done_;
  std::weak_ptr<Canceller> canceller_;
  const void* cancel_work_ = nullptr;
  std::vector<Callback> callbacks_;
  std::vector<std::weak_ptr<std::stop_source>> timers_;
  Progress progress_;
};

}  // namespace detail

template <class R>
class AsyncResult {
 public:
  explicit AsyncResult(std::shared_ptr<detail::ResultState<R>> state) : state_(std::move(state)) {}

  // Whether the work has ended. Outside a coroutine, each call first runs what the loop has
  // ready, without waiting (results that arrived, the next jobs out), so a program that only
  // polls ready() sees its work go on and finish; inside a coroutine on the loop it only looks.
  bool ready() const {
    if (!state().ready()) detail::run_ready_work_if_idle();
    return state().ready();
  }

  // Items done of the total: a map's elements, otherwise 0 or 1 of 1.
  Progress progress() const { return state().progress(); }

  // Stops the work: a queued task is dropped; a running one is stopped by killing its worker
  // (which is replaced; the other work it had runs elsewhere, at no cost). The result fails with
  // Cancelled at once. No effect once ready. On the thread of the pool that made the result.
  void cancel() { state().cancel(); }

  // Runs `callback(*this)` on the loop's thread once the result is ready (now, if it is), as
  // concurrent.futures' add_done_callback. A callback that throws is reported on stderr and
  // breaks nothing. Until the result is ready, on the pool's thread only: elsewhere
  // std::logic_error (hand the call to that thread with Loop::post).
  void add_done_callback(std::function<void(AsyncResult&)> callback) {
    state().check_waiter("AsyncResult::add_done_callback");
    state().on_done([callback = std::move(callback)](std::shared_ptr<detail::ResultState<R>> state) {
      AsyncResult result(std::move(state));
      callback(result);
    });
  }

  // Inside a coroutine: true once the result is ready, false if `timeout` passes first. Resumes
  // inline, inside the loop's turn that completed the result or fired the timer. Until the
  // result is ready, on the pool's thread only (std::logic_error elsewhere), as co_await.
  Task<bool> async_wait(std::chrono::nanoseconds timeout) const {
    if (ready()) co_return true;
    state().check_waiter("AsyncResult::async_wait");
    auto stop = std::make_shared<std::stop_source>();
    state().stop_on_done(stop);
    std::stop_token token = stop->get_token();
    co_await detail::wait_until(detail::deadline_after(timeout), token);
    co_return ready();
  }

  // Whether the work succeeded; std::logic_error while it is not ready (as Python's ValueError).
  bool successful() const {
    if (!ready()) throw std::logic_error("forkpool: AsyncResult::successful() called before the result is ready");
    return state().successful();
  }

  // Blocks (driving the loop) until ready, then returns the value or rethrows the task's error.
  // Throws std::logic_error from inside a coroutine on the same loop: co_await instead. A copy,
  // since get() may be called again; on an rvalue (`pool.map_async(...).get()`) the value is
  // moved out instead.
  R get() const& {
    wait();
    return state().copy();
  }
  R get() && {
    wait();
    return state().take();
  }
  // As get(), but throws TimeoutError when `timeout` passes first.
  R get(std::chrono::nanoseconds timeout) const& {
    if (!wait(timeout)) throw TimeoutError("forkpool: AsyncResult::get timed out");
    return state().copy();
  }
  R get(std::chrono::nanoseconds timeout) && {
    if (!wait(timeout)) throw TimeoutError("forkpool: AsyncResult::get timed out");
    return state().take();
  }
  // On another thread than the pool's (or in a forked child), only a ready result can be waited
  // for: std::logic_error rather than a wait for ever, since only the pool's loop completes it.
  void wait() const { (void)wait_for(std::nullopt); }
  // True if the result became ready within `timeout`.
  bool wait(std::chrono::nanoseconds timeout) const { return wait_for(timeout); }

  // Resumes inside the loop's turn that completed the result. Until the result is ready, on the
  // pool's thread only: elsewhere the co_await throws std::logic_error (it would resume the
  // coroutine on the pool's thread, or never).
  // (Checked before the state is taken: a refused co_await leaves the handle as it was.)
  auto operator co_await() const& {
    state().check_waiter("co_await AsyncResult");
    return Awaiter<false>{state_.shared()};
  }
  auto operator co_await() && {
    state().check_waiter("co_await AsyncResult");
    return Awaiter<true>{state_.take()};
  }

 private:
  bool wait_for(std::optional<std::chrono::nanoseconds> timeout) const {
    detail::ResultState<R>& waited = state();
    waited.check_waiter("AsyncResult::wait");
    return detail::drive_owners_loop_until([&waited] { return waited.ready(); }, timeout,
                                           "forkpool::AsyncResult::wait");
  }
  template <bool Take>
  struct Awaiter {
    std::shared_ptr<detail::ResultState<R>> state;
    bool await_ready() const noexcept { return state->ready(); }
    void await_suspend(std::coroutine_handle<> h) { state->done().operator co_await().await_suspend(h); }
    R await_resume() {
      if constexpr (Take) {
        return state->take();
      } else {
        return state->copy();
      }
    }
  };

  detail::ResultState<R>& state() const { return *state_; }

  detail::SharedHandle<detail::ResultState<R>, "AsyncResult"> state_;
};

}  // namespace forkpool
