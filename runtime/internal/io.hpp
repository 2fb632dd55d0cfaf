#pragma once
// Awaitable kernel operations on the calling thread's loop. Each one can be stopped (a
// std::stop_token) and can carry a deadline. co_await gives the system call's result: >= 0, or
// -errno; -ECANCELED when stopped, -ETIMEDOUT when the deadline passed first. An operation that
// completed despite a stop request reports its real result, so no data or descriptor is lost.

#include <sys/socket.h>

#include <chrono>
#include <coroutine>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <stop_token>
#include <type_traits>

#include <forkpool/runtime/internal/deadline.hpp>
#include <forkpool/runtime/loop.hpp>
#include <forkpool/runtime/internal/operation.hpp>
#include <forkpool/runtime/task.hpp>

namespace forkpool::detail {

// A borrowed stop token. IoOptions must stay trivially destructible: g++ 12 destroys an
// aggregate temporary twice when it is built inside a co_await expression.
class StopRef {
 public:
  StopRef() noexcept = default;
  StopRef(const std::stop_token& token) noexcept : token_(&token) {}  // NOLINT: implicit by design
  std::stop_token get() const { return token_ ? *token_ : std::stop_token(); }

 private:
  const std::stop_token* token_ = nullptr;
};

// The token is copied when the operation is made, so a temporary token is fine.
struct IoOptions {
  StopRef stop = {};
  std::optional<Clock::time_point> deadline = {};
};
static_assert(std::is_trivially_destructible_v<IoOptions>);

class IoAwaitable {
 public:
  // `request` holds the operation's kind and parameters; its callback fields are ignored.
  IoAwaitable(const Operation& request, IoOptions options);
  IoAwaitable(const IoAwaitable&) = delete;
  IoAwaitable& operator=(const IoAwaitable&) = delete;

  bool await_ready() noexcept { return false; }
  bool await_suspend(std::coroutine_handle<> awaiter);
  int await_resume() noexcept;

 private:
  struct StopRequest {
    IoAwaitable* self;
    void operator()() const noexcept;
  };
  static void main_done(Operation* op, int result);
  static void timer_done(Operation* op, int result);
  void finish_one();

  Operation main_;
  Operation timer_;
  std::stop_token stop_;
  std::optional<Clock::time_point> deadline_;
  std::optional<std::stop_callback<StopRequest>> stop_callback_;
  std::coroutine_handle<> awaiter_;
  Loop* loop_ = nullptr;
  int pending_ = 0;
  bool main_finished_ = false;
  bool timed_out_ = false;
};

IoAwaitable async_read(int fd, std::span<std::byte> buffer, IoOptions options = {});
IoAwaitable async_write(int fd, std::span<const std::byte> buffer, IoOptions options = {});
IoAwaitable async_sendmsg(int fd, const msghdr* message, int flags, IoOptions options = {});
IoAwaitable async_recvmsg(int fd, msghdr* message, int flags, IoOptions options = {});
// Result: the poll events that fired (POLLIN/POLLOUT, or POLLERR/POLLHUP).
IoAwaitable wait_readable(int fd, IoOptions options = {});
IoAwaitable wait_writable(int fd, IoOptions options = {});
// Completes when the process behind `pidfd` has exited (it is then ready to be reaped).
IoAwaitable wait_process_exit(int pidfd, IoOptions options = {});
// Completes with 0 when another process (or thread) wakes the 32-bit futex word `word`
// (FUTEX_WAKE, not private), or -EAGAIN at once when `*word != expected`. Spurious wake-ups
// happen: look at the word again. Where the loop cannot wait on a futex (the epoll backend,
// Linux before 6.7: loop_waits_on_futexes() is false) it completes with -EOPNOTSUPP.
IoAwaitable wait_futex(const void* word, std::uint32_t expected, IoOptions options = {});
// Whether the calling thread's loop takes wait_futex.
bool loop_waits_on_futexes();
// Completes with 0 at `when` (or -ECANCELED when stopped first).
IoAwaitable wait_until(Clock::time_point when, StopRef stop = {});

// The kernel's form of a point on the steady clock (CLOCK_MONOTONIC).
__kernel_timespec to_kernel_time(Clock::time_point when);

}  // namespace forkpool::detail
