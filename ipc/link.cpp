#include <forkpool/ipc/private/link.hpp>

#include <errno.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cstring>
#include <string>

#include <forkpool/ipc/private/memfd.hpp>
#include <forkpool/ipc/internal/spare_buffers.hpp>
#include <forkpool/runtime/error.hpp>
#include <forkpool/runtime/private/errno.hpp>
#include <forkpool/runtime/internal/io.hpp>
#include <forkpool/runtime/private/loop_internals.hpp>

namespace forkpool::detail {
namespace {

constexpr std::size_t kRingsBytes = 2 * ring_region_size(kLinkRingCapacity);

// A marker's payload: the kind of the socket message it announces (its request id is the entry's),
// so that a message a task wrote to the socket itself is told apart.
using Marker = std::array<std::byte, sizeof(std::uint16_t)>;
Marker marker_for(std::uint16_t kind) {
  Marker marker;
  std::memcpy(marker.data(), &kind, sizeof kind);
  return marker;
}

// Whether a message travels in the ring, or on the socket behind a marker.
bool fits_ring(std::span<const std::byte> payload, std::span<const int> fds) {
  return fds.empty() && payload.size() <= ring_payload_max(kLinkRingCapacity);
}

UniqueFd make_eventfd() {
  UniqueFd fd(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!fd) throw_last_errno("forkpool: eventfd for a worker's link");
  return fd;
}

void drain_eventfd(int fd) noexcept {
  std::uint64_t count;
  [[maybe_unused]] ssize_t ignored = ::read(fd, &count, sizeof count);
}

// After publishing an entry (a seq_cst store of the head): wakes the consumer if it announced
// sleep. Dekker's pattern with ParentLink::prepare_to_sleep / WorkerLink::wait, which store the
// flag and then load the head, all seq_cst: one side always sees the other's store.
void wake_sleeping_consumer(RingControl& control, int eventfd) noexcept {
  if (control.consumer_sleeping.load(std::memory_order_seq_cst) &&
      control.consumer_sleeping.exchange(0, std::memory_order_relaxed))
    wake_peer(eventfd);
}

// After consuming an entry (a seq_cst store of the tail): wakes the producer if it waits for room.
void wake_waiting_producer(RingControl& control, int eventfd) noexcept {
  if (control.producer_waiting.load(std::memory_order_seq_cst) &&
      control.producer_waiting.exchange(0, std::memory_order_relaxed))
    wake_peer(eventfd);
}

// A ring entry as a Message (its payload copied out: the room goes back to the producer).
Message message_of(const RingRecord& record) {
  Message message;
  message.kind = record.kind;
  message.request_id = record.request_id;
  message.payload = Payload(record.payload);
  return message;
}

}  // namespace

LinkResources LinkResources::create() {
  LinkResources made;
  made.rings = create_memfd("forkpool-link", kRingsBytes);
  seal_size(made.rings.get());
  made.parent_wake = make_eventfd();
  made.worker_wake = make_eventfd();
  return made;
}

Mapping map_link_rings(int memfd) {
  check_sealed_memfd(memfd, kRingsBytes, "forkpool: a worker's link");
  // Not inherited: the parent maps a worker's rings before it forks that worker's siblings, whose
  // tasks must not reach them (a task that writes a ring position gets its own worker rejected,
  // never another). Nor by what a worker's task forks.
  Mapping rings = Mapping::map(memfd, kRingsBytes, PROT_READ | PROT_WRITE);
  rings.keep_from_forks();
  return rings;
}

void wake_peer(int eventfd) noexcept {
  std::uint64_t one = 1;
  [[maybe_unused]] ssize_t ignored = ::write(eventfd, &one, sizeof one);
}

// ---- the worker's end ----

WorkerLink::WorkerLink(Channel& channel, Mapping rings, UniqueFd own_wake, UniqueFd parent_wake,
                       std::optional<std::chrono::nanoseconds> spin, LooseKinds loose)
    : channel_(channel),
      rings_(std::move(rings)),
      inbound_(ring_in_region(rings_.data(), kLinkRingCapacity, kToWorker)),
      outbound_(ring_in_region(rings_.data(), kLinkRingCapacity, kToParent)),
      own_wake_(std::move(own_wake)),
      parent_wake_(std::move(parent_wake)),
      spin_(spin),
      loose_(loose) {}

void WorkerLink::send(std::uint16_t kind, std::uint64_t request_id, std::span<const std::byte> payload,
                      std::span<const int> fds) {
  Marker marker;
  if (!fits_ring(payload, fds)) {
    channel_.send(kind, request_id, payload, fds);
    marker = marker_for(kind);
    kind = kRingOnSocket;
    payload = marker;
  }
  while (!outbound_.try_push(kind, request_id, payload)) wait(payload.size());
  wake_sleeping_consumer(outbound_.control(), parent_wake_.get());
}

Message WorkerLink::receive() {
  for (;;) {
    if (std::optional<Message> message = take()) return std::move(*message);
    // Nothing more: the room of what was read goes back (one publication per batch).
    if (inbound_.publish_room()) wake_waiting_producer(inbound_.control(), parent_wake_.get());
    wait(std::nullopt);
  }
}

std::optional<Message> WorkerLink::take() {
  if (!early_.empty()) {
    Message message = std::move(early_.front());
    early_.pop_front();
    return message;
  }
  if (++taken_since_socket_check_ >= kSocketCheckEvery) {
    taken_since_socket_check_ = 0;
    read_waiting_socket_messages();
    if (!early_.empty()) return take();
  }
  std::optional<RingRecord> record = inbound_.peek();
  if (!record) return std::nullopt;
  Message message;
  if (record->kind == kRingOnSocket) {
    if (ordered_.empty()) {
      Message next = channel_.receive();   // sent before its marker: it is there
      if (loose_(next.kind)) return next;  // the marker stays: its message is still to come
      ordered_.push_back(std::move(next));
    }
    message = std::move(ordered_.front());
    ordered_.pop_front();
  } else {
    message = message_of(*record);
  }
  if (inbound_.pop_later()) wake_waiting_producer(inbound_.control(), parent_wake_.get());
  return message;
}

void WorkerLink::wait(std::optional<std::size_t> room_for) {
  auto ready = [&] { return room_for ? outbound_.has_room(*room_for) : inbound_.ready(); };
  const Clock::time_point began = Clock::now();
  if (std::chrono::nanoseconds budget = spin_.budget(); budget.count() > 0) {
    SpinOutcome spun = spin_for(budget, [&](std::uint64_t) { return ready(); });
    if (spun.polls > 0) inbound_.control().spin_polls.fetch_add(spun.polls, std::memory_order_relaxed);
    if (spun.preempted) spin_.saw_preemption();
    if (spun.found) {
      if (!room_for) spin_.record(Clock::now() - began);
      return;
    }
  }
  // Announce the sleep, then look once more: the peer's store-then-load sees one or the other.
  std::atomic<std::uint32_t>& flag =
      room_for ? outbound_.control().producer_waiting : inbound_.control().consumer_sleeping;
  flag.store(1, std::memory_order_seq_cst);
  if (!ready()) {
    pollfd watched[2] = {{own_wake_.get(), POLLIN, 0}, {channel_.fd(), POLLIN, 0}};
    int rc;
    do rc = ::poll(watched, 2, -1);
    while (rc < 0 && errno == EINTR);
    if (rc < 0) throw_last_errno("forkpool: a worker's wait for its parent");
    if (watched[0].revents != 0) drain_eventfd(own_wake_.get());
    if (watched[1].revents != 0) read_socket();
  }
  flag.store(0, std::memory_order_relaxed);
  if (!room_for) spin_.record(Clock::now() - began);
}

void WorkerLink::read_waiting_socket_messages() {
  constexpr int kAtMost = 64;  // a parent that floods the socket does not starve the ring
  try {
    for (int read = 0; read < kAtMost; ++read) {
      std::optional<Message> message = channel_.try_receive();
      if (!message) return;
      (loose_(message->kind) ? early_ : ordered_).push_back(std::move(*message));
    }
  } catch (const ChannelClosed&) {
    // The parent is gone: the blocking read that follows says so, once the ring is read.
  }
}

void WorkerLink::read_socket() {
  Message message = channel_.receive();  // ChannelClosed at the parent's end-of-file
  (loose_(message.kind) ? early_ : ordered_).push_back(std::move(message));
}

// ---- the parent's end ----

ParentLink::ParentLink(Channel& channel, Mapping rings, UniqueFd own_wake, UniqueFd worker_wake,
                       std::optional<std::chrono::nanoseconds> spin)
    : channel_(channel),
      rings_(std::move(rings)),
      inbound_(ring_in_region(rings_.data(), kLinkRingCapacity, kToParent)),
      outbound_(ring_in_region(rings_.data(), kLinkRingCapacity, kToWorker)),
      own_wake_(std::move(own_wake)),
      worker_wake_(std::move(worker_wake)),
      spin_(spin) {
  // Not polling until the loop spins: the worker wakes us through the eventfd.
  inbound_.control().consumer_sleeping.store(1, std::memory_order_seq_cst);
}

ParentLink::~ParentLink() {
  if (registered_) LoopInternals::remove_spinner(Loop::current(), this);
}

Task<void> ParentLink::async_send(std::uint16_t kind, std::uint64_t request_id, std::span<const std::byte> payload,
                                  std::span<const int> fds) {
  if (fits_ring(payload, fds)) {
    co_await push(kind, request_id, payload);
    co_return;
  }
  if (gone_) throw ChannelClosed("forkpool: the worker is gone");
  co_await channel_.async_send(kind, request_id, payload, fds);
  Marker marker = marker_for(kind);
  co_await push(kRingOnSocket, request_id, marker);
}

Task<void> ParentLink::push(std::uint16_t kind, std::uint64_t request_id, std::span<const std::byte> payload) {
  for (;;) {
    if (gone_) throw ChannelClosed("forkpool: the worker is gone");
    if (outbound_.try_push(kind, request_id, payload)) break;
    co_await RoomAwaiter{*this, payload.size()};
  }
  wake_sleeping_consumer(outbound_.control(), worker_wake_.get());
}

bool ParentLink::ring_lacks_room_for(std::span<const std::byte> payload) {
  if (gone_ || broken_ || !fits_ring(payload, {})) return false;
  if (sender_) return true;
  try {
    return !outbound_.has_room(payload.size());
  } catch (const ProtocolError&) {
    return false;  // the next send or receive reports it
  }
}

bool ParentLink::try_send_now(std::uint16_t kind, std::uint64_t request_id, std::span<const std::byte> payload,
                              Publish publish) {
  if (gone_ || broken_ || sender_ || !fits_ring(payload, {})) return false;
  try {
    if (!outbound_.try_write(kind, request_id, payload)) return false;
  } catch (const ProtocolError&) {
    return false;  // the next send or receive reports it
  }
  if (publish == Publish::now) flush();
  return true;
}

void ParentLink::flush() noexcept {
  if (outbound_.publish()) wake_sleeping_consumer(outbound_.control(), worker_wake_.get());
}

bool ParentLink::RoomAwaiter::await_ready() {
  link.outbound_.control().producer_waiting.store(1, std::memory_order_seq_cst);
  return link.gone_ || link.outbound_.has_room(payload_size);
}

std::optional<Message> ParentLink::try_receive() {
  if (broken_) {
    if (gone_) throw ChannelClosed("forkpool: the worker is gone");
    return std::nullopt;
  }
  try {
    std::optional<RingRecord> record = inbound_.peek();
    if (!record) {
      if (inbound_.publish_room()) wake_waiting_producer(inbound_.control(), worker_wake_.get());
      if (gone_) throw ChannelClosed("forkpool: the worker is gone");
      return std::nullopt;
    }
    Message message;
    if (record->kind == kRingOnSocket) {
      message = announced_socket_message(*record);
    } else {
      message = message_of(*record);
    }
    if (inbound_.pop_later()) wake_waiting_producer(inbound_.control(), worker_wake_.get());
    return message;
  } catch (const ChannelClosed&) {
    if (gone_) throw;
    broken_ = true;  // the socket ended before the worker did: read the rest after its exit
    throw ProtocolError("forkpool: a worker's ring announced a socket message after the socket closed");
  } catch (...) {
    broken_ = true;  // nothing more is read from it: the caller drops the worker
    throw;
  }
}

// The socket message a marker announces. It was sent before the marker, so it is there; what
// a task wrote to the socket itself comes before it and is dropped unread (it cannot steer the
// pool), up to a bound.
Message ParentLink::announced_socket_message(const RingRecord& marker) {
  constexpr int kMaxUnannounced = 64;
  std::uint16_t kind = 0;
  if (marker.payload.size() != sizeof(Marker))
    throw ProtocolError("forkpool: a worker's ring holds a malformed marker");
  std::memcpy(&kind, marker.payload.data(), sizeof kind);
  for (int dropped = 0; dropped <= kMaxUnannounced; ++dropped) {
    std::optional<Message> next = channel_.try_receive();
    if (!next) throw ProtocolError("forkpool: a worker's ring announced a socket message that never came");
    if (next->kind == kind && next->request_id == marker.request_id) return std::move(*next);
  }
  throw ProtocolError("forkpool: a worker's socket holds more than " + std::to_string(kMaxUnannounced) +
                      " messages it never announced");
}

void ParentLink::ArrivalAwaiter::await_suspend(std::coroutine_handle<> receiver) {
  link.receiver_ = receiver;
  link.wait_began_ = Clock::now();
  if (!link.registered_) {
    LoopInternals::add_spinner(Loop::current(), &link);
    link.registered_ = true;
  }
}

void ParentLink::peer_gone() {
  gone_ = true;
  resume_waiters();
}

bool ParentLink::resume_waiters() {
  std::coroutine_handle<> sender;
  std::coroutine_handle<> receiver;
  if (sender_) {
    bool room = true;  // a broken tail is reported by the sender's own push
    try {
      room = gone_ || outbound_.has_room(sender_needs_);
    } catch (const ProtocolError&) {}
    if (room) sender = std::exchange(sender_, {});
  }
  if (receiver_ && arrived()) {
    receiver = std::exchange(receiver_, {});
    spin_.record(Clock::now() - wait_began_);
    LoopInternals::remove_spinner(Loop::current(), this);
    registered_ = false;
  }
  // Resumed last: either may end the worker's life, and this link with it.
  if (sender) sender.resume();
  if (receiver) receiver.resume();
  return sender || receiver;
}

Task<void> ParentLink::watch_wakes(std::stop_token stop) {
  for (;;) {
    int result = co_await wait_readable(own_wake_.get(), {.stop = stop});
    if (stop.stop_requested() || result == -ECANCELED) co_return;
    drain_eventfd(own_wake_.get());
    // The flag stays as the worker left it (clear): the loop announces its next sleep itself.
    resume_waiters();
  }
}

std::uint64_t ParentLink::worker_spin_polls() const noexcept {
  return outbound_.control().spin_polls.load(std::memory_order_relaxed);
}

std::chrono::nanoseconds ParentLink::spin_budget() {
  if (!expecting_ || !receiver_) return {};
  std::chrono::nanoseconds budget = spin_.budget();
  // Stored only when set: the worker reads this line after every entry it publishes.
  std::atomic<std::uint32_t>& sleeping = inbound_.control().consumer_sleeping;
  if (budget.count() > 0 && sleeping.load(std::memory_order_relaxed) != 0) sleeping.store(0, std::memory_order_relaxed);
  return budget;
}

bool ParentLink::poll() { return receiver_ && arrived() && resume_waiters(); }

bool ParentLink::prepare_to_sleep() {
  inbound_.control().consumer_sleeping.store(1, std::memory_order_seq_cst);
  return resume_waiters();
}

}  // namespace forkpool::detail
