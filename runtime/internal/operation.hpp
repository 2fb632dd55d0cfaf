#pragma once
// Operation: one request to the kernel. Its address is the io_uring user_data (and the epoll
// backend's handle), so a completion finds its operation without a lookup. An operation lives
// in its awaiter (usually a coroutine frame) and must stay put until it has completed.

#include <linux/time_types.h>
#include <sys/socket.h>

#include <cstddef>
#include <cstdint>

namespace forkpool::detail {

enum class OpKind : std::uint8_t { read, write, sendmsg, recvmsg, poll, timeout, futex_wait };

// Where an operation is: a backend moves it idle -> queued -> in_kernel -> idle, and
// completes it exactly once. Cancelling an idle operation does nothing.
enum class OpState : std::uint8_t { idle, queued, in_kernel, completing };

struct Operation {
  using Callback = void (*)(Operation*, int result);

  OpKind kind = OpKind::poll;  // set by whoever fills the operation in
  OpState state = OpState::idle;
  bool cancel_requested = false;
  int fd = -1;
  unsigned flags = 0;            // sendmsg/recvmsg flags, or poll events
  void* buffer = nullptr;        // read/write; futex_wait: the 32-bit futex word
  std::size_t length = 0;        // read/write; futex_wait: the value the word must hold to sleep
  msghdr* message = nullptr;     // sendmsg/recvmsg
  __kernel_timespec deadline{};  // timeout: absolute CLOCK_MONOTONIC
  int result = 0;
  Callback on_complete = nullptr;  // result >= 0, or -errno (-ECANCELED, -ETIME for a fired timeout)
  void* context = nullptr;         // for the callback: the awaiter that owns this operation

  Operation* prev = nullptr;  // intrusive links: a backend's queue or waiter list
  Operation* next = nullptr;
};

// A doubly linked intrusive list of operations: O(1) push, pop and removal, no allocation.
class OpList {
 public:
  bool empty() const noexcept { return head_ == nullptr; }
  Operation* front() const noexcept { return head_; }

  void push_back(Operation* op) noexcept {
    op->next = nullptr;
    op->prev = tail_;
    (tail_ ? tail_->next : head_) = op;
    tail_ = op;
  }

  Operation* pop_front() noexcept {
    Operation* op = head_;
    if (op) remove(op);
    return op;
  }

  void remove(Operation* op) noexcept {
    (op->prev ? op->prev->next : head_) = op->next;
    (op->next ? op->next->prev : tail_) = op->prev;
    op->prev = op->next = nullptr;
  }

  // Moves every element to the returned list, leaving this one empty.
  OpList take_all() noexcept {
    OpList taken;
    taken.head_ = head_;
    taken.tail_ = tail_;
    head_ = tail_ = nullptr;
    return taken;
  }

 private:
  Operation* head_ = nullptr;
  Operation* tail_ = nullptr;
};

}  // namespace forkpool::detail
