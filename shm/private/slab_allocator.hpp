#pragma once
// SlabAllocator: this process's shared memory for tensors. Requests are rounded up to a size class
// (64-byte steps up to 256 B, then four classes per power of two) and served from slabs of that
// class; a block freed here goes back on top of its slab's free list, still mapped and paged in
// on every side, and is the next one handed out. Requests larger than kLargestBlock get a slab
// of their own, unmapped as soon as they are freed.
//
// Freed blocks are kept up to the cache limit (set_shared_memory_cache_limit); beyond it, slabs
// whose blocks are all free go back to the kernel.
//
// Each process has its own: a forked child starts with an empty allocator and never hands out
// blocks of the slabs it inherited (the parent owns those).

#include <cstddef>
#include <memory>
#include <vector>

#include <forkpool/shm/shared_memory.hpp>

namespace forkpool::detail {

class Slab;
class Storage;

class SlabAllocator {
 public:
  static constexpr std::size_t kLargestBlock = std::size_t{64} << 20;
  // A size class's first slab; each slab it makes while it holds others is twice the last, up to
  // kLargestSlab: many kept tensors cost few descriptors (1 GiB of 48 KiB blocks: 20 slabs, where
  // slabs of 2 MiB would take 512), and a few cost little memory.
  static constexpr std::size_t kSlabBytes = std::size_t{2} << 20;
  static constexpr std::size_t kLargestSlab = std::size_t{64} << 20;
  // The bytes of a size class's next slab when it holds `slabs` already.
  static constexpr std::size_t slab_bytes_after(std::size_t slabs) noexcept {
    return slabs >= 5 ? kLargestSlab : kSlabBytes << slabs;
  }
  static_assert((kSlabBytes << 5) == kLargestSlab, "slab_bytes_after doubles five times");

  static constexpr std::size_t kDefaultCacheLimit = std::size_t{256} << 20;

  // The allocator of the calling process.
  static SlabAllocator& instance();

  // A block of at least `bytes` (its size is its class's). Throws std::system_error or
  // std::bad_alloc when no memory can be had.
  std::shared_ptr<Storage> allocate(std::size_t bytes);

  // Called by a block's storage as it is destroyed (slab_lock() not held).
  void give_back(Slab& slab, std::size_t offset);
  // A block of `slab` is shared outside any conversation that could say when it is let go: the
  // slab hands out no more blocks and goes when the blocks handed out so far come back.
  void retire(Slab& slab);

  SharedMemoryStats stats();
  void set_cache_limit(std::size_t bytes);

 private:
  struct SizeClass {
    std::size_t block_bytes = 0;
    std::vector<std::shared_ptr<Slab>> slabs;
    std::vector<Slab*> with_free;  // slabs with a free block, the last used on top
  };
  SlabAllocator();
  static std::size_t class_index(std::size_t bytes) noexcept;
  static std::size_t class_bytes(std::size_t index) noexcept;
  // Drops free slabs until the cached bytes are within the limit; returns them, to be
  // destroyed after slab_lock() is let go.
  std::vector<std::shared_ptr<Slab>> trim();
  std::shared_ptr<Slab> remove_slab(Slab& slab);

  std::vector<SizeClass> classes_;
  std::vector<std::shared_ptr<Slab>> own_slabs_;  // slabs of one block, while handed out
  std::size_t cache_limit_ = kDefaultCacheLimit;
  std::size_t cached_bytes_ = 0;
  std::size_t in_use_bytes_ = 0;
};

}  // namespace forkpool::detail
