#pragma once
// Task<T>: a lazy, move-only coroutine. Nothing runs until it is co_awaited (or given to run());
// its value or exception comes out of the co_await. Long chains of synchronous completions do not
// grow the stack.

#include <coroutine>
#include <exception>
#include <optional>
#include <stdexcept>
#include <type_traits>
#include <utility>
#include <variant>

#include <forkpool/runtime/internal/shared_handle.hpp>

namespace forkpool {

template <class T = void>
class Task;

namespace detail {

// A value type for T: void becomes std::monostate (a void task's slot in when_all, a void
// call's result on the wire).
template <class T>
using NonVoid = std::conditional_t<std::is_void_v<T>, std::monostate, T>;

// The work a task runs beside, as when_all's children run beside each other: a task awaited by
// another inherits its awaiter's. Helpers that only accompany work (show_progress) end once it
// says the work is over, however the work ended.
class Company {
 public:
  virtual bool work_over() const noexcept = 0;

 protected:
  ~Company() = default;
};

class PromiseBase {
 public:
  const Company* company = nullptr;

  std::suspend_always initial_suspend() noexcept { return {}; }

  // Finishing inside the awaiter's own resume() returns there (the stack unwinds); finishing
  // later, from the loop, resumes the awaiter directly.
  struct FinalAwaiter {
    bool await_ready() noexcept { return false; }
    template <class Promise>
    std::coroutine_handle<> await_suspend(std::coroutine_handle<Promise> self) noexcept {
      PromiseBase& promise = self.promise();
      if (promise.stage_ == Stage::running_inline) {
        promise.stage_ = Stage::finished_inline;
        return std::noop_coroutine();
      }
      return promise.continuation_ ? promise.continuation_ : std::noop_coroutine();
    }
    void await_resume() noexcept {}
  };
  FinalAwaiter final_suspend() noexcept { return {}; }

  void unhandled_exception() noexcept { exception_ = std::current_exception(); }

  // True the first time: a coroutine runs once (Task::handle_to_start). In stage_, not a member
  // of its own: the promise's layout is the ABI's (docs/abi.md).
  bool start_once() noexcept {
    if (stage_ != Stage::idle) return false;
    stage_ = Stage::handed_out;
    return true;
  }

  // Runs the coroutine for `awaiter`; true if the awaiter must suspend (the coroutine has not
  // finished yet and will resume it when it does). Not relying on symmetric transfer being a
  // tail call keeps a million synchronous completions from growing the stack even at -O0.
  bool start_for(std::coroutine_handle<> self, std::coroutine_handle<> awaiter) {
    continuation_ = awaiter;
    stage_ = Stage::running_inline;
    self.resume();
    if (stage_ == Stage::finished_inline) return false;
    stage_ = Stage::awaited;
    return true;
  }

 protected:
  void rethrow_if_failed() {
    if (exception_) std::rethrow_exception(exception_);
  }

 private:
  // handed_out: given to a driver (run) or an awaiter, which then starts it.
  enum class Stage : unsigned char { idle, running_inline, finished_inline, awaited, handed_out };
  std::coroutine_handle<> continuation_;
  std::exception_ptr exception_;
  Stage stage_ = Stage::idle;
};

template <class T>
class Promise : public PromiseBase {
 public:
  Task<T> get_return_object() noexcept;
  template <class U = T>
  requires std::is_convertible_v<U&&, T>
  void return_value(U&& value) { value_.emplace(std::forward<U>(value)); }
  T take() {
    rethrow_if_failed();
    return std::move(*value_);
  }

 private:
  std::optional<T> value_;
};

template <>
class Promise<void> : public PromiseBase {
 public:
  Task<void> get_return_object() noexcept;
  void return_void() noexcept {}
  void take() { rethrow_if_failed(); }
};

// co_await current_company() in a Task: the work it runs beside (nullptr: none known).
struct current_company {
  const Company* company = nullptr;
  bool await_ready() const noexcept { return false; }
  template <class P>
  bool await_suspend(std::coroutine_handle<P> self) noexcept {
    company = self.promise().company;
    return false;  // never suspends
  }
  const Company* await_resume() const noexcept { return company; }
};

}  // namespace detail

template <class T>
class [[nodiscard]] Task {
 public:
  using promise_type = detail::Promise<T>;
  using value_type = T;
  using Handle = std::coroutine_handle<promise_type>;

  Task() noexcept = default;
  explicit Task(Handle handle) noexcept : handle_(handle) {}
  Task(Task&& other) noexcept : handle_(std::exchange(other.handle_, {})) {}
  Task& operator=(Task&& other) noexcept {
    if (this != &other) {
      if (handle_) handle_.destroy();
      handle_ = std::exchange(other.handle_, {});
    }
    return *this;
  }
  Task(const Task&) = delete;
  Task& operator=(const Task&) = delete;
  ~Task() {
    if (handle_) handle_.destroy();
  }

  // Throws std::logic_error for a Task that a move emptied (or made empty), and for one awaited
  // or run before: a Task runs once (a second co_await used to return a moved-from value, or
  // resume a coroutine in the middle of its run).
  auto operator co_await() && { return Awaiter{handle_to_start()}; }
  auto operator co_await() & { return Awaiter{handle_to_start()}; }

  // For drivers (run, when_all): the coroutine, still owned by this Task.
  Handle handle() const noexcept { return handle_; }
  // For drivers that start it: handle(), checked as co_await checks it.
  Handle handle_to_start() const {
    if (!handle_) detail::throw_moved_from("Task");
    if (!handle_.promise().start_once())
      throw std::logic_error("forkpool: a Task awaited or run a second time: a Task runs once");
    return handle_;
  }

 private:
  struct Awaiter {
    Handle handle;
    bool await_ready() noexcept { return false; }  // handed out once: it has not run
    template <class AwaiterPromise>
    bool await_suspend(std::coroutine_handle<AwaiterPromise> awaiter) {
      if constexpr (requires { awaiter.promise().company; }) handle.promise().company = awaiter.promise().company;
      return handle.promise().start_for(handle, awaiter);
    }
    T await_resume() { return handle.promise().take(); }
  };

  Handle handle_;
};

namespace detail {
template <class T>
Task<T> Promise<T>::get_return_object() noexcept {
  return Task<T>(std::coroutine_handle<Promise<T>>::from_promise(*this));
}
inline Task<void> Promise<void>::get_return_object() noexcept {
  return Task<void>(std::coroutine_handle<Promise<void>>::from_promise(*this));
}
}  // namespace detail

}  // namespace forkpool
