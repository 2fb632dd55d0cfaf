// A DataLoader for libtorch, on worker processes: an image-like dataset whose get(index) runs in 2
// worker processes, samples collated in the workers into batch tensors in shared memory, consumed
// in order by a training loop, with a progress line. Then the same dataset and loop through
// libtorch's own DataLoader (2 worker threads), for the comparison.
//
//   torch_dataloader [samples] [epochs]

// The parts of <torch/torch.h> used here: it compiles in a third of the time.
#include <ATen/ATen.h>
#include <torch/data.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>

#include <forkpool/forkpool.hpp>
#include <forkpool/torch.hpp>

namespace fp = forkpool;
using Clock = std::chrono::steady_clock;

constexpr std::int64_t kBatch = 64;

// What a decoder would make of sample `index`: a 3x32x32 image, the same in both loaders.
at::Tensor make_image(std::size_t index) {
  return ::torch::arange(3 * 32 * 32, at::kFloat)
      .reshape({3, 32, 32})
      .mul(0.001 * static_cast<double>(index % 97))
      .sin();
}

// forkpool's dataset: size() and get(index), run in the workers.
struct Images {
  std::size_t samples;
  std::size_t size() const { return samples; }
  at::Tensor get(std::size_t index) const { return make_image(index); }
};

// libtorch's dataset: the same images, the target in the example.
struct TorchImages : ::torch::data::datasets::Dataset<TorchImages> {
  std::size_t samples;
  explicit TorchImages(std::size_t n) : samples(n) {}
  ::torch::data::Example<> get(std::size_t index) override {
    at::Tensor image = make_image(index);
    return {image, image.mean()};
  }
  ::torch::optional<std::size_t> size() const override { return samples; }
};

// A training step: a linear model learns each image's mean.
struct Trainer {
  ::torch::nn::Linear model{3 * 32 * 32, 1};
  ::torch::optim::SGD optimizer{model->parameters(), ::torch::optim::SGDOptions(0.01)};
  float step(const at::Tensor& images) {
    at::Tensor target = images.mean({1, 2, 3}).unsqueeze(1);
    optimizer.zero_grad();
    at::Tensor loss = ::torch::mse_loss(model->forward(images.flatten(1)), target);
    loss.backward();
    optimizer.step();
    return loss.item<float>();
  }
};

int main(int argc, char** argv) {
  std::size_t samples = argc > 1 ? std::strtoul(argv[1], nullptr, 10) : 10000;
  int epochs = argc > 2 ? std::atoi(argv[2]) : 2;
  ::torch::manual_seed(0);
  at::set_num_threads(1);  // the loaders' workers are the parallelism being compared

  Trainer forkpool_trainer;
  fp::DataLoader<Images, at::Tensor> loader(Images{samples},
                                            {.batch_size = kBatch,
                                             .shuffle = true,
                                             .num_workers = 2,
                                             .persistent_workers = true,
                                             .seed = 1,
                                             .progress = "forkpool DataLoader"},
                                            &fp::torch::collate);
  std::size_t batches = 0;
  float loss = 0;
  auto started = Clock::now();
  for (int epoch = 0; epoch < epochs; ++epoch)
    for (at::Tensor& batch : loader) {
      if (!fp::torch::is_shared(batch)) return 1;  // collated in a worker, in shared memory
      loss = forkpool_trainer.step(batch);
      ++batches;
    }
  double forkpool_rate = static_cast<double>(batches) / std::chrono::duration<double>(Clock::now() - started).count();
  std::printf(
      "forkpool::DataLoader (2 worker processes): %zu batches of %lld in %d epochs, %.0f batches/s, loss %.5f\n",
      batches, static_cast<long long>(kBatch), epochs, forkpool_rate, loss);

  Trainer torch_trainer;
  auto torch_loader = ::torch::data::make_data_loader<::torch::data::samplers::RandomSampler>(
      TorchImages(samples).map(::torch::data::transforms::Stack<>()),
      ::torch::data::DataLoaderOptions().batch_size(kBatch).workers(2));
  std::size_t torch_batches = 0;
  started = Clock::now();
  for (int epoch = 0; epoch < epochs; ++epoch)
    for (auto& batch : *torch_loader) {
      loss = torch_trainer.step(batch.data);
      ++torch_batches;
    }
  double torch_rate =
      static_cast<double>(torch_batches) / std::chrono::duration<double>(Clock::now() - started).count();
  std::printf("libtorch's DataLoader (2 worker threads):  %zu batches, %.0f batches/s, loss %.5f\n", torch_batches,
              torch_rate, loss);
  std::printf("forkpool / libtorch: %.2fx\n", forkpool_rate / torch_rate);
  return batches == torch_batches ? 0 : 1;
}
