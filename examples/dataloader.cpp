// The DataLoader pattern of every training loop: worker processes build a batch per index, and
// the parent "trains" on the batches in order, with a progress line.
//
// Each batch is a new Tensor made in a worker; it reaches the parent as shared memory, never
// copied. When the parent drops a batch, its memory goes back to the worker that made it, still
// mapped and paged in on both sides: the next batch is written into warm memory.

#include <forkpool/forkpool.hpp>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <ranges>

namespace fp = forkpool;

constexpr std::int64_t kBatch = 64, kChannels = 3, kSide = 32;  // 64 images of 3×32×32 floats: 768 KiB

// A worker's job: the batch for `index` (here synthetic: each pixel a function of its place).
fp::Tensor make_batch(std::int64_t index) {
  fp::Tensor batch = fp::Tensor::empty({kBatch, kChannels, kSide, kSide}, fp::DType::f32);
  float* pixels = batch.data<float>();
  for (std::int64_t i = 0; i < batch.numel(); ++i) pixels[i] = static_cast<float>((index + i) % 255) / 255.0f;
  return batch;
}

// The parent's "training step": the batch's mean, and a check that batches arrive in order.
double train_step(const fp::Tensor& batch) {
  const float* pixels = batch.data<float>();
  double sum = 0;
  for (std::int64_t i = 0; i < batch.numel(); ++i) sum += pixels[i];
  return sum / static_cast<double>(batch.numel());
}

fp::Task<int> train(std::int64_t batches) {
  fp::Pool pool({.processes = 2});
  auto started = std::chrono::steady_clock::now();
  fp::Stream<fp::Tensor> loader = pool.imap(make_batch, std::views::iota(std::int64_t{0}, batches));
  auto consume = [&]() -> fp::Task<double> {
    double total = 0;
    std::int64_t index = 0;
    while (std::optional<fp::Tensor> batch = co_await loader.next()) {
      if (batch->data<float>()[0] != static_cast<float>(index % 255) / 255.0f) {
        std::printf("batch %lld arrived out of order\n", static_cast<long long>(index));
        co_return -1;
      }
      total += train_step(*batch);
      ++index;
    }  // each batch is dropped here: its memory goes home to its worker
    co_return total;
  };
  auto [total, shown] = co_await fp::when_all(consume(), fp::show_progress(loader, "  training"));
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  if (total < 0) co_return 1;
  fp::SharedMemoryStats memory = fp::shared_memory_stats();
  std::printf("%lld batches of %lld KiB in %.2f s: %.0f batches/s (mean pixel %.3f)\n",
              static_cast<long long>(batches), static_cast<long long>(kBatch * kChannels * kSide * kSide * 4 / 1024),
              seconds, static_cast<double>(batches) / seconds, total / static_cast<double>(batches));
  std::printf("shared memory in the parent: %zu slabs mapped, %zu descriptors\n", memory.slabs, memory.descriptors);
  co_return 0;
}

int main(int argc, char** argv) {
  fp::init();  // first: starts the fork server while the program has no threads
  std::int64_t batches = argc > 1 ? std::atoll(argv[1]) : 3000;
  return fp::run(train(batches));
}
