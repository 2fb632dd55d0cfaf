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
    // A resumed waiter may destroy this Event: resume from a local copy.
    auto waiters = std::exchange(waiters_, {});
    for (auto waiter : waiters) waiter.resume();
  }

  auto operator co_await() noexcept {
    struct Awaiter {
      OneShot& event;
      bool await_ready() const noexcept { return event.set_; }
      void await_suspend(std::coroutine_handle<> waiter) { event.waiters_.push_back(waiter); }
      void await_resume() const noexcept {}
    };
    return Awaiter{*this};
  }

 private:
  bool set_ = false;
  std::vector<std::coroutine_handle<>> waiters_;
};

}  // namespace forkpool::detail
