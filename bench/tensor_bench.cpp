// Tensor round trips through a worker (it touches the first and last element and returns the
// tensor), against sending the same bytes serialized through the channel: shared memory is flat
// in the size, serialization is linear.

#include <benchmark/benchmark.h>

#include <algorithm>
#include <ranges>
#include <string>
#include <vector>

#include <forkpool/data/dataloader.hpp>
#include <forkpool/pool/pool.hpp>
#include <forkpool/shm/tensor.hpp>
#include <forkpool/shm/private/slab_allocator.hpp>
#include <forkpool/shm/tensor.hpp>
#include <forkpool/shm/tensor_codec.hpp>

namespace fp = forkpool;

namespace {

fp::Tensor touch_ends(fp::Tensor t) {
  auto* bytes = static_cast<std::uint8_t*>(t.raw_data());
  bytes[0] += 1;
  bytes[t.nbytes() - 1] += 1;
  return t;
}

std::string touch_bytes(std::string bytes) {
  bytes.front() += 1;
  bytes.back() += 1;
  return bytes;
}

void BM_TensorRoundTrip(benchmark::State& state) {
  fp::Pool pool({.processes = 1});
  fp::Tensor t = fp::Tensor::zeros({state.range(0) / 4}, fp::DType::f32);
  auto body = [&]() -> fp::Task<void> {
    co_await pool.apply_async(touch_ends, t);  // the worker maps it once
    for (auto _ : state) benchmark::DoNotOptimize((co_await pool.apply_async(touch_ends, t)).raw_data());
  };
  fp::run(body());
  state.SetLabel(std::to_string(state.range(0) >> 10) + " KiB");
}
BENCHMARK(BM_TensorRoundTrip)->Arg(4 << 10)->Arg(1 << 20)->Arg(64 << 20)->Arg(1 << 30)->UseRealTime();

// A new tensor every time: allocation, the descriptor's first crossing, the worker's mapping and
// the release that follows are all paid per round trip.
void BM_FreshTensorRoundTrip(benchmark::State& state) {
  fp::Pool pool({.processes = 1});
  auto body = [&]() -> fp::Task<void> {
    for (auto _ : state) {
      fp::Tensor t = fp::Tensor::empty({state.range(0) / 4}, fp::DType::f32);
      benchmark::DoNotOptimize((co_await pool.apply_async(touch_ends, t)).raw_data());
    }
  };
  fp::run(body());
  state.SetLabel(std::to_string(state.range(0) >> 10) + " KiB");
}
BENCHMARK(BM_FreshTensorRoundTrip)->Arg(4 << 10)->Arg(1 << 20)->UseRealTime();

void BM_SerializedBytesRoundTrip(benchmark::State& state) {
  fp::Pool pool({.processes = 1});
  std::string bytes(static_cast<std::size_t>(state.range(0)), '\0');
  auto body = [&]() -> fp::Task<void> {
    for (auto _ : state) benchmark::DoNotOptimize((co_await pool.apply_async(touch_bytes, bytes)).size());
  };
  fp::run(body());
  state.SetLabel(std::to_string(state.range(0)) + " B");
}
BENCHMARK(BM_SerializedBytesRoundTrip)
    ->Arg(256)
    ->Arg(1 << 10)
    ->Arg(4 << 10)
    ->Arg(16 << 10)
    ->Arg(64 << 10)
    ->Arg(256 << 10)
    ->Arg(1 << 20)
    ->Arg(64 << 20)
    ->UseRealTime();

}  // namespace

// The DataLoader pattern (../shared/anchors/py_dataloader.py): 2 workers each build a new float32
// batch per index, the parent consumes the batches in order and reads one element of each.
// Arg 0: batch bytes; arg 1: 1 recycled (slabs), 0 fresh (a slab of its own per batch, unmapped
// when freed: what a memfd per tensor costs). Reported as batches per second (items_per_second).
std::int64_t g_batch_floats = 0;
fp::Tensor build_batch(std::int64_t index) {
  fp::Tensor t = fp::Tensor::empty({g_batch_floats}, fp::DType::f32);
  std::fill_n(t.data<float>(), g_batch_floats, static_cast<float>(index));
  return t;
}

