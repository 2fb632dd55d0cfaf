#include <forkpool/sync/shared_value.hpp>

#include <sys/mman.h>

#include <algorithm>

#include <forkpool/ipc/internal/mapping.hpp>
#include <forkpool/ipc/private/memfd.hpp>
#include <forkpool/runtime/private/memory_limit.hpp>

namespace forkpool::detail {

struct SharedBytes::Memory {
  UniqueFd fd;
  Mapping mapping;
  std::size_t size;
};

// A memfd of at least one byte: an empty Array still has a descriptor to pass.
SharedBytes::SharedBytes(std::size_t size) : lock_() {
  check_memory_could_hold(size, "forkpool: a shared Value or Array");
  UniqueFd fd = create_memfd("forkpool-value", std::max<std::size_t>(size, 1));
  seal_size(fd.get());
  Mapping mapping = Mapping::map(fd.get(), std::max<std::size_t>(size, 1), PROT_READ | PROT_WRITE);
  memory_ = std::unique_ptr<Memory>(new Memory{std::move(fd), std::move(mapping), size});
}

SharedBytes::SharedBytes(std::unique_ptr<Memory> memory, RLock lock)
    : memory_(std::move(memory)), lock_(std::move(lock)) {}
SharedBytes::~SharedBytes() = default;

std::byte* SharedBytes::data() const noexcept { return memory_->mapping.data(); }
std::size_t SharedBytes::size() const noexcept { return memory_->size; }

void SharedBytes::encode(Writer& w, const std::shared_ptr<const SharedBytes>& self) const {
  w.write(static_cast<std::uint64_t>(memory_->size));
  w.write_fd(memory_->fd.get(), self);
  w.write(lock_);
}

std::shared_ptr<SharedBytes> SharedBytes::decode(Reader& r, std::size_t element_size) {
  auto size = r.read<std::uint64_t>();
  UniqueFd fd = r.read_fd();
  RLock lock = r.read<RLock>();
  if (size % element_size != 0) r.fail("a shared Value or Array of a size its type does not divide");
  std::size_t mapped = std::max<std::uint64_t>(size, 1);
  if (check_sealed_memfd(fd.get(), mapped, "forkpool: a shared Value's or Array's memory") < mapped)
    r.fail("a shared Value or Array smaller than it says");
  Mapping mapping = Mapping::map(fd.get(), mapped, PROT_READ | PROT_WRITE);
  auto memory = std::unique_ptr<Memory>(new Memory{std::move(fd), std::move(mapping), static_cast<std::size_t>(size)});
  return std::shared_ptr<SharedBytes>(new SharedBytes(std::move(memory), std::move(lock)));
}

}  // namespace forkpool::detail
