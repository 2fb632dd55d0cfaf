#pragma once
// Message buffers kept for reuse on this thread. A pool's messages are often 64 KiB – 1 MiB: as
// fresh heap memory each would be faulted in page by page (and given back to the kernel when
// freed, with a TLB shootdown), as recycled memory only copied into. Bounded: at most
// kMaxSpareBytes kept per thread, none smaller than kMinSpareBytes or larger than kMaxSpareBuffer.
// Small buffers (a small task, a small result: one each per call at a million calls a second)
// are kept apart, up to kMaxSmallSpares of at most kMaxSmallSpare bytes, so that they cost no
// malloc either.

#include <array>
#include <cstddef>
#include <cstring>
#include <span>

#include <forkpool/ipc/codec.hpp>

namespace forkpool::detail {

inline constexpr std::size_t kMinSpareBytes = std::size_t{16} * 1024;
inline constexpr std::size_t kMaxSpareBuffer = std::size_t{8} * 1024 * 1024;
inline constexpr std::size_t kMaxSpareBytes = std::size_t{64} * 1024 * 1024;
inline constexpr std::size_t kMaxSmallSpare = 1024;
inline constexpr std::size_t kMaxSmallSpares = 1024;

// An empty buffer, with the capacity of a kept one when there is one (the smallest that holds
// `at_least` bytes, else the largest; a small one when no large one is kept).
ByteBuffer take_spare_buffer(std::size_t at_least = 0);
// Keeps `buffer`'s memory for a later take_spare_buffer() on this thread, within the bounds.
void keep_spare_buffer(ByteBuffer&& buffer) noexcept;
// As keep_spare_buffer; inline because most buffers given back hold no memory at all (an
// InlineBytes whose bytes fit inside it, a message without a payload).
inline void give_back_buffer(ByteBuffer&& buffer) noexcept {
  if (buffer.capacity() != 0) keep_spare_buffer(std::move(buffer));
}

// Bytes held inside the object when there are at most N of them (a task or a result of a few
// plain values costs no allocation), else in a buffer that comes from, and goes back to, this
// thread's spares.
template <std::size_t N>
class InlineBytes {
 public:
  static constexpr std::size_t kInlineBytes = N;

  InlineBytes() = default;
  explicit InlineBytes(std::span<const std::byte> bytes) { assign(bytes); }
  InlineBytes(const InlineBytes& other) { assign(other.bytes()); }
  InlineBytes(InlineBytes&&) noexcept = default;
  InlineBytes& operator=(const InlineBytes& other) {
    if (this != &other) assign(other.bytes());
    return *this;
  }
  InlineBytes& operator=(InlineBytes&&) noexcept = default;
  // Takes `buffer`'s bytes: copied inside when few (its memory goes back to the spares at once),
  // else the buffer itself.
  InlineBytes& operator=(ByteBuffer&& buffer) {
    if (buffer.size() <= N) {
      assign(buffer);
      give_back_buffer(std::move(buffer));
    } else {
      give_back_buffer(std::move(heap_));
      heap_ = std::move(buffer);
      size_ = kOnHeap;
    }
    return *this;
  }
  ~InlineBytes() { give_back_buffer(std::move(heap_)); }

  std::byte* data() noexcept { return size_ == kOnHeap ? heap_.data() : inline_.data(); }
  const std::byte* data() const noexcept { return size_ == kOnHeap ? heap_.data() : inline_.data(); }
  std::size_t size() const noexcept { return size_ == kOnHeap ? heap_.size() : size_; }
  std::span<const std::byte> bytes() const noexcept { return {data(), size()}; }
  operator std::span<const std::byte>() const noexcept { return bytes(); }

 private:
  static constexpr std::size_t kOnHeap = ~std::size_t{0};
  void assign(std::span<const std::byte> bytes) {
    if (bytes.size() > N) {
      if (heap_.capacity() < bytes.size()) {
        give_back_buffer(std::move(heap_));
        heap_ = take_spare_buffer(bytes.size());
      }
      heap_.assign(bytes.begin(), bytes.end());
      size_ = kOnHeap;
      return;
    }
    if (!bytes.empty()) std::memcpy(inline_.data(), bytes.data(), bytes.size());
    size_ = bytes.size();
  }

  ByteBuffer heap_;
  std::size_t size_ = 0;  // kOnHeap: the bytes are heap_'s
  std::array<std::byte, N> inline_;
};

}  // namespace forkpool::detail
