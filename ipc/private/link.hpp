#pragma once
// Link: the parent's and one worker's conversation. Messages without descriptors travel in a
// pair of shared-memory rings (ring.hpp), one per direction, with no system call when the
// peer is awake; messages with descriptors (or too large for an entry) travel on the socket,
// and an entry kRingOnSocket in the ring marks their place, so the two paths keep one order.
// The socket stays the lifeline: its end-of-file, and the worker's pidfd, say a side is gone.
//
// Waking only a sleeper: a side that waits polls its ring for a while (AdaptiveSpin), then sets
// its ring's consumer_sleeping and sleeps on its own eventfd (the worker in poll(2) with the
// socket, the parent on its loop); a producer writes the peer's eventfd only when it finds that
// flag set (and clears it). Each side stores (its entry, or its flag) and then loads (the other's
// flag, or the head), all seq_cst, so one of them always sees the other's store.
//
// A marker names its message (kind and request id); the parent drops socket messages no marker
// announced (a task may write to the socket: it must not steer the pool).
//
// "Loose" message kinds (kinds the caller names, for messages sent from any thread straight to
// the socket: releases) are delivered whenever they are read; every other socket message waits
// for its marker.

#include <chrono>
#include <coroutine>
#include <cstdint>
#include <deque>
#include <functional>
#include <optional>
#include <span>

#include <forkpool/ipc/internal/channel.hpp>
#include <forkpool/ipc/internal/mapping.hpp>
#include <forkpool/ipc/private/ring.hpp>
#include <forkpool/runtime/private/spin.hpp>
#include <forkpool/runtime/unique_fd.hpp>
#include <forkpool/runtime/task.hpp>

namespace forkpool::detail {

// Each direction's ring holds this many bytes of entries.
inline constexpr std::size_t kLinkRingCapacity = std::size_t{128} * 1024;
// Ring 0 carries the parent's messages to the worker, ring 1 the worker's to the parent.
inline constexpr int kToWorker = 0;
inline constexpr int kToParent = 1;

// What the parent makes for one worker; the worker gets `rings` and both eventfds (hello).
struct LinkResources {
  UniqueFd rings;        // sealed memfd of both directions
  UniqueFd parent_wake;  // eventfd the parent sleeps on
  UniqueFd worker_wake;  // eventfd the worker sleeps on
  static LinkResources create();
};

// Maps a link's rings (checking the memfd's size and seals); throws ProtocolError otherwise.
Mapping map_link_rings(int memfd);

// The peer's eventfd written once; a full counter (never, in practice) still wakes it.
void wake_peer(int eventfd) noexcept;

// Whether a message kind is loose (see above).
using LooseKinds = bool (*)(std::uint16_t kind);

// The worker's end: blocking calls on the worker's only thread.
class WorkerLink {
 public:
  WorkerLink(Channel& channel, Mapping rings, UniqueFd own_wake, UniqueFd parent_wake,
             std::optional<std::chrono::nanoseconds> spin, LooseKinds loose);

  // In order with every earlier send. Waits while the ring is full. Throws ChannelClosed when
  // the parent is gone, ProtocolError when the parent broke the ring.
  void send(std::uint16_t kind, std::uint64_t request_id, std::span<const std::byte> payload,
            std::span<const int> fds = {});
  // The next message: polls, then sleeps. Throws ChannelClosed at the parent's end-of-file.
  Message receive();

 private:
  std::optional<Message> take();
  // Waits for an entry, room (`room_for`), or the socket; returns a loose message read meanwhile.
  void wait(std::optional<std::size_t> room_for);
  void read_socket();

  Channel& channel_;
  Mapping rings_;
  RingConsumer inbound_;
  RingProducer outbound_;
  UniqueFd own_wake_;
  UniqueFd parent_wake_;
  AdaptiveSpin spin_;
  LooseKinds loose_;
  std::deque<Message> ordered_;  // socket messages read before their marker
  std::deque<Message> early_;    // loose messages read while waiting to send
  // Loose messages (releases a parent's other threads send) land on the socket, which is
  // otherwise read only when the worker sleeps or a marker comes: under a steady stream of tasks
  // they would wait there, the blocks they release with them, while the worker's memory grows
  // (issue 58.10). So the socket is looked at every kSocketCheckEvery messages taken.
  static constexpr unsigned kSocketCheckEvery = 64;
  unsigned taken_since_socket_check_ = 0;
  void read_waiting_socket_messages();
};

// The parent's end: on the loop's thread. Sends are serialised by the caller (one at a time).
class ParentLink final : public Spinner {
 public:
  ParentLink(Channel& channel, Mapping rings, UniqueFd own_wake, UniqueFd worker_wake,
             std::optional<std::chrono::nanoseconds> spin);
  ~ParentLink() override;
  ParentLink(const ParentLink&) = delete;
  ParentLink& operator=(const ParentLink&) = delete;

