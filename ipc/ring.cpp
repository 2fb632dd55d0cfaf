#include <forkpool/ipc/private/ring.hpp>

#include <cstring>
#include <string>

#include <forkpool/runtime/error.hpp>

namespace forkpool::detail {
namespace {

constexpr std::uint64_t padded(std::uint64_t bytes) { return (bytes + kRingAlign - 1) / kRingAlign * kRingAlign; }

[[noreturn]] void broken(const std::string& what) { throw ProtocolError("forkpool: shared-memory ring: " + what); }

}  // namespace

RingView ring_in_region(std::byte* region, std::size_t capacity, int index) noexcept {
  std::byte* base = region + static_cast<std::size_t>(index) * ring_region_size(capacity);
  return RingView{reinterpret_cast<RingControl*>(base), base + kRingControlBytes, capacity};
}

// A quarter of the ring: a large entry never waits for the whole ring to drain.
std::size_t ring_payload_max(std::size_t capacity) noexcept { return capacity / 4 - sizeof(RingEntry); }

std::uint64_t RingProducer::read_tail() {
  std::uint64_t tail = view_.control->tail.load(std::memory_order_seq_cst);
  if (tail < tail_seen_ || tail > head_)
    broken("the consumer's position " + std::to_string(tail) + " is outside [" + std::to_string(tail_seen_) + ", " +
           std::to_string(head_) + "]");
  tail_seen_ = tail;
  return tail;
}

void RingProducer::check_consumer() { read_tail(); }

bool RingProducer::has_room(std::size_t payload_size) {
  std::uint64_t need = padded(sizeof(RingEntry) + payload_size);
  std::uint64_t at = head_ % view_.capacity;
  if (view_.capacity - at < need) need += view_.capacity - at;  // a wrap entry first
  // The consumer only ever moves forward: the tail last seen is a safe bound, and reading its
  // cache line (which the consumer writes on every entry) only when that bound is short keeps the
  // line where the consumer is.
  if (view_.capacity - (head_ - tail_seen_) >= need) return true;
  return view_.capacity - (head_ - read_tail()) >= need;
}

bool RingProducer::try_push(std::uint16_t kind, std::uint64_t request_id, std::span<const std::byte> payload) {
  if (!try_write(kind, request_id, payload)) return false;
  publish();
  return true;
}

bool RingProducer::try_write(std::uint16_t kind, std::uint64_t request_id, std::span<const std::byte> payload) {
  if (!has_room(payload.size())) return false;
  std::uint64_t need = padded(sizeof(RingEntry) + payload.size());
  std::uint64_t at = head_ % view_.capacity;
  std::uint64_t next = head_;
  if (view_.capacity - at < need) {
    RingEntry wrap{static_cast<std::uint32_t>(view_.capacity - at), kRingWrap, 0, sequence_++, 0, 0, 0};
    std::memcpy(view_.entries + at, &wrap, sizeof wrap);
    next += wrap.size;
    at = 0;
  }
  RingEntry entry{static_cast<std::uint32_t>(need),           kind,       0, sequence_++,
                  static_cast<std::uint32_t>(payload.size()), request_id, 0};
  std::memcpy(view_.entries + at, &entry, sizeof entry);
  if (!payload.empty()) std::memcpy(view_.entries + at + sizeof entry, payload.data(), payload.size());
  head_ = next + need;
  return true;
}

bool RingProducer::publish() noexcept {
  if (published_ == head_) return false;
  published_ = head_;
  // The entries are whole before they show; seq_cst, as the sleep check that follows (link.cpp)
  // must not pass it.
  view_.control->head.store(head_, std::memory_order_seq_cst);
  return true;
}

std::optional<RingRecord> RingConsumer::peek() {
  std::uint64_t head = head_seen_;
  std::uint64_t cursor = tail_;
  std::uint32_t sequence = sequence_;
  for (;;) {
    if (head == cursor) {
      head = head_seen_ = view_.control->head.load(std::memory_order_acquire);
      if (head == cursor) return std::nullopt;
    }
    if (head < cursor || head - cursor > view_.capacity || (head - cursor) % kRingAlign != 0)
      broken("the producer's position " + std::to_string(head) + " is impossible after " + std::to_string(cursor));
    std::uint64_t at = cursor % view_.capacity;
    RingEntry entry;
    std::memcpy(&entry, view_.entries + at, sizeof entry);  // a copy: the producer may scribble
    if (entry.sequence != sequence)
      broken("entry " + std::to_string(entry.sequence) + " where " + std::to_string(sequence) + " was due");
    if (entry.size < sizeof entry || entry.size % kRingAlign != 0 || entry.size > view_.capacity - at ||
        entry.size > head - cursor)
      broken("an entry of " + std::to_string(entry.size) + " bytes does not fit where it is");
    ++sequence;
    if (entry.kind == kRingWrap) {
      if (entry.size != view_.capacity - at) broken("a wrap entry that does not reach the end");
      cursor += entry.size;
      continue;
    }
    if (padded(sizeof entry + std::uint64_t{entry.payload_size}) != entry.size)
      broken("an entry of " + std::to_string(entry.size) + " bytes claims a payload of " +
             std::to_string(entry.payload_size));
    pending_ = cursor + entry.size - tail_;
    pending_sequence_ = sequence;
    return RingRecord{entry.kind, entry.request_id,
                      std::span<const std::byte>(view_.entries + at + sizeof entry, entry.payload_size)};
  }
}

void RingConsumer::pop() noexcept {
  pop_later();
  publish_room();
}

bool RingConsumer::pop_later() noexcept {
  if (pending_ == 0) return false;
  tail_ += pending_;
  sequence_ = pending_sequence_;
  pending_ = 0;
  return tail_ - room_published_ >= view_.capacity / 4 && publish_room();  // a producer may wait for it
}

bool RingConsumer::publish_room() noexcept {
  if (room_published_ == tail_) return false;
  room_published_ = tail_;
  view_.control->tail.store(tail_, std::memory_order_seq_cst);  // as the head's store
  return true;
}

}  // namespace forkpool::detail
