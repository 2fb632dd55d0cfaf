#include <forkpool/ipc/internal/spare_buffers.hpp>

#include <vector>

namespace forkpool::detail {
namespace {

struct Spares {
  std::vector<ByteBuffer> buffers;
  std::size_t bytes = 0;
  std::vector<ByteBuffer> small;  // at most kMaxSmallSpare bytes each, used last-in first-out
};

Spares& spares() {
  thread_local Spares kept;
  return kept;
}

void keep_small(ByteBuffer&& buffer) noexcept {
  Spares& kept = spares();
  if (kept.small.size() >= kMaxSmallSpares) return;
  try {
    buffer.clear();
    kept.small.push_back(std::move(buffer));
  } catch (...) {
    // No room to remember it: it is freed as it would have been.
  }
}

}  // namespace

ByteBuffer take_spare_buffer(std::size_t at_least) {
  Spares& kept = spares();
  if (kept.buffers.empty()) {
    if (kept.small.empty() || at_least > kMaxSmallSpare) return {};
    ByteBuffer buffer = std::move(kept.small.back());
    kept.small.pop_back();
    return buffer;
  }
  std::size_t best = 0;
  for (std::size_t i = 1; i < kept.buffers.size(); ++i) {
    std::size_t capacity = kept.buffers[i].capacity(), best_capacity = kept.buffers[best].capacity();
    bool fits = capacity >= at_least, best_fits = best_capacity >= at_least;
    if (fits != best_fits ? fits : (fits ? capacity < best_capacity : capacity > best_capacity)) best = i;
  }
  ByteBuffer buffer = std::move(kept.buffers[best]);
  kept.buffers[best] = std::move(kept.buffers.back());
  kept.buffers.pop_back();
  kept.bytes -= buffer.capacity();
  return buffer;
}

void keep_spare_buffer(ByteBuffer&& buffer) noexcept {
  std::size_t capacity = buffer.capacity();
  if (capacity > 0 && capacity <= kMaxSmallSpare) return keep_small(std::move(buffer));
  if (capacity < kMinSpareBytes || capacity > kMaxSpareBuffer) return;
  Spares& kept = spares();
  if (kept.bytes + capacity > kMaxSpareBytes) return;
  try {
    buffer.clear();
    kept.buffers.push_back(std::move(buffer));
    kept.bytes += capacity;
  } catch (...) {
    // No room to remember it: it is freed as it would have been.
  }
}

}  // namespace forkpool::detail