void BM_DataLoader(benchmark::State& state) {
  g_batch_floats = state.range(0) / 4;
  fp::Pool pool({.processes = 2});
  std::int64_t batches = 0;
  std::int64_t per_iteration = state.range(0) >= (8 << 20) ? 100 : 500;
  auto body = [&]() -> fp::Task<void> {
    // Warm-up, as the peer skips its first batches: each worker makes its slabs once.
    fp::Stream<fp::Tensor> warm = pool.imap(build_batch, std::views::iota(std::int64_t{0}, std::int64_t{20}));
    while (co_await warm.next()) {}
    for (auto _ : state) {
      fp::Stream<fp::Tensor> stream = pool.imap(build_batch, std::views::iota(std::int64_t{0}, per_iteration));
      std::int64_t expected = 0;
      while (std::optional<fp::Tensor> b = co_await stream.next()) {
        if (b->numel() != g_batch_floats || b->data<float>()[0] != static_cast<float>(expected) ||
            b->data<float>()[g_batch_floats - 1] != static_cast<float>(expected))
          state.SkipWithError("a batch out of order or not filled");
        ++expected;
        ++batches;
      }
    }
  };
  fp::run(body());
  state.SetItemsProcessed(batches);
  state.SetLabel(std::to_string(state.range(0) >> 10) + " KiB");
}
BENCHMARK(BM_DataLoader)->Arg(64 << 10)->Arg(1 << 20)->Arg(12 << 20)->UseRealTime()->Unit(benchmark::kMillisecond);

// The same work through forkpool::DataLoader, as a user coming from torch writes it: a dataset
// whose get(index) builds one batch, batch_size 1 with a collate that hands that batch on (torch's
// batch_size=None), 2 persistent workers, each epoch a Stream. Args: batch bytes, prefetch_factor.
// With torch's default prefetch_factor (2: four batches in flight) the pipeline is bound by the
// time a worker's batch takes to turn into its next index; with 16 (what imap's adaptive window
// reaches for short batches) against BM_DataLoader (imap) it shows what the loader's sampler,
// collate and bookkeeping cost.
struct BatchDataset {
  std::int64_t batches;
  std::size_t size() const { return static_cast<std::size_t>(batches); }
  fp::Tensor get(std::size_t index) const { return build_batch(static_cast<std::int64_t>(index)); }
};
fp::Tensor the_only_sample(std::vector<fp::Tensor> samples) { return std::move(samples.front()); }

// The same batches from an iterable dataset (torch's IterableDataset): worker w reads batches
// w, w + num_workers, ...; they come in turn, so the consumer sees them in order. Against
// BM_DataLoaderClass it shows what pinning each request to its shard's worker costs.
struct BatchStream {
  std::int64_t batches;
  struct Iterator {
    using value_type = fp::Tensor;
    using difference_type = std::ptrdiff_t;
    std::int64_t at, step, end;
    fp::Tensor operator*() const { return build_batch(at); }
    Iterator& operator++() {
      at += step;
      return *this;
    }
    void operator++(int) { ++*this; }
    bool operator==(std::default_sentinel_t) const { return at >= end; }
  };
  Iterator begin() const {
    std::optional<fp::WorkerInfo> info = fp::worker_info();
    return info ? Iterator{info->id, info->num_workers, batches} : Iterator{0, 1, batches};
  }
  std::default_sentinel_t end() const { return {}; }
};

// Args: batch bytes, prefetch_factor.
template <class Dataset>
void run_loader(benchmark::State& state, const char* what) {
  g_batch_floats = state.range(0) / 4;
  std::int64_t per_epoch = state.range(0) >= (8 << 20) ? 100 : 500;
  fp::DataLoader<Dataset> loader(Dataset{per_epoch},
                                 {.batch_size = 1,
                                  .num_workers = 2,
                                  .prefetch_factor = static_cast<int>(state.range(1)),
                                  .persistent_workers = true},
                                 &the_only_sample);
  std::int64_t batches = 0;
  auto body = [&]() -> fp::Task<void> {
    fp::Stream<fp::Tensor> warm = loader.epoch();  // each worker makes its slabs once
    while (co_await warm.next()) {}
    for (auto _ : state) {
      fp::Stream<fp::Tensor> epoch = loader.epoch();
      std::int64_t expected = 0;
      while (std::optional<fp::Tensor> b = co_await epoch.next()) {
        if (b->numel() != g_batch_floats || b->data<float>()[0] != static_cast<float>(expected))
          state.SkipWithError("a batch out of order or not filled");
        ++expected;
        ++batches;
      }
    }
  };
  fp::run(body());
  state.SetItemsProcessed(batches);
  state.SetLabel(std::to_string(state.range(0) >> 10) + " KiB, " + what + ", prefetch_factor " +
                 std::to_string(state.range(1)));
}

void BM_DataLoaderClass(benchmark::State& state) { run_loader<BatchDataset>(state, "forkpool::DataLoader"); }
BENCHMARK(BM_DataLoaderClass)
    ->ArgsProduct({{64 << 10, 1 << 20, 12 << 20}, {2, 16}})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

void BM_IterableDataLoader(benchmark::State& state) {
  run_loader<BatchStream>(state, "forkpool::DataLoader over an iterable dataset");
}
BENCHMARK(BM_IterableDataLoader)
    ->ArgsProduct({{64 << 10, 1 << 20, 12 << 20}, {2, 16}})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

