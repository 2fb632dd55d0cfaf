#pragma once
// SplitMix64's finalizer: consecutive inputs give unrelated outputs (worker seeds, sampler orders).

#include <cstdint>

namespace forkpool::detail {

constexpr std::uint64_t splitmix64(std::uint64_t x) noexcept {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

}  // namespace forkpool::detail
