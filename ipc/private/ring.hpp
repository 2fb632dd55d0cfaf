#pragma once
// A single-producer single-consumer ring of messages in memory both processes map, so a message
// without descriptors crosses with two stores and no system call. Each side trusts nothing the
// other wrote: every entry, index and length read from the ring is checked, and what does not
// hold is a ProtocolError (the peer is then dropped; a peer killed in the middle of a write never
// published it, since an entry is published by one release store of the head after it is whole).
//
// Layout of one direction: a RingControl (head, tail and the sleep flags that make wake-ups
// happen only for a sleeper, each on its own cache line) and `capacity` bytes of entries.
// An entry is a RingEntry followed by its payload, padded to kRingAlign; an entry that does not
// fit before the end is preceded by a wrap entry that fills the rest.

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>

namespace forkpool::detail {

inline constexpr std::size_t kRingAlign = 32;

struct RingControl {
  // Each field on its own cache line, so that a side reads a line the other rewrites only when it
  // must: a line that crosses between the CPUs costs about as much as a short round trip.
  // Bytes published so far: the producer's.
  alignas(64) std::atomic<std::uint64_t> head{0};
  // "I wait for room": the producer's, read by the consumer after it gives room back.
  alignas(64) std::atomic<std::uint32_t> producer_waiting{0};
  // Bytes consumed so far: the consumer's.
  alignas(64) std::atomic<std::uint64_t> tail{0};
  // "I sleep": the consumer's, read by the producer after every publication (the producer wakes it).
  alignas(64) std::atomic<std::uint32_t> consumer_sleeping{0};
  // How often the consumer polled this ring while spinning (tests check that spin = 0 never does).
  alignas(64) std::atomic<std::uint64_t> spin_polls{0};
};
static_assert(std::atomic<std::uint64_t>::is_always_lock_free && std::atomic<std::uint32_t>::is_always_lock_free);

struct RingEntry {
  std::uint32_t size;  // the whole entry, header and padding included
  std::uint16_t kind;  // a message kind, or kRingWrap / kRingOnSocket
  std::uint16_t reserved;
  std::uint32_t sequence;  // entries counted from 0: a stale or forged entry shows
  std::uint32_t payload_size;
  std::uint64_t request_id;
  std::uint64_t reserved2;
};
static_assert(sizeof(RingEntry) == kRingAlign);

inline constexpr std::uint16_t kRingWrap = 0xffff;      // the rest of the buffer is unused
inline constexpr std::uint16_t kRingOnSocket = 0xfffe;  // the next message is the socket's next

// One direction's shared memory, as both sides see it: the control block, then the entries.
struct RingView {
  RingControl* control = nullptr;
  std::byte* entries = nullptr;
  std::size_t capacity = 0;  // a power of two, a multiple of kRingAlign
};

// The bytes one direction takes in the shared region: a page for its control block (entries
// never share its cache lines), then the entries.
inline constexpr std::size_t kRingControlBytes = 4096;
static_assert(sizeof(RingControl) <= kRingControlBytes);
constexpr std::size_t ring_region_size(std::size_t capacity) noexcept { return kRingControlBytes + capacity; }
// Direction `index` (0 or 1) of a region of two rings of `capacity` bytes each.
RingView ring_in_region(std::byte* region, std::size_t capacity, int index) noexcept;

// Largest payload an entry carries (larger messages travel on the socket).
std::size_t ring_payload_max(std::size_t capacity) noexcept;

class RingProducer {
 public:
  RingProducer() = default;
  explicit RingProducer(RingView view) : view_(view) {}

  // Appends one entry and publishes it; false when there is no room now. Throws ProtocolError
  // when the consumer's tail is impossible (it moved back, or past what was written).
  bool try_push(std::uint16_t kind, std::uint64_t request_id, std::span<const std::byte> payload);
  // As try_push, but the entry shows only at the next publish() (or try_push): a batch of
  // entries costs one seq_cst store, whose wait for the entries' cache lines is most of a push.
  bool try_write(std::uint16_t kind, std::uint64_t request_id, std::span<const std::byte> payload);
  // Publishes every entry written; false when there was none to publish.
  bool publish() noexcept;
  // Whether an entry of `payload_size` bytes would fit now.
  bool has_room(std::size_t payload_size);
  // Reads the consumer's position now (has_room reads it only when room is short) and checks it,
  // as every read does: a ProtocolError when it moved back or past what was written.
  void check_consumer();
  RingControl& control() const noexcept { return *view_.control; }

 private:
  std::uint64_t read_tail();
  RingView view_;
  std::uint64_t head_ = 0;       // ours: the shared copy is only ever written by us
  std::uint64_t published_ = 0;  // the shared copy: entries up to head_ are written, not shown
  std::uint64_t tail_seen_ = 0;  // the consumer's tail as last read (checked to never move back)
  std::uint32_t sequence_ = 0;
};

// An entry as the consumer sees it; `payload` points into the ring until pop().
struct RingRecord {
  std::uint16_t kind;
  std::uint64_t request_id;
  std::span<const std::byte> payload;
};

class RingConsumer {
 public:
  RingConsumer() = default;
  explicit RingConsumer(RingView view) : view_(view) {}

  // The oldest entry, checked, or nothing when the ring is empty. Throws ProtocolError when what
  // the producer wrote breaks the layout. The entry stays until pop().
  std::optional<RingRecord> peek();
  // True when an entry is published (unchecked: peek() says what it is).
  // seq_cst: after a side announces sleep, this load must see a head published before it looked.
  // Entries already seen published need no load.
  bool ready() const noexcept {
    return head_seen_ != tail_ || view_.control->head.load(std::memory_order_seq_cst) != tail_;
  }
  // Consumes the entry peek() returned and publishes the room.
  void pop() noexcept;
  // As pop(), but the room shows only at the next publish_room() (or pop()), or once a quarter
  // of the ring is held back: a batch of entries costs one seq_cst store. True when it published.
  bool pop_later() noexcept;
  // Publishes the room of every entry consumed; false when there was none to publish.
  bool publish_room() noexcept;
  RingControl& control() const noexcept { return *view_.control; }

 private:
  RingView view_;
  std::uint64_t tail_ = 0;
  std::uint64_t room_published_ = 0;  // the shared copy of tail_
  // The producer's head as last read: entries up to it are whole and ours to read, so its line
  // (which the producer writes on every publish) is read again only once they are all read.
  std::uint64_t head_seen_ = 0;
  std::uint64_t pending_ = 0;  // bytes of the entry peek() returned (a wrap before it included)
  std::uint32_t sequence_ = 0;
  std::uint32_t pending_sequence_ = 0;  // sequence_ after pop()
};

}  // namespace forkpool::detail
