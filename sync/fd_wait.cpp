#include <forkpool/sync/private/fd_wait.hpp>

#include <poll.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <system_error>

#include <forkpool/runtime/internal/blocking_wait.hpp>
#include <forkpool/runtime/internal/io.hpp>
#include <forkpool/runtime/loop.hpp>
#include <forkpool/runtime/private/errno.hpp>
#include <forkpool/runtime/private/loop_internals.hpp>

namespace forkpool::detail {

int poll_timeout(Deadline deadline) {
  if (!deadline) return -1;
  // Rounded up: a short wait is not a busy one.
  auto left = std::chrono::ceil<std::chrono::milliseconds>(*deadline - std::chrono::steady_clock::now()).count();
  return static_cast<int>(std::clamp<long long>(left, 0, INT_MAX));
}

namespace {

Task<bool> ready_on_loop(int fd, short events, Deadline deadline, const char* who) {
  IoOptions options{.deadline = deadline};
  // Two statements, not a conditional inside co_await: g++ 12 destroys such a temporary early.
  int rc;
  if ((events & POLLOUT) != 0)
    rc = co_await wait_writable(fd, options);
  else
    rc = co_await wait_readable(fd, options);
  if (rc == -ETIMEDOUT) co_return false;
  if (rc < 0) throw std::system_error(-rc, std::generic_category(), who);
  co_return true;
}

}  // namespace

bool wait_for_fd(int fd, short events, Deadline deadline, const char* who) {
  if (Loop* loop = LoopInternals::existing();
      loop && !LoopInternals::driving(*loop) && LoopInternals::outstanding(*loop) > 0) {
    pollfd now{fd, events, 0};
    if (poll(&now, 1, 0) > 0) return true;                    // ready already: no turn of the loop needed
    if (deadline && *deadline <= Clock::now()) return false;  // get_nowait: runs nothing
    Task<bool> waiting = ready_on_loop(fd, events, deadline, who);
    waiting.handle().resume();  // its wait is on the loop now; the deadline is the wait's own
    drive_loop_until([&] { return waiting.handle().done(); }, std::nullopt, who);
    return waiting.handle().promise().take();
  }
  for (;;) {
    pollfd p{fd, events, 0};
    int ready = poll(&p, 1, poll_timeout(deadline));
    if (ready > 0) return true;
    if (ready == 0) return false;
    if (errno != EINTR) throw_last_errno(who);
  }
}

}  // namespace forkpool::detail
