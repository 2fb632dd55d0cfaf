#include <forkpool/pool/worker_info.hpp>

#include <random>

namespace forkpool {
namespace {

std::optional<WorkerInfo>& current() {
  static std::optional<WorkerInfo> info;  // set once, before the worker runs anything of the user's
  return info;
}

// SplitMix64's finalizer: consecutive inputs give unrelated outputs.
std::uint64_t mix(std::uint64_t x) noexcept {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

}  // namespace

std::optional<WorkerInfo> worker_info() { return current(); }

namespace detail {

void set_worker_info(WorkerInfo info) { current() = info; }

namespace {
std::optional<pid_t>& parent_slot() {
  static std::optional<pid_t> parent;
  return parent;
}
}  // namespace

void set_starting_parent(pid_t parent) { parent_slot() = parent; }
std::optional<pid_t> starting_parent() { return parent_slot(); }

std::uint64_t worker_seed(std::uint64_t base, int id, std::uint64_t generation) noexcept {
  return mix(mix(base ^ mix(static_cast<std::uint64_t>(id))) + generation);
}

std::uint64_t pool_seed_base(std::uint64_t requested) {
  if (requested != 0) return requested;
  std::random_device device;
  return (static_cast<std::uint64_t>(device()) << 32) | device();
}

}  // namespace detail
}  // namespace forkpool
