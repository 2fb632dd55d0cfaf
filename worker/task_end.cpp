#include <forkpool/worker/private/task_end.hpp>

#include <algorithm>
#include <array>
#include <cstddef>
#include <stdexcept>

namespace forkpool::detail {
namespace {

// Read on every torch::Tensor decode (a TLS descriptor, as the loop's).
thread_local bool running_a_task = false;
// Read and written on the serving thread only (in_pool_task() guards registration).
std::array<TaskEndHook, 4> hooks{};
std::size_t hook_count = 0;

}  // namespace

bool in_pool_task() noexcept { return running_a_task; }

void at_every_task_end(TaskEndHook hook) {
  if (!running_a_task) return;
  auto registered = hooks.begin() + static_cast<std::ptrdiff_t>(hook_count);
  if (std::find(hooks.begin(), registered, hook) != registered) return;
  if (hook_count == hooks.size()) throw std::length_error("forkpool: more task-end hooks than a worker holds");
  hooks[hook_count++] = hook;
}

void begin_pool_task() noexcept { running_a_task = true; }

void end_pool_task() noexcept {
  if (!running_a_task) return;
  for (std::size_t i = 0; i < hook_count; ++i) hooks[i]();
  running_a_task = false;
}

}  // namespace forkpool::detail
