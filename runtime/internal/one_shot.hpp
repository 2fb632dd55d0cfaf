#pragma once
// OneShot: a one-shot flag that coroutines can wait for. set() resumes every waiter, in order.

#include <coroutine>
#include <utility>
#include <vector>

namespace forkpool::detail {

class OneShot {
 public:
  bool is_set() const noexcept { return set_; }

  void set() {
    if (set_) return;
    set_ = true;
    // A resumed waiter may destroy this OneShot: resume from local copies.
    std::coroutine_handle<> first = std::exchange(first_, {});
    auto more = std::exchange(more_, {});
    if (first) first.resume();
    for (auto waiter : more) waiter.resume();
  }

  auto operator co_await() noexcept {
    struct Awaiter {
      OneShot& event;
      bool await_ready() const noexcept { return event.set_; }
      void await_suspend(std::coroutine_handle<> waiter) { event.add(waiter); }
      void await_resume() const noexcept {}
    };
    return Awaiter{*this};
  }

 private:
  // Most flags have one waiter (an awaited result): it is kept without an allocation.
  void add(std::coroutine_handle<> waiter) {
    if (!first_)
      first_ = waiter;
    else
      more_.push_back(waiter);
  }

  bool set_ = false;
  std::coroutine_handle<> first_;
  std::vector<std::coroutine_handle<>> more_;  // in the order they came, after first_
};

}  // namespace forkpool::detail