// Batches of 64 small samples collated in the worker (torch's batch_size=64 with its default
// collate): each sample a float32 tensor of batch bytes / 64 filled with its index, the batch
// their stack in shared memory. Arg 0: batch bytes; arg 1: the loop that makes them, all running
// the same per-sample work in 2 workers:
//   0   the hand-written imap loop, a task per batch number (it gets its 64 samples and stacks them);
//   1   the hand-written imap loop over batches of indices (as one that shuffles must send them);
//   2+  forkpool::DataLoader at that prefetch_factor.
constexpr std::int64_t kSamplesPerBatch = 64;
std::int64_t g_sample_floats = 0;
fp::Tensor build_sample(std::int64_t index) {
  fp::Tensor t = fp::Tensor::empty({g_sample_floats}, fp::DType::f32);
  std::fill_n(t.data<float>(), g_sample_floats, static_cast<float>(index));
  return t;
}
template <class Indices>
fp::Tensor stack_by_hand(const Indices& indices) {  // as a user writes it
  fp::Tensor out = fp::Tensor::empty({kSamplesPerBatch, g_sample_floats}, fp::DType::f32);
  float* next = out.data<float>();
  for (auto index : indices) {
    fp::Tensor sample = build_sample(static_cast<std::int64_t>(index));
    next = std::copy_n(sample.data<float>(), g_sample_floats, next);
  }
  return out;
}
fp::Tensor build_collated_batch(std::int64_t batch) {
  return stack_by_hand(std::views::iota(batch * kSamplesPerBatch, (batch + 1) * kSamplesPerBatch));
}
fp::Tensor collate_indices(std::vector<std::uint64_t> indices) { return stack_by_hand(indices); }
struct SampleDataset {
  std::int64_t samples;
  std::size_t size() const { return static_cast<std::size_t>(samples); }
  fp::Tensor get(std::size_t index) const { return build_sample(static_cast<std::int64_t>(index)); }
};

void BM_CollatedBatches(benchmark::State& state) {
  g_sample_floats = state.range(0) / 4 / kSamplesPerBatch;
  int prefetch = static_cast<int>(state.range(1));
  std::int64_t per_epoch = state.range(0) >= (8 << 20) ? 100 : 500;
  std::optional<fp::Pool> pool;
  std::optional<fp::DataLoader<SampleDataset>> loader;
  if (prefetch <= 1)
    pool.emplace(fp::PoolOptions{.processes = 2});
  else
    loader.emplace(
        SampleDataset{per_epoch * kSamplesPerBatch},
        fp::DataLoaderOptions{
            .batch_size = kSamplesPerBatch, .num_workers = 2, .prefetch_factor = prefetch, .persistent_workers = true});
  auto epoch = [&]() {
    if (prefetch == 0) return pool->imap(build_collated_batch, std::views::iota(std::int64_t{0}, per_epoch));
    if (prefetch == 1) {
      std::vector<std::vector<std::uint64_t>> batches(per_epoch);
      for (std::int64_t b = 0; b < per_epoch; ++b)
        for (std::int64_t i = 0; i < kSamplesPerBatch; ++i) batches[b].push_back(b * kSamplesPerBatch + i);
      return pool->imap(collate_indices, std::move(batches));
    }
    return loader->epoch();
  };
  std::int64_t batches = 0;
  auto body = [&]() -> fp::Task<void> {
    fp::Stream<fp::Tensor> warm = epoch();  // each worker makes its slabs once
    while (co_await warm.next()) {}
    for (auto _ : state) {
      fp::Stream<fp::Tensor> stream = epoch();
      std::int64_t expected = 0;
      while (std::optional<fp::Tensor> b = co_await stream.next()) {
        if (b->numel() != g_sample_floats * kSamplesPerBatch ||
            b->data<float>()[b->numel() - 1] != static_cast<float>(expected * kSamplesPerBatch + kSamplesPerBatch - 1))
          state.SkipWithError("a batch out of order or not collated");
        ++expected;
        ++batches;
      }
    }
  };
  fp::run(body());
  state.SetItemsProcessed(batches);
  state.SetLabel(std::to_string(state.range(0) >> 10) + " KiB of 64 samples, " +
                 (prefetch == 0   ? std::string("imap of batch numbers")
                  : prefetch == 1 ? std::string("imap of index batches")
                                  : "forkpool::DataLoader, prefetch_factor " + std::to_string(prefetch)));
}
BENCHMARK(BM_CollatedBatches)
    ->ArgsProduct({{64 << 10, 1 << 20, 12 << 20}, {0, 1, 2, 16}})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

BENCHMARK_MAIN();
