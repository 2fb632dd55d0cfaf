#pragma once
// Mapping: sole owner of one mmap()ed region; unmaps it exactly once.

#include <sys/types.h>

#include <cstddef>
#include <span>
#include <utility>

namespace forkpool::detail {

class Mapping {
 public:
  Mapping() noexcept = default;
  // Maps `size` bytes of `fd` from `offset`, shared. A size of 0 gives an empty mapping.
  // Throws std::system_error when mmap fails.
  static Mapping map(int fd, std::size_t size, int protection, off_t offset = 0);

  Mapping(Mapping&& other) noexcept
      : address_(std::exchange(other.address_, nullptr)), size_(std::exchange(other.size_, 0)) {}
  Mapping& operator=(Mapping&& other) noexcept {
    if (this != &other) {
      reset();
      address_ = std::exchange(other.address_, nullptr);
      size_ = std::exchange(other.size_, 0);
    }
    return *this;
  }
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  ~Mapping() { reset(); }

  std::byte* data() const noexcept { return static_cast<std::byte*>(address_); }
  std::size_t size() const noexcept { return size_; }
  std::span<std::byte> bytes() const noexcept { return {data(), size_}; }
  void reset() noexcept {
    if (address_) unmap();
  }
  // Processes forked from now on do not inherit it (MADV_DONTFORK): for memory shared with one
  // child, which the siblings forked beside it must not reach.
  void keep_from_forks() const noexcept;
  // Gives the mapping up without unmapping it: it stays until the process ends.
  void leak() noexcept {
    address_ = nullptr;
    size_ = 0;
  }

 private:
  void unmap() noexcept;
  Mapping(void* address, std::size_t size) noexcept : address_(address), size_(size) {}
  void* address_ = nullptr;
  std::size_t size_ = 0;
};

}  // namespace forkpool::detail
