#include <forkpool/runtime/internal/blocking_wait.hpp>

#include <stdexcept>
#include <string>

#include <forkpool/runtime/internal/io.hpp>
#include <forkpool/runtime/private/loop_internals.hpp>

namespace forkpool::detail {

bool drive_loop_until(const std::function<bool()>& ready, std::optional<std::chrono::nanoseconds> timeout,
                      const char* who) {
  if (ready()) return true;
  Loop& loop = Loop::current();
  LoopInternals::DriveGuard guard(loop, who);
  if (!timeout) {
    LoopInternals::drive_until(loop, ready);
    return true;
  }
  // A timer on the loop wakes the wait when the timeout passes.
  bool timer_done = false;
  Operation timer;
  timer.kind = OpKind::timeout;
  timer.context = &timer_done;
  timer.on_complete = [](Operation* op, int) { *static_cast<bool*>(op->context) = true; };
  timer.deadline = to_kernel_time(deadline_after(*timeout));
  LoopInternals::start(loop, &timer);
  LoopInternals::drive_until(loop, [&] { return timer_done || ready(); });
  if (!timer_done) {
    LoopInternals::cancel(loop, &timer);
    LoopInternals::drive_until(loop, [&] { return timer_done; });  // the timer lives on this stack
  }
  return ready();
}

bool drive_owners_loop_until(const std::function<bool()>& ready, std::optional<std::chrono::nanoseconds> timeout,
                             const char* who) {
  if (!ready() && !thread_has_loop()) refuse_wait_without_loop(who);
  return drive_loop_until(ready, timeout, who);
}

bool thread_has_loop() noexcept { return LoopInternals::existing() != nullptr; }

void refuse_wait_without_loop(const char* who) {
  throw std::logic_error(std::string(who) +
                         " called on a thread that has no forkpool loop: a pool's results arrive on the loop of the "
                         "thread that made the pool, never here; wait on that thread, or hand the wait to it with "
                         "Loop::post");
}

void run_ready_work_if_idle() {
  Loop* loop = LoopInternals::existing();
  if (!loop || LoopInternals::driving(*loop)) return;
  loop->run_ready();
}

}  // namespace forkpool::detail
