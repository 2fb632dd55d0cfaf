#include <forkpool/runtime/internal/io.hpp>

#include <errno.h>
#include <poll.h>

#include <forkpool/runtime/private/loop_internals.hpp>

namespace forkpool::detail {
__kernel_timespec to_kernel_time(Clock::time_point when) {
  // steady_clock is CLOCK_MONOTONIC on Linux, the clock the kernel's timeouts use.
  auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(when.time_since_epoch()).count();
  if (ns < 0) ns = 0;
  return {ns / 1'000'000'000, ns % 1'000'000'000};
}

IoAwaitable::IoAwaitable(const Operation& request, IoOptions options)
    : main_(request), stop_(options.stop.get()), deadline_(options.deadline) {
  main_.on_complete = &IoAwaitable::main_done;
  main_.context = this;
  timer_.kind = detail::OpKind::timeout;
  timer_.on_complete = &IoAwaitable::timer_done;
  timer_.context = this;
}
bool IoAwaitable::await_suspend(std::coroutine_handle<> awaiter) {
  if (stop_.stop_requested()) {
    main_.result = -ECANCELED;
    return false;
  }
  awaiter_ = awaiter;
  loop_ = &Loop::current();
  pending_ = 1;
  detail::LoopInternals::start(*loop_, &main_);
  if (deadline_) {
    ++pending_;
    timer_.deadline = to_kernel_time(*deadline_);
    detail::LoopInternals::start(*loop_, &timer_);
  }
  if (stop_.stop_possible()) stop_callback_.emplace(stop_, StopRequest{this});
  return true;
}

int IoAwaitable::await_resume() noexcept {
  if (timed_out_ && main_.result == -ECANCELED) return -ETIMEDOUT;
  if (main_.kind == detail::OpKind::timeout && main_.result == -ETIME) return 0;  // the timer fired
  return main_.result;
}

void IoAwaitable::StopRequest::operator()() const noexcept {
  // Runs on the loop's thread (forkpool is single-threaded); completion comes through the loop.
  detail::LoopInternals::cancel(*self->loop_, &self->main_);
  if (self->pending_ > 1) detail::LoopInternals::cancel(*self->loop_, &self->timer_);
}

void IoAwaitable::main_done(Operation* op, int result) {
  auto* self = static_cast<IoAwaitable*>(op->context);
  self->main_.result = result;
  self->main_finished_ = true;
  if (self->pending_ > 1) detail::LoopInternals::cancel(*self->loop_, &self->timer_);
  self->finish_one();
}

void IoAwaitable::timer_done(Operation* op, int result) {
  auto* self = static_cast<IoAwaitable*>(op->context);
  if (result == -ETIME && !self->main_finished_) {
    self->timed_out_ = true;
    detail::LoopInternals::cancel(*self->loop_, &self->main_);
  }
  self->finish_one();
}

void IoAwaitable::finish_one() {
  // Resume only when the kernel holds neither operation: both live in the awaiter's frame.
  if (--pending_ > 0) return;
  stop_callback_.reset();
  awaiter_.resume();
}

namespace {
Operation request(detail::OpKind kind, int fd) {
  Operation op;
  op.kind = kind;
  op.fd = fd;
  return op;
}
Operation buffer_request(detail::OpKind kind, int fd, const void* data, std::size_t size) {
  Operation op = request(kind, fd);
  op.buffer = const_cast<void*>(data);  // a write's buffer is only read by the kernel
  op.length = size;
  return op;
}
Operation message_request(detail::OpKind kind, int fd, const msghdr* message, int flags) {
  Operation op = request(kind, fd);
  op.message = const_cast<msghdr*>(message);  // sendmsg only reads it
  op.flags = static_cast<unsigned>(flags);
  return op;
}
Operation poll_request(int fd, unsigned events) {
  Operation op = request(detail::OpKind::poll, fd);
  op.flags = events;
  return op;
}
}  // namespace

IoAwaitable async_read(int fd, std::span<std::byte> buffer, IoOptions options) {
  return IoAwaitable(buffer_request(detail::OpKind::read, fd, buffer.data(), buffer.size()), options);
}
IoAwaitable async_write(int fd, std::span<const std::byte> buffer, IoOptions options) {
  return IoAwaitable(buffer_request(detail::OpKind::write, fd, buffer.data(), buffer.size()), options);
}
IoAwaitable async_sendmsg(int fd, const msghdr* message, int flags, IoOptions options) {
  return IoAwaitable(message_request(detail::OpKind::sendmsg, fd, message, flags), options);
}
IoAwaitable async_recvmsg(int fd, msghdr* message, int flags, IoOptions options) {
  return IoAwaitable(message_request(detail::OpKind::recvmsg, fd, message, flags), options);
}
IoAwaitable wait_readable(int fd, IoOptions options) { return IoAwaitable(poll_request(fd, POLLIN), options); }
IoAwaitable wait_writable(int fd, IoOptions options) { return IoAwaitable(poll_request(fd, POLLOUT), options); }
IoAwaitable wait_process_exit(int pidfd, IoOptions options) { return wait_readable(pidfd, options); }

IoAwaitable wait_futex(const void* word, std::uint32_t expected, IoOptions options) {
  Operation op = request(detail::OpKind::futex_wait, -1);
  op.buffer = const_cast<void*>(word);  // the kernel only reads it
  op.length = expected;
  return IoAwaitable(op, options);
}

bool loop_waits_on_futexes() { return LoopInternals::waits_on_futexes(Loop::current()); }

IoAwaitable wait_until(Clock::time_point when, StopRef stop) {
  Operation op = request(detail::OpKind::timeout, -1);
  op.deadline = to_kernel_time(when);
  return IoAwaitable(op, IoOptions{.stop = stop});
}

}  // namespace forkpool::detail
