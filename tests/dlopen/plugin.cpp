// A module that uses forkpool, as a Python extension does: the host dlopen()s it, and its
// dependencies, libforkpool (and libforkpool-torch, with -DWITH_TORCH), come in by dlopen() too.
#include <numeric>
#include <vector>

#include <forkpool/forkpool.hpp>
#ifdef WITH_TORCH
#include <ATen/ATen.h>

#include <forkpool/torch.hpp>
#endif

namespace {

int square(int x) { return x * x; }

#ifdef WITH_TORCH
at::Tensor doubled(at::Tensor t) { return t * 2; }
#endif

}  // namespace

// 0 when a pool of two workers ran 100 squares (and a libtorch tensor's round trip) right.
extern "C" __attribute__((visibility("default"))) int forkpool_dlopen_check() {
  forkpool::Pool pool(forkpool::PoolOptions{.processes = 2});
  std::vector<int> inputs(100);
  std::iota(inputs.begin(), inputs.end(), 0);
  std::vector<int> squares = pool.map_async(square, inputs).get();
  long sum = std::accumulate(squares.begin(), squares.end(), 0L);
  if (sum != 328350) return 1;
#ifdef WITH_TORCH
  at::Tensor back = pool.apply_async(doubled, at::arange(16, at::kFloat)).get();
  if (!back.equal(at::arange(16, at::kFloat) * 2)) return 2;
#endif
  pool.close();
  forkpool::run(pool.join());
  return 0;
}
