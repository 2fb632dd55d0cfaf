#pragma once
// What the DataLoader (its epochs are streams with a window of their own), Process (its pool's
// owner), tests and diagnostics read of a Pool beyond its public face. Not for users.

#include <memory>

#include <forkpool/pool/internal/pool_core.hpp>
#include <forkpool/pool/pool.hpp>

namespace forkpool::detail {

struct PoolInternals {
  static PoolCore& core(Pool& pool) { return *pool.core_; }
  static const std::shared_ptr<PoolCore>& shared_core(Pool& pool) { return pool.core_; }
};

}  // namespace forkpool::detail
