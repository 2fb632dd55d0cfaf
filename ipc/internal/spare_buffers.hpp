#pragma once
// Message buffers kept for reuse on this thread. A pool's messages are often 64 KiB – 1 MiB: as
// fresh heap memory each would be faulted in page by page (and given back to the kernel when
// freed, with a TLB shootdown), as recycled memory only copied into. Bounded: at most
// kMaxSpareBytes kept per thread, none smaller than kMinSpareBytes or larger than kMaxSpareBuffer.
// Small buffers (a small task, a small result: one each per call at a million calls a second)
// are kept apart, up to kMaxSmallSpares of at most kMaxSmallSpare bytes, so that they cost no
// malloc either.

#include <cstddef>

#include <forkpool/ipc/codec.hpp>

namespace forkpool::detail {

inline constexpr std::size_t kMinSpareBytes = 16 * 1024;
inline constexpr std::size_t kMaxSpareBuffer = 8 * 1024 * 1024;
inline constexpr std::size_t kMaxSpareBytes = 64 * 1024 * 1024;
inline constexpr std::size_t kMaxSmallSpare = 1024;
inline constexpr std::size_t kMaxSmallSpares = 1024;

// An empty buffer, with the capacity of a kept one when there is one (the smallest that holds
// `at_least` bytes, else the largest; a small one when no large one is kept).
ByteBuffer take_spare_buffer(std::size_t at_least = 0);
// Keeps `buffer`'s memory for a later take_spare_buffer() on this thread, within the bounds.
void give_back_buffer(ByteBuffer&& buffer) noexcept;

}  // namespace forkpool::detail
