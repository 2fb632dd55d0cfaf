// libFuzzer target: arbitrary bytes as a ring's shared memory (what a hostile or killed peer can
// leave there), read by the real consumer. Every outcome must be records inside the ring or a
// ProtocolError; the consumer never reads outside the ring and never loops for ever.

#include <cstdint>
#include <cstring>
#include <vector>

#include <forkpool/ipc/private/ring.hpp>
#include <forkpool/runtime/error.hpp>

namespace {
constexpr std::size_t kCapacity = 4096;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace forkpool::detail;
  if (size < 8) return 0;
  // The first 8 bytes: the head the producer published; the rest: the entries.
  std::uint64_t head;
  std::memcpy(&head, data, 8);
  std::vector<std::byte> region(ring_region_size(kCapacity));
  std::memcpy(region.data() + kRingControlBytes, data + 8, std::min(size - 8, kCapacity));
  RingView view = ring_in_region(region.data(), kCapacity, 0);
  view.control->head.store(head);
  RingConsumer consumer(view);
  try {
    for (int i = 0; i < 1000; ++i) {
      std::optional<RingRecord> record = consumer.peek();
      if (!record) break;
      const std::byte* begin = view.entries;
      const std::byte* end = view.entries + kCapacity;
      if (record->payload.data() < begin || record->payload.data() + record->payload.size() > end) __builtin_trap();
      consumer.pop();
    }
  } catch (const forkpool::ProtocolError&) {}
  return 0;
}
