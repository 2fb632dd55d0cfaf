#pragma once
// AsyncResult<R>: the result of work started at once. co_await it, or block in get().

#include <chrono>
#include <coroutine>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <stdexcept>
#include <type_traits>
#include <variant>

#include <forkpool/runtime/error.hpp>
#include <forkpool/runtime/internal/blocking_wait.hpp>
#include <forkpool/runtime/internal/event.hpp>
#include <forkpool/runtime/loop.hpp>

namespace forkpool {
namespace detail {

template <class R>
class ResultState {
 public:
  using Stored = NonVoid<R>;

  bool ready() const noexcept { return done_.is_set(); }
  bool successful() const noexcept { return ready() && !error_; }

  // The first outcome wins; later ones are ignored.
  void set_value(Stored value) {
    if (ready()) return;
    value_.emplace(std::move(value));
    done_.set();
  }
  void set_error(std::exception_ptr error) {
    if (ready()) return;
    error_ = std::move(error);
    done_.set();
  }

  Event& done() noexcept { return done_; }

  R copy() const {
    if (error_) std::rethrow_exception(error_);
    if constexpr (!std::is_void_v<R>) return *value_;
  }
  R take() {
    if (error_) std::rethrow_exception(error_);
    if constexpr (!std::is_void_v<R>) return std::move(*value_);
  }

 private:
  std::optional<Stored> value_;
  std::exception_ptr error_;
  Event done_;
};

}  // namespace detail

template <class R>
class AsyncResult {
 public:
  explicit AsyncResult(std::shared_ptr<detail::ResultState<R>> state) : state_(std::move(state)) {}

  bool ready() const noexcept { return state_->ready(); }
  // Whether the work succeeded; std::logic_error while it is not ready (as Python's ValueError).
  bool successful() const {
    if (!ready()) throw std::logic_error("forkpool: AsyncResult::successful() called before the result is ready");
    return state_->successful();
  }

  // Blocks (driving the loop) until ready, then returns the value or rethrows the task's error.
  // Throws std::logic_error from inside a coroutine on the same loop: co_await instead.
  R get() const {
    wait();
    return state_->copy();
  }
  // As get(), but throws TimeoutError when `timeout` passes first.
  R get(std::chrono::nanoseconds timeout) const {
    if (!wait(timeout)) throw TimeoutError("forkpool: AsyncResult::get timed out");
    return state_->copy();
  }
  void wait() const { detail::drive_loop_until([this] { return ready(); }, std::nullopt, "forkpool::AsyncResult::wait"); }
  // True if the result became ready within `timeout`.
  bool wait(std::chrono::nanoseconds timeout) const {
    return detail::drive_loop_until([this] { return ready(); }, timeout, "forkpool::AsyncResult::wait");
  }

  auto operator co_await() const& { return Awaiter<false>{state_}; }
  auto operator co_await() && { return Awaiter<true>{std::move(state_)}; }

 private:
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

  std::shared_ptr<detail::ResultState<R>> state_;
};

}  // namespace forkpool
