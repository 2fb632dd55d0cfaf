#pragma once
// The most memory this process could ever have: the machine's RAM and swap, or less where its
// cgroup (a container's limit, a systemd slice) allows less. Shared memory is checked against it
// before any is taken: tmpfs (memfds, /dev/shm), unlike malloc, never refuses a size it cannot
// back, and takes pages until the OOM killer ends some process, not necessarily the one that asked.

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace forkpool::detail {

struct MemoryLimit {
  std::uint64_t bytes;
  std::string source;  // what sets it, for messages: "RAM and swap", or the cgroup file
};

// One of this process's memory cgroups, from /proc/self/cgroup: v2's unified group
// ("/sys/fs/cgroup/a/b") or v1's memory controller's ("/sys/fs/cgroup/memory/a/b").
struct MemoryCgroupDir {
  std::string dir;
  std::string path;  // the group's path in its hierarchy: "/a/b", "" for the root
  bool v1;
};
std::vector<MemoryCgroupDir> memory_cgroups_of_this_process();

// Found once per process (again in a forked child, which may be moved to another cgroup before it
// allocates). Any thread.
MemoryLimit memory_limit();

// Throws std::system_error (ENOMEM) naming `what`, the size and the limit when `bytes` is more
// than memory_limit(). Once the limit is known, a size within it costs one atomic load.
void check_memory_could_hold(std::size_t bytes, const char* what);

}  // namespace forkpool::detail
