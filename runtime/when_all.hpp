#pragma once
// when_all: runs tasks together and completes when all have ended. If any failed, the first
// exception (in completion order) is rethrown, but only after every task has ended. A helper
// that only accompanies the others (show_progress) ends when they have ended or one failed.

#include <coroutine>
#include <exception>
#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include <forkpool/runtime/task.hpp>

namespace forkpool {
namespace detail {

// For each child, the rest are its company: their work is over once one of them failed or all
// but the asking child have ended.
struct WhenAllState final : Company {
  std::size_t remaining;
  std::coroutine_handle<> parent;
  std::exception_ptr first_error;
  bool work_over() const noexcept override { return first_error || remaining <= 1; }
};

// Runs one task, stores its value, then reports to the shared state (the last one resumes the parent).
class WhenAllChild {
 public:
  struct promise_type {
    WhenAllState* state = nullptr;
    const Company* company = nullptr;  // what the child's task inherits: its siblings
    WhenAllChild get_return_object() noexcept {
      return WhenAllChild(std::coroutine_handle<promise_type>::from_promise(*this));
    }
    std::suspend_always initial_suspend() noexcept { return {}; }
    struct Arrive {
      bool await_ready() noexcept { return false; }
      std::coroutine_handle<> await_suspend(std::coroutine_handle<promise_type> self) noexcept {
        WhenAllState* s = self.promise().state;
        return --s->remaining == 0 ? s->parent : std::noop_coroutine();
      }
      void await_resume() noexcept {}
    };
    Arrive final_suspend() noexcept { return {}; }
    void return_void() noexcept {}
    void unhandled_exception() noexcept { std::terminate(); }  // run_child catches everything
  };

  explicit WhenAllChild(std::coroutine_handle<promise_type> h) noexcept : handle_(h) {}
  WhenAllChild(WhenAllChild&& other) noexcept : handle_(std::exchange(other.handle_, {})) {}
  WhenAllChild(const WhenAllChild&) = delete;
  ~WhenAllChild() {
    if (handle_) handle_.destroy();
  }
  void start(WhenAllState& state) {
    handle_.promise().state = &state;
    handle_.promise().company = &state;
    handle_.resume();
  }

 private:
  std::coroutine_handle<promise_type> handle_;
};

template <class T>
WhenAllChild run_child(Task<T> task, std::optional<NonVoid<T>>& slot, WhenAllState& state) {
  try {
    if constexpr (std::is_void_v<T>) {
      co_await std::move(task);
      slot.emplace();
    } else {
      slot.emplace(co_await std::move(task));
    }
  } catch (...) {
    if (!state.first_error) state.first_error = std::current_exception();
  }
}

// Starts every child, then suspends the parent until the last one has arrived.
struct WhenAllAwaiter {
  std::vector<WhenAllChild>& children;
  WhenAllState& state;
  bool await_ready() noexcept { return children.empty(); }
  bool await_suspend(std::coroutine_handle<> parent) {
    state.parent = parent;
    state.remaining = children.size() + 1;  // +1: no child may resume us while we start the rest
    for (auto& child : children) child.start(state);
    return --state.remaining != 0;
  }
  void await_resume() noexcept {}
};

}  // namespace detail

template <class... Ts>
Task<std::tuple<detail::NonVoid<Ts>...>> when_all(Task<Ts>... tasks) {
  detail::WhenAllState state{};
  std::tuple<std::optional<detail::NonVoid<Ts>>...> slots;
  std::vector<detail::WhenAllChild> children;
  children.reserve(sizeof...(Ts));
  [&]<std::size_t... I>(std::index_sequence<I...>) {
    (children.push_back(detail::run_child(std::move(tasks), std::get<I>(slots), state)), ...);
  }
  (std::index_sequence_for<Ts...>{});
  co_await detail::WhenAllAwaiter{children, state};
  if (state.first_error) std::rethrow_exception(state.first_error);
  co_return std::apply([](auto&... slot) { return std::tuple<detail::NonVoid<Ts>...>(std::move(*slot)...); }, slots);
}

template <class T>
Task<std::vector<detail::NonVoid<T>>> when_all(std::vector<Task<T>> tasks) {
  detail::WhenAllState state{};
  std::vector<std::optional<detail::NonVoid<T>>> slots(tasks.size());
  std::vector<detail::WhenAllChild> children;
  children.reserve(tasks.size());
  for (std::size_t i = 0; i < tasks.size(); ++i)
    children.push_back(detail::run_child(std::move(tasks[i]), slots[i], state));
  co_await detail::WhenAllAwaiter{children, state};
  if (state.first_error) std::rethrow_exception(state.first_error);
  std::vector<detail::NonVoid<T>> values;
  values.reserve(slots.size());
  for (auto& slot : slots) values.push_back(std::move(*slot));
  co_return values;
}

}  // namespace forkpool
