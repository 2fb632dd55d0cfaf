#pragma once
// Backend: how the loop talks to the kernel. Two exist: io_uring (preferred) and epoll (where
// io_uring is unavailable or forced off). Both give the same behaviour: every started operation
// completes exactly once, through its callback, from inside reap().

#include <functional>
#include <memory>

#include <forkpool/runtime/internal/operation.hpp>

namespace forkpool::detail {

class Backend {
 public:
  virtual ~Backend() = default;

  // Hands `op` to the kernel, or queues it when the rings are full: never fails it for lack of room.
  virtual void start(Operation* op) = 0;
  // Asks for `op` to complete early with -ECANCELED (it may still complete with its real result).
  virtual void cancel(Operation* op) = 0;
  // Makes the kernel see what start()/cancel() prepared.
  virtual void flush() = 0;
  // Delivers completions; with `block`, first waits for at least one. Returns how many it delivered.
  virtual std::size_t reap(bool block) = 0;
  // Readable when reap() has something to deliver.
  virtual int pollable_fd() const = 0;
  virtual const char* name() const = 0;
  // Whether start() takes OpKind::futex_wait (io_uring on Linux 6.7 and later); where it does
  // not, such an operation completes with -EOPNOTSUPP.
  virtual bool waits_on_futexes() const noexcept { return false; }
  // In a forked child: drop the parent's kernel objects without touching them.
  virtual void abandon() noexcept = 0;

  // Operations started and not yet delivered.
  std::size_t outstanding() const noexcept { return outstanding_; }

  // Called when a completion becomes deliverable outside the kernel's own queue (a host
  // loop watching pollable_fd() would otherwise not hear of it).
  std::function<void()> on_soft_completion;

 protected:
  // Completes `op` at the next reap(): for results known without the kernel.
  void complete_soon(Operation* op, int result) {
    op->result = result;
    op->state = OpState::completing;
    soon_.push_back(op);
    if (on_soft_completion) on_soft_completion();
  }
  bool has_soft_completions() const noexcept { return !soon_.empty(); }

  // Delivers the completions complete_soon() collected before this call.
  std::size_t deliver_soft_completions() {
    OpList batch = soon_.take_all();
    return deliver_all(batch);
  }

  // Delivers every operation of `batch` with the result stored in it; returns how many.
  std::size_t deliver_all(OpList& batch) {
    std::size_t count = 0;
    while (Operation* op = batch.pop_front()) {
      deliver(op, op->result);
      ++count;
    }
    return count;
  }

  void deliver(Operation* op, int result) {
    op->state = OpState::idle;
    op->cancel_requested = false;
    --outstanding_;
    op->on_complete(op, result);
  }

  void note_started() noexcept { ++outstanding_; }

 private:
  OpList soon_;
  std::size_t outstanding_ = 0;
};

// The io_uring backend, or nullptr with `why` filled when the kernel refuses it.
std::unique_ptr<Backend> make_uring_backend(unsigned entries, std::string* why);
std::unique_ptr<Backend> make_epoll_backend();

}  // namespace forkpool::detail
