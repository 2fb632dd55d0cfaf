#pragma once
// Queue<T>: many producers and many consumers in any processes, as multiprocessing.Queue (with
// torch's tensors moved to shared memory). A handle: copies, and copies passed to other processes
// (as arguments of start_process, spawn and pool tasks, under every start method: its
// descriptors travel with the message), are the same queue.
//
// Each item is one datagram on an AF_UNIX SOCK_SEQPACKET socket, its descriptors (a tensor's
// shared memory) inside it: a consumer gets whole items only, also when a producer dies in the
// middle of a put, and an item put by a process that exits at once still arrives (the kernel
// holds it, with its descriptors; torch's Queue loses it: pytorch#65418).

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <stdexcept>

#include <forkpool/ipc/codec.hpp>
#include <forkpool/ipc/internal/channel.hpp>
#include <forkpool/runtime/internal/deadline.hpp>
#include <forkpool/runtime/internal/shared_handle.hpp>
#include <forkpool/runtime/task.hpp>

namespace forkpool {

namespace detail {

// An item as it crosses: written by `write`, its tensors' blocks lent (shm/private/
// queue_memory.hpp); and read back by `read` from a message, the blocks borrowed.
Writer encode_queue_item(const std::function<void(Writer&)>& write);
void decode_queue_item(detail::Message& message, const std::function<void(Reader&)>& read);

// One T as it crosses a queue or a pipe: encoded with its tensors lent, and decoded back.
template <class T>
Writer encode_item(const T& item) {
  return encode_queue_item([&](Writer& w) { w.write(item); });
}
template <class T>
T decode_item(detail::Message& message) {
  std::optional<T> item;
  decode_queue_item(message, [&](Reader& in) {
    item.emplace(in.read<T>());
    in.expect_end();
  });
  return std::move(*item);
}

// The untyped queue: items as messages on a socketpair (put into one end, got from the other),
// and, when bounded, one token per free place in a pipe (put takes one, get gives one back).
// Any thread: puts build a frame each; gets wait with poll() and then take turns to receive.

class SharedPage;
struct QueueInternals;

class QueueCore {
 public:
  explicit QueueCore(std::size_t maxsize, bool joinable = false);
  // A queue received from another process: its socket ends, its shared page and, when bounded,
  // its token pipe. Throws ProtocolError when they are not.
  QueueCore(std::size_t maxsize, UniqueFd put_end, UniqueFd get_end, UniqueFd page, UniqueFd tokens_out,
            UniqueFd tokens_in);
  ~QueueCore();

  // false when `deadline` passed first.
  bool put(const Writer& item, Deadline deadline);
  Task<void> async_put(Writer item);
  // Nothing when `deadline` passed first; `deadline` now: get_nowait.
  std::optional<detail::Message> get(Deadline deadline);
  Task<detail::Message> async_get();

  void close() noexcept { closed_ = true; }
  std::size_t maxsize() const noexcept { return maxsize_; }
  // Items put and not yet got, approximately (as Python's qsize).
  std::size_t qsize() const;
  // JoinableQueue: one item got is done; join_tasks() waits until every item put is done (false
  // when `deadline` passed first).
  void task_done();
  bool join_tasks(Deadline deadline);
  void encode(Writer& w, const std::shared_ptr<const QueueCore>& self) const;

 private:
  friend struct QueueInternals;
  class TakeTurn;
  enum class Stage : std::uint32_t;

  bool try_take_token();
  void give_token();
  // A put's bookkeeping before its item is sent, and undone when it could not be.
  void item_coming();
  void item_not_sent();
  void settle_ended_consumers();
  void check_open() const;
  // One item if one is waiting, never blocking. Consumers in every process take turns (a
  // robust mutex in the queue's page; nobody waits while holding the turn), so a consumer that
  // dies in the middle of a take is noticed by the next, which gives its place back.
  std::optional<detail::Message> try_take();
  // The consumers' turn (held for a few system calls). Taking it from a holder that died
  // settles what that holder left half done. enter_turn(false): false when busy.
  bool enter_turn(bool wait);
  void leave_turn() noexcept;
  // The steps of a take, each recorded in the page (tests stop a consumer between them).
  std::optional<std::uint64_t> begin_take();
  std::optional<detail::Message> receive_taken();
  void end_take();
  // After a consumer died holding the turn: its place back, if it had taken its item.
  void settle_abandoned_take();
  // A producer waiting for a place looks every kEndedHolderCheck for a take a dead consumer left.
  void recover_abandoned_take();

