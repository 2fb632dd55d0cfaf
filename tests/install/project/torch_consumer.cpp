// forkpool-torch found through CMake's forkpool::torch (or `pkg-config forkpool-torch`): a libtorch
// tensor in shared memory crosses to a worker and back.
#include <forkpool/forkpool.hpp>
#include <forkpool/torch.hpp>

namespace fp = forkpool;

at::Tensor twice(at::Tensor t) { return t.mul(2); }

int main() {
  fp::Pool pool({.processes = 1});
  at::Tensor t = fp::torch::zeros({4}, at::kFloat);
  t.add_(1);
  at::Tensor back = pool.apply_async(twice, t).get();
  return fp::torch::is_shared(t) && back.sum().item<float>() == 8.0f ? 0 : 1;
}
