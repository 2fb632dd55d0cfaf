#include <forkpool/sync/private/waits.hpp>

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
#include <forkpool/sync/private/shared_page.hpp>

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

std::uint32_t load_word(const void* word) noexcept {
  return __atomic_load_n(static_cast<const std::uint32_t*>(word), __ATOMIC_ACQUIRE);
}

}  // namespace

bool wait_drives_loop() noexcept {
  Loop* loop = LoopInternals::existing();
  return loop && !LoopInternals::driving(*loop) && LoopInternals::outstanding(*loop) > 0;
}

Task<void> word_changed(const void* word, std::uint32_t expected, Clock::time_point deadline, const char* who) {
  if (loop_waits_on_futexes()) {
    int rc = co_await wait_futex(word, expected, IoOptions{.deadline = deadline});
    if (rc < 0 && rc != -EAGAIN && rc != -ETIMEDOUT && rc != -EINTR)
      throw std::system_error(-rc, std::generic_category(), who);
    co_return;
  }
  // No futex on this loop: look at the word between the loop's turns, more rarely as it stays.
  for (auto pause = kFirstLook; load_word(word) == expected && Clock::now() < deadline;
       pause = std::min<std::chrono::microseconds>(pause * 2, kLongestLook))
    co_await sleep_for(std::min<std::chrono::nanoseconds>(pause, deadline - Clock::now()));
}

void wait_for_word(const void* word, std::uint32_t expected, std::chrono::nanoseconds slice, const char* who) {
  if (slice <= std::chrono::nanoseconds::zero()) return;  // a wait that may not wait runs nothing
  if (wait_drives_loop() && load_word(word) == expected)
    return drive_until_done(word_changed(word, expected, deadline_after(slice), who), who);
  futex_wait_for(word, expected, slice);
}

bool wait_for_fd(int fd, short events, Deadline deadline, const char* who) {
  if (wait_drives_loop()) {
    pollfd now{fd, events, 0};
    if (poll(&now, 1, 0) > 0) return true;                    // ready already: no turn of the loop needed
    if (deadline && *deadline <= Clock::now()) return false;  // get_nowait: runs nothing
    // The wait is on the loop; the deadline is the wait's own.
    return drive_until_done(ready_on_loop(fd, events, deadline, who), who);
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
