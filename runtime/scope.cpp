#include <forkpool/runtime/scope.hpp>

#include <coroutine>
#include <cstdio>
#include <exception>
#include <utility>
#include <vector>

#include <forkpool/runtime/private/describe_exception.hpp>

namespace forkpool {

struct Scope::State {
  std::size_t active = 0;
  std::exception_ptr first_error;
  std::vector<std::coroutine_handle<>> joiners;

  ~State() {
    if (!first_error) return;
    try {
      std::rethrow_exception(first_error);
    } catch (...) {
      auto [type, message] = detail::describe_current_exception();
      std::fprintf(stderr, "forkpool: a task of a Scope nobody joined threw %s: %s\n", type.c_str(), message.c_str());
    }
  }

  void task_ended() {
    if (--active > 0) return;
    // A resumed joiner may start new tasks or destroy the Scope: resume from a local copy.
    for (auto joiner : std::exchange(joiners, {})) joiner.resume();
  }
};

namespace {

// A coroutine that starts at once and frees itself at its end.
struct Runner {
  struct promise_type {
    Runner get_return_object() noexcept { return {}; }
    std::suspend_never initial_suspend() noexcept { return {}; }
    std::suspend_never final_suspend() noexcept { return {}; }
    void return_void() noexcept {}
    void unhandled_exception() noexcept { std::terminate(); }  // run_in() catches everything
  };
};

Runner run_in(std::shared_ptr<Scope::State> state, Task<void> task) {
  try {
    co_await std::move(task);
  } catch (...) {
    if (!state->first_error) state->first_error = std::current_exception();
  }
  state->task_ended();
}

}  // namespace

Scope::Scope() : state_(std::make_shared<State>()) {}
Scope::~Scope() = default;

void Scope::start(Task<void> task) {
  ++state_->active;
  run_in(state_, std::move(task));
}

Task<void> Scope::join() {
  std::shared_ptr<State> state = state_;
  struct Idle {
    State& state;
    bool await_ready() const noexcept { return state.active == 0; }
    void await_suspend(std::coroutine_handle<> h) { state.joiners.push_back(h); }
    void await_resume() const noexcept {}
  };
  while (state->active > 0) co_await Idle{*state};
  if (auto error = std::exchange(state->first_error, {})) std::rethrow_exception(error);
}

std::size_t Scope::active() const noexcept { return state_->active; }

}  // namespace forkpool
