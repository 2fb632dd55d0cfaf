#include <forkpool/sync/private/fd_wait.hpp>

#include <poll.h>

#include <algorithm>
#include <cerrno>
#include <climits>

#include <forkpool/runtime/private/errno.hpp>

namespace forkpool::detail {

int poll_timeout(Deadline deadline) {
  if (!deadline) return -1;
  // Rounded up: a short wait is not a busy one.
  auto left = std::chrono::ceil<std::chrono::milliseconds>(*deadline - std::chrono::steady_clock::now()).count();
  return static_cast<int>(std::clamp<long long>(left, 0, INT_MAX));
}

bool wait_for_fd(int fd, short events, Deadline deadline, const char* who) {
  for (;;) {
    pollfd p{fd, events, 0};
    int ready = poll(&p, 1, poll_timeout(deadline));
    if (ready > 0) return true;
    if (ready == 0) return false;
    if (errno != EINTR) throw_last_errno(who);
  }
}

}  // namespace forkpool::detail
