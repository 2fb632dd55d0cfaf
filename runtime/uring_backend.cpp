// The io_uring backend. Lessons applied: the operation's address is the user_data; never more in
// flight than the completion queue holds (the rest wait in an intrusive queue); kernel features
// probed at run time; the parent's ring is not inherited by forked children.

#include <errno.h>
#include <liburing.h>
#include <poll.h>
#include <string.h>
#include <sys/mman.h>

#include <array>
#include <memory>
#include <string>

#include <forkpool/runtime/private/backend.hpp>
#include <forkpool/runtime/error.hpp>
#include <forkpool/runtime/private/errno.hpp>

namespace forkpool::detail {
namespace {

// A cancel request's completion carries its target's address with the low bit set: it only
// frees a completion-queue slot, the target completes on its own.
constexpr std::uintptr_t kCancelTag = 1;

// io_uring_queue_exit, except that under TSan the rings are unmapped through libc. liburing maps
// and unmaps them with raw system calls TSan does not see; a ring a later thread gets at the same
// address would then carry this one's accesses, and TSan would report a race between two rings.
void release_ring(io_uring& ring) {
#if defined(__SANITIZE_THREAD__)
  ::munmap(ring.sq.sqes, sizeof(io_uring_sqe) * ring.sq.ring_entries);
  if (ring.cq.ring_ptr && ring.cq.ring_ptr != ring.sq.ring_ptr) ::munmap(ring.cq.ring_ptr, ring.cq.ring_sz);
  ::munmap(ring.sq.ring_ptr, ring.sq.ring_sz);
  ::close(ring.ring_fd);
#else
  io_uring_queue_exit(&ring);
#endif
}

// IORING_OP_FUTEX_WAIT (Linux 6.7) is newer than Debian 12's liburing: its number and the
// futex2 size flag are the kernel's ABI (include/uapi/linux/io_uring.h, linux/futex.h).
constexpr unsigned kOpFutexWait = 51;
constexpr unsigned kFutex2SizeU32 = 0x02;  // shared (no FUTEX2_PRIVATE): other processes wake it
constexpr std::uint64_t kFutexMatchAnyBit = 0xffffffff;

constexpr std::array kRequiredOps = {IORING_OP_NOP,     IORING_OP_READ,     IORING_OP_WRITE,   IORING_OP_SENDMSG,
                                     IORING_OP_RECVMSG, IORING_OP_POLL_ADD, IORING_OP_TIMEOUT, IORING_OP_ASYNC_CANCEL};

// io_uring_queue_init_params with the newest flags this kernel accepts.
int setup_ring(io_uring& ring, unsigned entries, io_uring_params& params) {
  // No COOP_TASKRUN: a host loop blocked in epoll_wait on our fd must be woken by completions.
  const unsigned wanted[] = {IORING_SETUP_SUBMIT_ALL, 0};
  int rc = -EINVAL;
  for (unsigned flags : wanted) {
    params = {};
    params.flags = flags;
    rc = io_uring_queue_init_params(entries, &ring, &params);
    if (rc != -EINVAL) break;
  }
  return rc;
}

class UringBackend final : public Backend {
 public:
  UringBackend() = default;
  UringBackend(const UringBackend&) = delete;
  UringBackend& operator=(const UringBackend&) = delete;
  ~UringBackend() override {
    if (ready_ && !abandoned_) release_ring(ring_);
  }

  // Sets the ring up in place (liburing keeps pointers into it); empty on success, else why not.
  std::string init(unsigned entries);

  void start(Operation* op) override {
    note_started();
    if (op->kind == OpKind::futex_wait && !futex_wait_supported_) {
      complete_soon(op, -EOPNOTSUPP);  // an older kernel: as the epoll backend
      return;
    }
    if (waiting_.empty()) {
      if (io_uring_sqe* sqe = claim_sqe()) {
        hand_over(sqe, op);
        return;
      }
    }
    op->state = OpState::queued;
    waiting_.push_back(op);
    submit_waiting();
  }

  void cancel(Operation* op) override {
    if (op->cancel_requested) return;
    if (op->state == OpState::queued) {
      waiting_.remove(op);
      complete_soon(op, -ECANCELED);
    } else if (op->state == OpState::in_kernel) {
      op->cancel_requested = true;
      cancels_.push_back(op);  // the link is free while the kernel holds the operation
      submit_waiting();
    }
  }

  void flush() override {
    if (io_uring_sq_ready(&ring_) == 0) return;
    int rc;
    do rc = io_uring_submit(&ring_);
    while (rc == -EINTR);
    if (rc < 0 && rc != -EBUSY && rc != -EAGAIN) throw_errno(-rc, "io_uring_submit");
  }

  std::size_t reap(bool block) override {
    std::size_t delivered = deliver_soft_completions();
    submit_waiting();
    unsigned wait_for = (block && delivered == 0 && !has_soft_completions()) ? 1 : 0;
    int rc = io_uring_submit_and_wait(&ring_, wait_for);
    if (rc < 0 && rc != -EINTR && rc != -EBUSY && rc != -EAGAIN && rc != -ETIME)
      throw_errno(-rc, "io_uring_submit_and_wait");
    delivered += drain_completions();
    submit_waiting();
    return delivered;
  }