  std::size_t maxsize_;
  detail::Channel put_end_, get_end_;
  std::shared_ptr<SharedPage> page_;
  UniqueFd tokens_out_, tokens_in_;  // read a token from out; write one into in
  bool closed_ = false;
};

}  // namespace detail

template <class T>
class Queue {
 public:
  // maxsize 0: no bound of its own (the kernel's socket buffer still bounds the bytes in flight:
  // a put then waits for a consumer). Throws std::system_error; std::invalid_argument for a
  // maxsize larger than a pipe can hold tokens for (/proc/sys/fs/pipe-max-size).
  explicit Queue(std::size_t maxsize = 0) : core_(std::make_shared<detail::QueueCore>(maxsize)) {}

  // Blocking calls, for plain code (workers, ranks). Any thread. put throws std::logic_error
  // after close() in this process.
  void put(T item) { core_->put(encode_item(item), std::nullopt); }
  // false when the queue stayed full for `timeout`.
  bool put(T item, std::chrono::nanoseconds timeout) {
    return core_->put(encode_item(item), detail::deadline_unless_forever(timeout));
  }
  // false when the queue is full (Python's put_nowait raises queue.Full).
  bool put_nowait(T item) { return core_->put(encode_item(item), std::chrono::steady_clock::now()); }
  T get() { return *take_if(core_->get(std::nullopt)); }
  std::optional<T> get(std::chrono::nanoseconds timeout) {
    return take_if(core_->get(detail::deadline_unless_forever(timeout)));
  }
  std::optional<T> get_nowait() { return take_if(core_->get(std::chrono::steady_clock::now())); }

  // On the calling thread's loop; they resume inside the loop's turn that completed them.
  Task<void> async_put(T item) {
    auto core = core_;
    co_await core->async_put(encode_item(item));
  }
  Task<T> async_get() {
    auto core = core_;
    detail::Message message = co_await core->async_get();
    co_return take(message);
  }

  // This process puts no more (further puts throw std::logic_error); gets go on.
  void close() { core_->close(); }

  // Approximate, as Python says: other processes put and get meanwhile.
  std::size_t qsize() const { return core_->qsize(); }
  bool empty() const { return qsize() == 0; }
  bool full() const { return core_->maxsize() > 0 && qsize() >= core_->maxsize(); }
  std::size_t maxsize() const { return core_->maxsize(); }

 protected:
  explicit Queue(std::shared_ptr<detail::QueueCore> core) : core_(std::move(core)) {}
  detail::SharedHandle<detail::QueueCore, "Queue"> core_;

 private:
  friend struct codec<Queue<T>>;

  static Writer encode_item(const T& item) { return detail::encode_item(item); }
  static T take(detail::Message& message) { return detail::decode_item<T>(message); }
  static std::optional<T> take_if(std::optional<detail::Message> message) {
    if (!message) return std::nullopt;
    return take(*message);
  }
};

// A Queue whose consumers say when each item they got is done, as multiprocessing's
// JoinableQueue: join() waits until every item put has been. An item got by a consumer that
// ended without task_done() counts as done (nothing waits for ever on a dead process).
template <class T>
class JoinableQueue : public Queue<T> {
 public:
  explicit JoinableQueue(std::size_t maxsize = 0) : Queue<T>(std::make_shared<detail::QueueCore>(maxsize, true)) {}
  // Throws std::logic_error when called more times than items were put.
  void task_done() { this->core_->task_done(); }
  void join() { this->core_->join_tasks(std::nullopt); }
  // False when items were still unfinished after `timeout`.
  bool join(std::chrono::nanoseconds timeout) {
    return this->core_->join_tasks(detail::deadline_unless_forever(timeout));
  }

 private:
  friend struct codec<JoinableQueue<T>>;
  explicit JoinableQueue(std::shared_ptr<detail::QueueCore> core) : Queue<T>(std::move(core)) {}
};

namespace detail {
// codec<Queue<T>>'s untyped half.
std::shared_ptr<QueueCore> decode_queue(Reader& r);
}  // namespace detail

template <class T>
struct codec<Queue<T>> {
  static constexpr std::size_t min_size = sizeof(std::uint64_t) + 3 * sizeof(std::uint32_t);
  static void encode(Writer& w, const Queue<T>& queue) { queue.core_->encode(w, queue.core_.shared()); }
  static Queue<T> decode(Reader& r) { return Queue<T>(detail::decode_queue(r)); }
};

template <class T>
struct codec<JoinableQueue<T>> {
  static constexpr std::size_t min_size = codec<Queue<T>>::min_size;
  static void encode(Writer& w, const JoinableQueue<T>& queue) { queue.core_->encode(w, queue.core_.shared()); }
  static JoinableQueue<T> decode(Reader& r) { return JoinableQueue<T>(detail::decode_queue(r)); }
};

}  // namespace forkpool