  // In order with every earlier send; the ring's entries leave at the call, a full ring waits on
  // the loop. Throws ChannelClosed once the worker is gone, ProtocolError when it broke the ring.
  Task<void> async_send(std::uint16_t kind, std::uint64_t request_id, std::span<const std::byte> payload,
                        std::span<const int> fds = {});
  // A message without descriptors into the ring if there is room now and no send waits; false
  // otherwise (the caller sends it with async_send, or a loose one on the socket). Never waits.
  // Publish::at_flush: it leaves with the next flush() or published send, so that a batch of
  // messages costs one publication (and at most one wake-up); the caller must flush().
  enum class Publish { now, at_flush };
  // Whether a message of `payload` bound for the ring would wait for room now: a send waits
  // already, or the ring lacks it. False for what goes on the socket (too large for the ring)
  // and for a link that is gone or broken (its sends report that). Never waits.
  bool ring_lacks_room_for(std::span<const std::byte> payload);
  bool try_send_now(std::uint16_t kind, std::uint64_t request_id, std::span<const std::byte> payload,
                    Publish publish = Publish::now);
  // Publishes what try_send_now(Publish::at_flush) wrote, waking the worker if it sleeps.
  void flush() noexcept;
  // Checks the worker's position in the ring we write, read otherwise only when room is short:
  // a ProtocolError when the worker broke it (a task wrote there).
  void check_worker_position() { outbound_.check_consumer(); }

  // The next message the worker sent, or nothing when none has arrived (the room of the messages
  // read before is then given back: one publication per batch). Throws ProtocolError
  // once when the worker broke the ring (then nothing more is read), ChannelClosed once the
  // worker is gone and everything it sent has been read.
  std::optional<Message> try_receive();
  // Resumes on the loop when try_receive() may have something.
  auto arrival() noexcept { return ArrivalAwaiter{*this}; }

  // Messages are expected (work in flight): the loop may spin for them.
  void set_expecting(bool expecting) noexcept { expecting_ = expecting; }
  // The worker exited (reaped): what it sent is still read, then try_receive() says closed.
  void peer_gone();
  // Runs while the link lives (in the pool's Scope): wakes what waits on this side when the
  // worker writes our eventfd. Ends when `stop` is requested.
  Task<void> watch_wakes(std::stop_token stop);
  // How often the worker polled its ring while spinning.
  std::uint64_t worker_spin_polls() const noexcept;

  // Spinner: the loop polls the ring for replies before it sleeps.
  std::chrono::nanoseconds spin_budget() override;
  std::chrono::nanoseconds typical_gap() const override { return spin_.typical_gap(); }
  bool poll() override;
  bool prepare_to_sleep() override;
  void saw_preemption() override { spin_.saw_preemption(); }

 private:
  struct ArrivalAwaiter {
    ParentLink& link;
    bool await_ready() const noexcept { return link.arrived(); }
    void await_suspend(std::coroutine_handle<> receiver);
    void await_resume() const noexcept {}
  };
  struct RoomAwaiter {
    ParentLink& link;
    std::size_t payload_size;
    bool await_ready();
    void await_suspend(std::coroutine_handle<> sender) noexcept {
      link.sender_ = sender;
      link.sender_needs_ = payload_size;
    }
    void await_resume() const noexcept {}
  };
  Message announced_socket_message(const RingRecord& marker);
  Task<void> push(std::uint16_t kind, std::uint64_t request_id, std::span<const std::byte> payload);
  bool arrived() const noexcept { return gone_ || (!broken_ && inbound_.ready()); }
  // Resumes the receiver (if something arrived) and the sender (if there is room); true if either.
  bool resume_waiters();
  void after_push() noexcept;

  Channel& channel_;
  Mapping rings_;
  RingConsumer inbound_;
  RingProducer outbound_;
  UniqueFd own_wake_;
  UniqueFd worker_wake_;
  AdaptiveSpin spin_;
  std::coroutine_handle<> receiver_;
  std::coroutine_handle<> sender_;
  std::size_t sender_needs_ = 0;  // the payload size sender_ waits to have room for
  Clock::time_point wait_began_;
  bool expecting_ = false;
  bool gone_ = false;
  bool broken_ = false;
  bool registered_ = false;  // among the loop's spinners (while receiver_ waits)
};

}  // namespace forkpool::detail