  int pollable_fd() const override { return ring_.ring_fd; }
  const char* name() const override { return "io_uring"; }
  bool waits_on_futexes() const noexcept override { return futex_wait_supported_; }

  void abandon() noexcept override {
    // The rings were mapped MADV_DONTFORK: nothing to unmap here, only our copy of the fd.
    abandoned_ = true;
    ::close(ring_.ring_fd);
  }

 private:
  // Moves queued cancels and operations into the submission queue while the completion queue
  // has room for their completions.
  void submit_waiting() {
    while (!cancels_.empty()) {
      io_uring_sqe* sqe = claim_sqe();
      if (!sqe) break;
      Operation* target = cancels_.pop_front();
      io_uring_prep_cancel(sqe, target, 0);
      io_uring_sqe_set_data64(sqe, reinterpret_cast<std::uintptr_t>(target) | kCancelTag);
    }
    while (!waiting_.empty()) {
      io_uring_sqe* sqe = claim_sqe();
      if (!sqe) break;
      hand_over(sqe, waiting_.pop_front());
    }
  }

  // A submission slot whose completion the completion queue has room for, or nullptr.
  io_uring_sqe* claim_sqe() {
    if (in_flight_ >= capacity_) return nullptr;
    io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
    if (sqe) ++in_flight_;
    return sqe;
  }

  static void hand_over(io_uring_sqe* sqe, Operation* op) {
    prepare(sqe, op);
    op->state = OpState::in_kernel;
  }

  static void prepare(io_uring_sqe* sqe, Operation* op) {
    switch (op->kind) {
      case OpKind::read: io_uring_prep_read(sqe, op->fd, op->buffer, static_cast<unsigned>(op->length), -1); break;
      case OpKind::write: io_uring_prep_write(sqe, op->fd, op->buffer, static_cast<unsigned>(op->length), -1); break;
      case OpKind::sendmsg: io_uring_prep_sendmsg(sqe, op->fd, op->message, op->flags); break;
      case OpKind::recvmsg: io_uring_prep_recvmsg(sqe, op->fd, op->message, op->flags); break;
      case OpKind::poll: io_uring_prep_poll_add(sqe, op->fd, op->flags); break;
      case OpKind::timeout: io_uring_prep_timeout(sqe, &op->deadline, 0, IORING_TIMEOUT_ABS); break;
      case OpKind::futex_wait:
        // liburing's io_uring_prep_futex_wait: flags in fd, the value in off, the mask in addr3.
        io_uring_prep_rw(static_cast<int>(kOpFutexWait), sqe, static_cast<int>(kFutex2SizeU32), op->buffer, 0,
                         op->length);
        sqe->addr3 = kFutexMatchAnyBit;
        break;
    }
    io_uring_sqe_set_data(sqe, op);
  }

  std::size_t drain_completions() {
    struct Done {
      std::uintptr_t data;
      int result;
    };
    std::array<Done, 128> batch;
    std::size_t delivered = 0;
    for (;;) {
      // Copy a batch out first: the callbacks may start new operations.
      std::size_t count = 0;
      unsigned head;
      io_uring_cqe* cqe;
      io_uring_for_each_cqe(&ring_, head, cqe) {
        batch[count++] = {cqe->user_data, cqe->res};
        if (count == batch.size()) break;
      }
      io_uring_cq_advance(&ring_, static_cast<unsigned>(count));
      in_flight_ -= static_cast<unsigned>(count);
      for (std::size_t i = 0; i < count; ++i) {
        if (batch[i].data & kCancelTag) continue;
        deliver(reinterpret_cast<Operation*>(batch[i].data), batch[i].result);
        ++delivered;
      }
      if (count < batch.size()) return delivered;
    }
  }

  io_uring ring_{};
  bool ready_ = false;
  unsigned capacity_ = 0;
  unsigned in_flight_ = 0;
  OpList waiting_;
  OpList cancels_;
  bool abandoned_ = false;
  bool futex_wait_supported_ = false;
};

std::string UringBackend::init(unsigned entries) {
  io_uring_params params{};
  if (int rc = setup_ring(ring_, entries, params); rc < 0)
    return std::string("io_uring_setup: ") + strerrorname_np(-rc);
  ready_ = true;
  capacity_ = params.cq_entries;
  io_uring_probe* probe = io_uring_get_probe_ring(&ring_);
  std::string missing;
  for (auto opcode : kRequiredOps)
    if (!probe || !io_uring_opcode_supported(probe, opcode)) {
      missing += ' ';  // (not `" " + to_string`: GCC 12 at -O3 warns of an overlap there, bug 105329)
      missing += std::to_string(opcode);
    }
  futex_wait_supported_ = probe && io_uring_opcode_supported(probe, static_cast<int>(kOpFutexWait));
  if (probe) io_uring_free_probe(probe);
  if (!missing.empty()) return "io_uring lacks opcodes:" + missing;
  // A forked child must never touch its parent's ring.
  if (int rc = io_uring_ring_dontfork(&ring_); rc < 0)
    return std::string("io_uring_ring_dontfork: ") + strerrorname_np(-rc);
  return {};
}

}  // namespace

std::unique_ptr<Backend> make_uring_backend(unsigned entries, std::string* why) {
  auto backend = std::make_unique<UringBackend>();
  *why = backend->init(entries);
  if (!why->empty()) return nullptr;
  return backend;
}

}  // namespace forkpool::detail
