// expect: take each by value or by const reference
#include <forkpool/forkpool.hpp>

void normalize(forkpool::Tensor& t) { t.data<float>()[0] = 1; }  // would write to a copy

int main() {
  forkpool::Pool pool({.processes = 1});
  forkpool::Tensor t = forkpool::Tensor::zeros({4}, forkpool::DType::f32);
  pool.apply_async(normalize, t).get();
}
