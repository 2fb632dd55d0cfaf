#include <forkpool/worker/worker_info.hpp>

#include <random>

#include <forkpool/runtime/private/splitmix64.hpp>

namespace forkpool {
namespace {

std::optional<WorkerInfo>& current() {
  static std::optional<WorkerInfo> info;  // set once, before the worker runs anything of the user's
  return info;
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
  return splitmix64(splitmix64(base ^ splitmix64(static_cast<std::uint64_t>(id))) + generation);
}

std::uint64_t pool_seed_base(std::uint64_t requested) {
  if (requested != 0) return requested;
  std::random_device device;
  return (static_cast<std::uint64_t>(device()) << 32) | device();
}

}  // namespace detail
}  // namespace forkpool
