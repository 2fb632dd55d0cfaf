// Hogwild-style training: ranks update one shared parameter tensor in place, as
// torch.multiprocessing's Hogwild example. Each rank fits w to a target by gradient steps on
// its own samples; the tensor is the same memory in every rank, and a Lock guards the update.
//
//   examples/hogwild [ranks] [steps]

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>

#include <forkpool/forkpool.hpp>

namespace fp = forkpool;

constexpr std::int64_t kParameters = 4096;

float target(std::int64_t i) { return std::sin(static_cast<float>(i) * 0.01f); }

// One rank: `steps` noisy gradient steps of 0.5 * |w - target|^2, on a random tenth of w each.
void train(int rank, fp::Tensor w, fp::Lock lock, int steps) {
  std::mt19937_64 rng(fp::worker_info()->seed);  // a seed of its own (worker_info)
  std::uniform_int_distribution<std::int64_t> pick(0, kParameters - 1);
  std::normal_distribution<float> noise(0.0f, 0.01f);
  float* p = w.data<float>();
  for (int step = 0; step < steps; ++step) {
    std::lock_guard guard(lock);  // a step's update is whole: no rank sees half of another's
    for (int k = 0; k < kParameters / 10; ++k) {
      std::int64_t i = pick(rng);
      p[i] -= 0.1f * (p[i] - target(i) + noise(rng));
    }
  }
  (void)rank;
}

float loss(const fp::Tensor& w) {
  double sum = 0;
  for (std::int64_t i = 0; i < kParameters; ++i) sum += std::pow(w.data<float>()[i] - target(i), 2);
  return static_cast<float>(sum / kParameters);
}

int main(int argc, char** argv) {
  fp::init();
  int ranks = argc > 1 ? std::atoi(argv[1]) : 4;
  int steps = argc > 2 ? std::atoi(argv[2]) : 400;
  fp::Tensor w = fp::Tensor::zeros({kParameters}, fp::DType::f32);  // shared memory
  fp::Lock lock;
  std::printf("loss before: %.4f\n", loss(w));
  fp::spawn(train, ranks, fp::SpawnOptions{.start_method = fp::StartMethod::forkserver}, w, lock, steps);
  float after = loss(w);
  std::printf("loss after %d ranks x %d steps: %.4f\n", ranks, steps, after);
  return after < 0.01f ? 0 : 1;
}
