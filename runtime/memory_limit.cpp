#include <forkpool/runtime/private/memory_limit.hpp>

#include <pthread.h>
#include <sys/sysinfo.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <fstream>
#include <limits>
#include <mutex>
#include <optional>
#include <sstream>
#include <system_error>

namespace forkpool::detail {
namespace {

constexpr std::uint64_t kUnlimited = std::numeric_limits<std::uint64_t>::max();

// A number from the first line of `path`, or from the line that starts with `key` in it: kUnlimited
// for "max" (cgroup v2's word for none), nullopt when there is no such file or line.
std::optional<std::uint64_t> read_bytes(const std::string& path, const std::string& key = {}) {
  std::ifstream file(path);
  for (std::string line; std::getline(file, line);) {
    std::istringstream words(line);
    std::string name, value;
    if (!key.empty()) {
      if (!(words >> name >> value) || name != key) continue;
    } else if (!(words >> value)) {
      return std::nullopt;
    }
    if (value == "max") return kUnlimited;
    try {
      return std::stoull(value);
    } catch (const std::exception&) {
      return std::nullopt;
    }
  }
  return std::nullopt;
}

std::uint64_t add_saturating(std::uint64_t a, std::uint64_t b) { return a > kUnlimited - b ? kUnlimited : a + b; }

// This process's cgroup limit on memory and swap together, the least of its own and its
// ancestors': cgroup v2 (memory.max and memory.swap.max at each level) or v1's memory controller
// (memory.stat's hierarchical limits, which already take the ancestors in). Swap counts only as
// far as the machine has any: a limit on memory and unlimited swap, without swap, is the memory's.
std::optional<MemoryLimit> cgroup_limit(std::uint64_t machine_swap) {
  std::optional<MemoryLimit> least;
  auto consider = [&](std::uint64_t memory, std::uint64_t swap, std::string source) {
    std::uint64_t bytes = add_saturating(memory, std::min(swap, machine_swap));
    if (bytes != kUnlimited && (!least || bytes < least->bytes)) least = MemoryLimit{bytes, std::move(source)};
  };
  for (const MemoryCgroupDir& group : memory_cgroups_of_this_process()) {
    if (!group.v1) {
      // The cgroup and each ancestor up to the root: "/a/b", "/a", "".
      for (std::string at = group.path;;) {
        std::string dir = "/sys/fs/cgroup" + at;
        if (std::optional<std::uint64_t> memory = read_bytes(dir + "/memory.max"))
          consider(*memory, read_bytes(dir + "/memory.swap.max").value_or(kUnlimited), dir + "/memory.max");
        std::size_t slash = at.rfind('/');
        if (at.empty() || slash == std::string::npos) break;
        at.resize(slash);
      }
    } else {
      std::string stat = group.dir + "/memory.stat";
      // memsw counts memory and swap together (absent without swap accounting).
      if (std::optional<std::uint64_t> memory = read_bytes(stat, "hierarchical_memory_limit")) {
        std::uint64_t both = read_bytes(stat, "hierarchical_memsw_limit").value_or(kUnlimited);
        consider(*memory, both > *memory ? both - *memory : 0, stat);
      }
    }
  }
  return least;
}

MemoryLimit find_memory_limit() {
  MemoryLimit limit{kUnlimited, "RAM and swap"};
  std::uint64_t swap = 0;
  struct sysinfo machine {};
  if (sysinfo(&machine) == 0) {
    limit.bytes = (static_cast<std::uint64_t>(machine.totalram) + machine.totalswap) * machine.mem_unit;
    swap = static_cast<std::uint64_t>(machine.totalswap) * machine.mem_unit;
  }
  if (std::optional<MemoryLimit> group = cgroup_limit(swap); group && group->bytes < limit.bytes)
    limit = MemoryLimit{group->bytes, "the limit of this process's cgroup, " + group->source};
  return limit;
}

// Found at the first call in each process: a forked child looks again.
struct LimitCache {
  std::mutex lock;
  std::atomic<std::uint64_t> bytes{0};  // limit->bytes once found: the check's fast path reads only this
  std::optional<MemoryLimit> limit;
};
LimitCache& cache() {
  static auto* made = [] {
    auto* cache = new LimitCache();
    pthread_atfork([] { detail::cache().lock.lock(); }, [] { detail::cache().lock.unlock(); },
                   [] {
                     detail::cache().limit.reset();
                     detail::cache().bytes.store(0, std::memory_order_relaxed);
                     detail::cache().lock.unlock();
                   });
    return cache;
  }();
  return *made;
}

}  // namespace

std::vector<MemoryCgroupDir> memory_cgroups_of_this_process() {
  std::vector<MemoryCgroupDir> groups;
  std::ifstream lines("/proc/self/cgroup");
  for (std::string line; std::getline(lines, line);) {
    // "hierarchy-id:controllers:path"; v2's line is "0::path".
    std::size_t first = line.find(':'), second = line.find(':', first + 1);
    if (first == std::string::npos || second == std::string::npos) continue;
    std::string controllers = line.substr(first + 1, second - first - 1), path = line.substr(second + 1);
    if (path == "/") path.clear();
    if (controllers.empty())
      groups.push_back({"/sys/fs/cgroup" + path, path, false});
    else if (("," + controllers + ",").find(",memory,") != std::string::npos)
      groups.push_back({"/sys/fs/cgroup/memory" + path, path, true});
  }
  return groups;
}

MemoryLimit memory_limit() {
  LimitCache& known = cache();
  std::lock_guard lock(known.lock);
  if (!known.limit) {
    known.limit = find_memory_limit();
    known.bytes.store(known.limit->bytes, std::memory_order_relaxed);
  }
  return *known.limit;
}

void check_memory_could_hold(std::size_t bytes, const char* what) {
  std::uint64_t known = cache().bytes.load(std::memory_order_relaxed);
  if (known != 0 && bytes <= known) return;
  MemoryLimit limit = memory_limit();
  if (bytes > limit.bytes)
    throw std::system_error(ENOMEM, std::generic_category(),
                            std::string(what) + ": " + std::to_string(bytes) +
                                " bytes is more than this process may have (" + std::to_string(limit.bytes) +
                                " bytes: " + limit.source + ")");
}

}  // namespace forkpool::detail
