#include <forkpool/shm/private/slab_allocator.hpp>

#include <algorithm>
#include <bit>
#include <mutex>

#include <forkpool/runtime/private/process.hpp>
#include <forkpool/shm/internal/slab.hpp>
#include <forkpool/shm/internal/storage.hpp>

namespace forkpool {
namespace detail {
namespace {

constexpr std::size_t kPage = 4096;
constexpr std::size_t kSmallStep = 64;  // classes of 64, 128, 192 and 256 bytes, then quarters
constexpr std::size_t kSmallClasses = 4;

std::size_t round_up(std::size_t n, std::size_t to) { return (n + to - 1) / to * to; }

}  // namespace

SlabAllocator::SlabAllocator() : classes_(class_index(kLargestBlock) + 1) {
  for (std::size_t i = 0; i < classes_.size(); ++i) classes_[i].block_bytes = class_bytes(i);
}

SlabAllocator& SlabAllocator::instance() {
  static SlabAllocator* current = nullptr;
  static pid_t owner = 0;
  std::lock_guard lock(slab_lock());
  if (!current || owner != current_pid()) {
    // A forked child: the inherited allocator is left as it is (its slabs are the parent's).
    current = new SlabAllocator();
    owner = current_pid();
  }
  return *current;
}

std::size_t SlabAllocator::class_index(std::size_t bytes) noexcept {
  if (bytes <= kSmallClasses * kSmallStep) return bytes == 0 ? 0 : (bytes - 1) / kSmallStep;
  // 2^p < bytes <= 2^(p+1): four classes 2^p + q * 2^(p-2), q = 1..4.
  std::size_t p = std::bit_width(bytes - 1) - 1;
  std::size_t quarter = std::size_t{1} << (p - 2);
  std::size_t q = (bytes - (std::size_t{1} << p) + quarter - 1) / quarter;
  return kSmallClasses + (p - 8) * 4 + (q - 1);
}

std::size_t SlabAllocator::class_bytes(std::size_t index) noexcept {
  if (index < kSmallClasses) return (index + 1) * kSmallStep;
  std::size_t p = 8 + (index - kSmallClasses) / 4;
  std::size_t q = (index - kSmallClasses) % 4 + 1;
  return (std::size_t{1} << p) + q * (std::size_t{1} << (p - 2));
}

std::shared_ptr<detail::Storage> SlabAllocator::allocate(std::size_t bytes) {
  if (bytes > kLargestBlock) {
    // A slab of its own, unmapped when the block is freed.
    std::shared_ptr<detail::Slab> slab = detail::Slab::create(round_up(std::max<std::size_t>(bytes, 1), kPage));
    std::lock_guard lock(slab_lock());
    in_use_bytes_ += slab->size();
    slab->handed_out_ = 1;
    return slab->make_block(0, bytes);
  }
  SizeClass& size_class = classes_[class_index(bytes)];
  std::unique_lock lock(slab_lock());
  if (size_class.with_free.empty()) {
    lock.unlock();  // making and paging in a slab takes a while; other threads go on meanwhile
    std::size_t slab_bytes = round_up(size_class.block_bytes, slab_bytes_after(size_class.slabs.size()));
    std::shared_ptr<detail::Slab> slab = detail::Slab::create(slab_bytes);
    lock.lock();
    auto blocks = static_cast<std::uint32_t>(slab_bytes / size_class.block_bytes);
    slab->block_bytes_ = size_class.block_bytes;
    for (std::uint32_t i = blocks; i-- > 0;) slab->free_.push_back(i);  // block 0 on top
    cached_bytes_ += blocks * size_class.block_bytes;
    size_class.with_free.push_back(slab.get());
    size_class.slabs.push_back(std::move(slab));
  }
  detail::Slab& slab = *size_class.with_free.back();
  std::uint32_t block = slab.free_.back();
  slab.free_.pop_back();
  if (slab.free_.empty()) size_class.with_free.pop_back();
  ++slab.handed_out_;
  cached_bytes_ -= size_class.block_bytes;
  in_use_bytes_ += size_class.block_bytes;
  return slab.make_block(block * size_class.block_bytes, size_class.block_bytes);
}

void SlabAllocator::give_back(detail::Slab& slab, std::size_t offset) {
  std::vector<std::shared_ptr<detail::Slab>> unmapped;  // destroyed after the lock is let go
  std::lock_guard lock(slab_lock());
  if (slab.block_bytes_ == 0) {
    in_use_bytes_ -= slab.size();  // a slab of its own goes with its block's storage
    return;
  }
  std::size_t block_bytes = slab.block_bytes_;
  in_use_bytes_ -= block_bytes;
  --slab.handed_out_;
  if (slab.retired_) {
    if (slab.handed_out_ == 0) unmapped.push_back(remove_slab(slab));
    return;
  }
  SizeClass& size_class = classes_[class_index(block_bytes)];
  slab.free_.push_back(static_cast<std::uint32_t>(offset / block_bytes));
  cached_bytes_ += block_bytes;
  // The slab freed into last is the first one used again: its block is warm on every side.
  std::erase(size_class.with_free, &slab);
  size_class.with_free.push_back(&slab);
  unmapped = trim();
}

void SlabAllocator::retire(detail::Slab& slab) {
  std::vector<std::shared_ptr<detail::Slab>> unmapped;
  std::lock_guard lock(slab_lock());
  if (slab.block_bytes_ == 0 || slab.retired_ || !slab.owned()) return;
  slab.retired_ = true;
  cached_bytes_ -= slab.free_.size() * slab.block_bytes_;
  slab.free_.clear();
  std::erase(classes_[class_index(slab.block_bytes_)].with_free, &slab);
  if (slab.handed_out_ == 0) unmapped.push_back(remove_slab(slab));
}

std::shared_ptr<detail::Slab> SlabAllocator::remove_slab(detail::Slab& slab) {
  SizeClass& size_class = classes_[class_index(slab.block_bytes_)];
  std::erase(size_class.with_free, &slab);
  auto it = std::find_if(size_class.slabs.begin(), size_class.slabs.end(),
                         [&](const auto& held) { return held.get() == &slab; });
  std::shared_ptr<detail::Slab> removed = std::move(*it);
  size_class.slabs.erase(it);
  if (!slab.retired_) cached_bytes_ -= slab.free_.size() * slab.block_bytes_;
  return removed;
}

std::vector<std::shared_ptr<detail::Slab>> SlabAllocator::trim() {
  std::vector<std::shared_ptr<detail::Slab>> unmapped;
  // Largest classes first: the fewest slabs give back the most.
  for (std::size_t i = classes_.size(); i-- > 0 && cached_bytes_ > cache_limit_;) {
    std::vector<detail::Slab*> free_slabs;
    for (const auto& slab : classes_[i].slabs)
      if (slab->handed_out_ == 0) free_slabs.push_back(slab.get());
    for (detail::Slab* slab : free_slabs) {
      if (cached_bytes_ <= cache_limit_) break;
      unmapped.push_back(remove_slab(*slab));
    }
  }
  return unmapped;
}

SharedMemoryStats SlabAllocator::stats() {
  std::lock_guard lock(slab_lock());
  const MappedCounters& mapped = mapped_counters();
  return {static_cast<std::size_t>(mapped.slabs.load()), static_cast<std::size_t>(mapped.bytes.load()), in_use_bytes_,
          cached_bytes_, static_cast<std::size_t>(mapped.descriptors.load())};
}

void SlabAllocator::set_cache_limit(std::size_t bytes) {
  std::vector<std::shared_ptr<detail::Slab>> unmapped;
  std::lock_guard lock(slab_lock());
  cache_limit_ = bytes;
  unmapped = trim();
}

}  // namespace detail

SharedMemoryStats shared_memory_stats() { return detail::SlabAllocator::instance().stats(); }

void set_shared_memory_cache_limit(std::size_t bytes) { detail::SlabAllocator::instance().set_cache_limit(bytes); }

}  // namespace forkpool
