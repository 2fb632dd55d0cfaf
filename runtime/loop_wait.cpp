#include <forkpool/runtime/private/loop_wait.hpp>

#include <array>
#include <atomic>
#include <cstddef>
#include <mutex>
#include <stdexcept>

namespace forkpool::detail {
namespace {

// Registered under the mutex, read without it: a hook is stored before the count that shows it
// (release), and never changes after.
std::array<std::atomic<LoopWaitHook>, 4> hooks{};
std::atomic<std::size_t> hook_count{0};
std::mutex registering;

}  // namespace

void at_every_loop_wait(LoopWaitHook hook) {
  std::lock_guard lock(registering);
  std::size_t count = hook_count.load(std::memory_order_relaxed);
  for (std::size_t i = 0; i < count; ++i)
    if (hooks[i].load(std::memory_order_relaxed) == hook) return;
  if (count == hooks.size()) throw std::length_error("forkpool: more loop-wait hooks than a loop runs");
  hooks[count].store(hook, std::memory_order_relaxed);
  hook_count.store(count + 1, std::memory_order_release);
}

void run_loop_wait_hooks() noexcept {
  std::size_t count = hook_count.load(std::memory_order_acquire);
  for (std::size_t i = 0; i < count; ++i) hooks[i].load(std::memory_order_relaxed)();
}

}  // namespace forkpool::detail
