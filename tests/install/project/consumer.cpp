// The README's first program, built against an installed forkpool with nothing but
// `pkg-config forkpool`, and with CMake's find_package (tests/install/check.sh). Keep the two
// identical.
#include <forkpool/forkpool.hpp>
namespace fp = forkpool;

int square(int x) { return x * x; }
fp::Tensor fill_ones(fp::Tensor t) {
  std::fill_n(t.data<float>(), t.numel(), 1.0f);
  return t;
}

fp::Task<int> amain() {
  fp::Pool pool({.processes = 2});
  std::vector<int> xs{1, 2, 3};
  std::vector<int> ys = co_await pool.map(square, xs);             // {1, 4, 9}
  int y = co_await pool.apply_async(square, 7);                    // 49
  fp::Tensor t = fp::Tensor::zeros({1024, 1024}, fp::DType::f32);  // shared memory
  co_await pool.apply_async(fill_ones, t);                         // the worker wrote our memory: t is all ones
  pool.close();
  co_await pool.join();
  co_return ys[2] == 9 && y == 49 && t.data<float>()[0] == 1.0f ? 0 : 1;
}
int main() { return fp::run(amain()); }
