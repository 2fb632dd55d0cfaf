// The DataLoader of every training loop: an image-like dataset of 10,000 samples, shuffled and
// batched by worker processes, two epochs on the same (persistent) workers, with a progress line,
// and a "training step" in the parent.
//
// Each sample is made in a worker; the default collate stacks a batch of them into one tensor in
// shared memory, which reaches the parent without a copy. When the parent drops a batch, its
// memory goes back to the worker that made it, still mapped: the next batch is written into warm
// memory.
//
//   dataloader [samples] [epochs]

#include <forkpool/forkpool.hpp>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

namespace fp = forkpool;

constexpr std::int64_t kChannels = 3, kSide = 32;  // one 3×32×32 float image: 12 KiB

// The dataset the user writes: size() and get(index). Here synthetic: each pixel of image i is
// a function of i, so the parent can check what it got.
struct Images {
  std::size_t count;
  std::size_t size() const { return count; }
  fp::Tensor get(std::size_t index) const {
    fp::Tensor image = fp::Tensor::empty({kChannels, kSide, kSide}, fp::DType::f32);
    float value = static_cast<float>(index % 255) / 255.0f;
    std::fill_n(image.data<float>(), image.numel(), value);
    return image;
  }
};

// The parent's "training step": the batch's mean.
double train_step(const fp::Tensor& batch) {
  const float* pixels = batch.data<float>();
  const std::int64_t count = batch.numel();  // once: a call per element would cost more than the sum
  double sum = 0;
  for (std::int64_t i = 0; i < count; ++i) sum += pixels[i];
  return sum / static_cast<double>(count);
}

int main(int argc, char** argv) {
  fp::init();  // first: starts the fork server while the program has no threads
  std::size_t samples = argc > 1 ? std::strtoul(argv[1], nullptr, 10) : 10000;
  int epochs = argc > 2 ? std::atoi(argv[2]) : 2;
  fp::DataLoader loader(Images{samples}, {.batch_size = 64,
                                          .shuffle = true,
                                          .num_workers = 2,
                                          .persistent_workers = true,
                                          .seed = 1,
                                          .progress = "  training"});
  for (int epoch = 0; epoch < epochs; ++epoch) {
    auto started = std::chrono::steady_clock::now();
    double total = 0;
    std::size_t images = 0;
    for (fp::Tensor& batch : loader) {  // a 64×3×32×32 tensor in shared memory
      total += train_step(batch) * static_cast<double>(batch.shape()[0]);
      images += static_cast<std::size_t>(batch.shape()[0]);
    }
    double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    std::printf(
        "epoch %d: %zu batches of up to 64 images (768 KiB) in %.2f s: %.0f batches/s, %.0f images/s "
        "(mean pixel %.3f)\n",
        epoch, loader.size(), seconds, static_cast<double>(loader.size()) / seconds,
        static_cast<double>(images) / seconds, total / static_cast<double>(images));
    if (images != samples) return 1;
  }
  fp::SharedMemoryStats memory = fp::shared_memory_stats();
  std::printf("shared memory in the parent: %zu slabs mapped, %zu descriptors\n", memory.slabs, memory.descriptors);
  return 0;
}
