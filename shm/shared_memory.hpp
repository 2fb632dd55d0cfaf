#pragma once
// This process's shared memory for tensors: what it maps and what it keeps for reuse.
//
// Tensors are carved out of shared slabs (sealed memfds) that a process maps once. Memory a
// tensor let go of is reused for the next tensor of that process, already mapped and paged in.
// Memory freed but kept for reuse is bounded by the cache limit; beyond it, slabs whose memory is
// all free go back to the kernel. (Only whole slabs can: free blocks in a slab that still has a
// block in use stay cached above the limit.)
//
// Any thread may call these.

#include <cstddef>

namespace forkpool {

struct SharedMemoryStats {
  std::size_t slabs;         // slabs mapped here: made by this process or received from others
  std::size_t mapped_bytes;  // shared memory mapped here for tensors (slabs and other storages)
  std::size_t in_use_bytes;  // blocks this process handed out that are held here or by a peer
  std::size_t cached_bytes;  // blocks freed here and kept for reuse
  std::size_t descriptors;   // descriptors held for tensor memory
};

SharedMemoryStats shared_memory_stats();

// Freed memory this process keeps for reuse, at most (default 256 MiB).
void set_shared_memory_cache_limit(std::size_t bytes);

}  // namespace forkpool
