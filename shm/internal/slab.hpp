#pragma once
// Slab: one sealed memfd that a process maps once and carves tensor storages ("blocks") out of.
//
// The process that made a slab owns it: its SlabAllocator hands the blocks out and takes them
// back, already mapped and paged in. Another process maps a slab the first time a block of it
// reaches that process and keeps it mapped for as long as the owner keeps the slab; every block of
// it that crosses after that costs no descriptor, no mmap and no munmap (shm/private/peer_memory.hpp).
//
// A process that maps a slab can read and write all of it, not only the blocks it was given:
// workers run the same program as the parent and are trusted as its threads would be.
//
// Thread safety: everything here may be called on any thread; one process-wide lock guards the
// slabs' bookkeeping (slab_lock()), held across fork() so that a child never inherits it taken.

#include <sys/stat.h>
#include <sys/types.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include <forkpool/ipc/internal/mapping.hpp>
#include <forkpool/runtime/unique_fd.hpp>

namespace forkpool::detail {

class Storage;
class SlabAllocator;

// Lending's bookkeeping (lending.hpp) is told when what it lent or borrowed is let go in this
// process: a storage released by its last holder, a slab unmapped, each on the thread that
// dropped it last (any thread). A listener hears only what it asked for (notify_on_release).
class ReleaseListener {
 public:
  virtual ~ReleaseListener() = default;
  virtual void storage_released(std::uint64_t /*storage_id*/) {}
  virtual void slab_released(std::uint64_t /*slab_id*/) {}
};

class Slab : public std::enable_shared_from_this<Slab> {
 public:
  // A new slab of `bytes` made by this process: its memory reserved (a shortage is an exception
  // here, never SIGBUS later), mapped, paged in and sealed against resizing. Throws
  // std::system_error (or std::bad_alloc) when the memory cannot be had.
  static std::shared_ptr<Slab> create(std::size_t bytes);
  // A slab another process made, received as `fd`: validated (a memfd sealed against resizing,
  // at least `min_bytes` long) before anything is mapped, then mapped and paged in. A slab this
  // process maps already comes back as it is. Throws ProtocolError.
  static std::shared_ptr<Slab> adopt(UniqueFd fd, std::size_t min_bytes);
  // In a helper process that closed the descriptors it inherited: slabs mapped before the fork
  // are not found by adopt() any more.
  static void forget_inherited() noexcept;
  // In a process that must not keep its parent's memory alive (the fork server): the slabs
  // mapped before the fork are unmapped here as well. Nothing inherited may be touched after.
  static void unmap_inherited() noexcept;

  ~Slab();
  Slab(const Slab&) = delete;
  Slab& operator=(const Slab&) = delete;

  // Unique among this process's slabs and never reused: the name a peer knows the slab by.
  std::uint64_t id() const noexcept { return id_; }
  std::byte* data() const noexcept { return mapping_.data(); }
  std::size_t size() const noexcept { return mapping_.size(); }
  int fd() const noexcept { return fd_.get(); }
  // Made by this process (a forked child does not own what it inherited).
  bool owned() const noexcept;

  // The storage of the block at `offset` that this process holds, or null.
  std::shared_ptr<Storage> live_block(std::size_t offset);
  // A received block [offset, offset + bytes): the storage this process holds for it already, or
  // a new one. Null when that is not a valid block here: outside the slab, a held block of
  // another length, or a block of a slab this process owns that is not handed out.
  std::shared_ptr<Storage> receive_block(std::size_t offset, std::size_t bytes);

  // `listener` is told when this slab is unmapped here (unless it is gone by then).
  void notify_on_release(const std::shared_ptr<ReleaseListener>& listener);

 private:
  friend class Storage;
  friend class detail::SlabAllocator;
  Slab();
  // Registers a slab just mapped: adopt() finds it by inode, and the stats count it.
  static void remember(const std::shared_ptr<Slab>& slab, const struct stat& st);
  std::shared_ptr<Storage> make_block(std::size_t offset, std::size_t bytes);  // slab_lock() held
  // The block's storage is being destroyed.
  void block_released(std::size_t offset) noexcept;

  std::uint64_t id_;
  pid_t owner_ = 0;  // 0: another process's
  UniqueFd fd_;
  Mapping mapping_;
  dev_t device_ = 0;
  ino_t inode_ = 0;
  using LiveBlocks = std::unordered_map<std::size_t, std::weak_ptr<Storage>>;
  LiveBlocks live_;                   // by offset; slab_lock()
  LiveBlocks::node_type spare_live_;  // the entry of the last block let go of, for the next; slab_lock()
  std::vector<std::weak_ptr<ReleaseListener>> listeners_;  // slab_lock()

  // The owning allocator's bookkeeping, under slab_lock().
  std::size_t block_bytes_ = 0;      // 0: one block of any size (a slab of its own)
  std::vector<std::uint32_t> free_;  // free block indices, the last freed on top
  std::uint32_t handed_out_ = 0;     // blocks in use
  bool retired_ = false;             // no more blocks from it (a block escaped the allocator)
};

// The lock over all slab bookkeeping in this process.
std::mutex& slab_lock();

// Tensor memory this process maps, for shared_memory_stats().
struct MappedCounters {
  std::atomic<std::int64_t> slabs{0}, bytes{0}, descriptors{0};
  void add(std::int64_t slab_count, std::int64_t byte_count, std::int64_t descriptor_count) noexcept {
    slabs.fetch_add(slab_count, std::memory_order_relaxed);
    bytes.fetch_add(byte_count, std::memory_order_relaxed);
    descriptors.fetch_add(descriptor_count, std::memory_order_relaxed);
  }
};
MappedCounters& mapped_counters();

}  // namespace forkpool::detail
