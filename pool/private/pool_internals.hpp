#pragma once
// What tests, diagnostics and Process (its pool's owner) read of a Pool beyond its public face.
// Not installed.

#include <forkpool/pool/internal/pool_core.hpp>
#include <forkpool/pool/pool.hpp>

namespace forkpool::detail {

struct PoolInternals {
  static PoolCore& core(Pool& pool) { return *pool.core_; }
};

}  // namespace forkpool::detail
