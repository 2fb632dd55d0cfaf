#include <forkpool/ipc/internal/mapping.hpp>

#include <sys/mman.h>

#include <forkpool/runtime/error.hpp>
#include <forkpool/runtime/private/errno.hpp>

namespace forkpool::detail {

Mapping Mapping::map(int fd, std::size_t size, int protection, off_t offset) {
  if (size == 0) return {};
  void* address = mmap(nullptr, size, protection, MAP_SHARED, fd, offset);
  if (address == MAP_FAILED) detail::throw_last_errno("mmap");
  return Mapping(address, size);
}

void Mapping::keep_from_forks() const noexcept {
  if (address_) (void)madvise(address_, size_, MADV_DONTFORK);
}

void Mapping::unmap() noexcept {
  munmap(address_, size_);
  address_ = nullptr;
  size_ = 0;
}

}  // namespace forkpool::detail
