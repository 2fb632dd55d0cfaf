// forkpool-torch: torch::Tensor as a pool's value, against forkpool's own Tensor in the same run
// (tensor_bench's figures), and the DataLoader pattern with torch::Tensor batches against
// libtorch's own thread DataLoader and Python torch's (../shared/anchors: libtorch_dataloader.cpp,
// py_dataloader.py; bench/run_all.sh runs them in the same run, compare.py prints the ratios).

#include <benchmark/benchmark.h>
#include <torch/torch.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <optional>
#include <ranges>
#include <string>
#include <vector>

#include <forkpool/forkpool.hpp>
#include <forkpool/shm/internal/block_table.hpp>
#include <forkpool/torch.hpp>

#include "raw_pingpong.hpp"

namespace fp = forkpool;

namespace {

using Clock = std::chrono::steady_clock;
double ns(Clock::duration d) {
  return static_cast<double>(std::chrono::duration_cast<std::chrono::nanoseconds>(d).count());
}

at::Tensor touch_ends(at::Tensor t) {
  auto* bytes = static_cast<std::uint8_t*>(t.data_ptr());
  bytes[0] += 1;
  bytes[t.nbytes() - 1] += 1;
  return t;
}

fp::Tensor touch_ends_fp(fp::Tensor t) {
  auto* bytes = static_cast<std::uint8_t*>(t.raw_data());
  bytes[0] += 1;
  bytes[t.nbytes() - 1] += 1;
  return t;
}

// A shared torch::Tensor to a worker and back, as tensor_bench's BM_TensorRoundTrip does with
// forkpool's Tensor; both here, same run: the ratio is what libtorch's tensor costs on top.
// Arg 0: bytes; arg 1: 1 torch::Tensor, 0 fp::Tensor; arg 2: 1 the parent on CPU 0 and the worker
// on CPU 1 (both runs placed alike), 0 where the scheduler puts them (each run its own way).
void BM_TorchTensorRoundTrip(benchmark::State& state) {
  PinnedApart apart(state.range(2) != 0);
  fp::PoolOptions options{.processes = 1};
  if (apart) options.initializer = pin_worker_to_cpu_1;
  fp::Pool pool(options);
  std::int64_t floats = state.range(0) / 4;
  bool torch_tensor = state.range(1) != 0;
  at::Tensor t = fp::torch::zeros({floats}, at::kFloat);
  fp::Tensor f = fp::Tensor::zeros({floats}, fp::DType::f32);
  auto body = [&]() -> fp::Task<void> {
    co_await pool.apply_async(touch_ends, t);  // the worker maps each once
    co_await pool.apply_async(touch_ends_fp, f);
    for (auto _ : state) {
      if (torch_tensor)
        benchmark::DoNotOptimize((co_await pool.apply_async(touch_ends, t)).data_ptr());
      else
        benchmark::DoNotOptimize((co_await pool.apply_async(touch_ends_fp, f)).raw_data());
    }
  };
  fp::run(body());
  state.SetLabel(std::to_string(state.range(0) >> 10) + " KiB " + (torch_tensor ? "torch::Tensor" : "fp::Tensor") +
                 (apart ? ", pinned apart" : ""));
}
BENCHMARK(BM_TorchTensorRoundTrip)->ArgsProduct({{4 << 10, 1 << 20}, {1, 0}, {0, 1}})->UseRealTime();

// The same two round trips, alternated in one pool and each timed, so that both have the same
// worker on the same CPU in the same moment: the ratio BM_TorchTensorRoundTrip's two separate
// runs give swings with where the scheduler put each run's worker (0.99x to 1.47x seen in one
// run of both). Which goes first alternates too. Arg 0: bytes; arg 1: 1 the parent on CPU 0 and
// the worker on CPU 1, 0 where the scheduler puts them. Counters: ns per round trip of each (the
// mean, and the median), and the two ratios.
void BM_TorchOverFpRoundTrip(benchmark::State& state) {
  PinnedApart apart(state.range(1) != 0);
  fp::PoolOptions options{.processes = 1};
  if (apart) options.initializer = pin_worker_to_cpu_1;
  fp::Pool pool(options);
  std::int64_t floats = state.range(0) / 4;
  at::Tensor t = fp::torch::zeros({floats}, at::kFloat);
  fp::Tensor f = fp::Tensor::zeros({floats}, fp::DType::f32);
  std::vector<Clock::duration> torch_trips, fp_trips;
  auto body = [&]() -> fp::Task<void> {
    co_await pool.apply_async(touch_ends, t);
    co_await pool.apply_async(touch_ends_fp, f);
    bool torch_first = true;
    for (auto _ : state) {
      for (int turn = 0; turn < 2; ++turn) {
        Clock::time_point start = Clock::now();
        if ((turn == 0) == torch_first) {
          benchmark::DoNotOptimize((co_await pool.apply_async(touch_ends, t)).data_ptr());
          torch_trips.push_back(Clock::now() - start);
        } else {
          benchmark::DoNotOptimize((co_await pool.apply_async(touch_ends_fp, f)).raw_data());
          fp_trips.push_back(Clock::now() - start);
        }
      }
      torch_first = !torch_first;
    }
  };
  fp::run(body());
  // The mean, and the median: a trip whose answer outlasts the spin sleeps, and a few such trips
  // move the mean far more than the median.
  auto mean = [&](const std::vector<Clock::duration>& trips) {
    Clock::duration sum{};
    for (Clock::duration d : trips) sum += d;
    return trips.empty() ? 0.0 : ns(sum) / static_cast<double>(trips.size());
  };
  auto median = [&](std::vector<Clock::duration> trips) {
    if (trips.empty()) return 0.0;
    auto middle = trips.begin() + static_cast<std::ptrdiff_t>(trips.size() / 2);
    std::nth_element(trips.begin(), middle, trips.end());
    return ns(*middle);
  };
  double torch_mean = mean(torch_trips), fp_mean = mean(fp_trips);
  double torch_median = median(torch_trips), fp_median = median(fp_trips);
  state.counters["torch_ns"] = torch_mean;
  state.counters["fp_ns"] = fp_mean;
  state.counters["torch_over_fp"] = fp_mean > 0 ? torch_mean / fp_mean : 0.0;
  state.counters["torch_median_ns"] = torch_median;
  state.counters["fp_median_ns"] = fp_median;
  state.counters["medians_torch_over_fp"] = fp_median > 0 ? torch_median / fp_median : 0.0;
  state.SetLabel(std::to_string(state.range(0) >> 10) + " KiB, alternated in one pool" +
                 (apart ? ", pinned apart" : ""));
}
BENCHMARK(BM_TorchOverFpRoundTrip)->ArgsProduct({{4 << 10, 1 << 20}, {0, 1}})->UseRealTime();

// One side's share of a round trip, without the trip: a tensor decoded over a block of shared
// memory and dropped, as a message brings it and the code after the task drops it. Arg 0: a
// forkpool::Tensor; 1: a torch::Tensor with no other on the block (a worker's case: a new torch
// storage each time); 2: a torch::Tensor while another is kept on the block (the parent's case:
// the storage is reused).
void BM_TensorOverABlockMadeAndDropped(benchmark::State& state) {
  fp::Tensor block = fp::Tensor::zeros({1024}, fp::DType::f32);
  std::optional<at::Tensor> kept;
  if (state.range(0) == 2) kept = fp::torch::from_forkpool(block);
  fp::detail::OutgoingBlocks blocks;
  fp::Writer w(&blocks);
  fp::codec<fp::Tensor>::encode(w, block);
  w.write(std::uint8_t{0});  // codec<at::Tensor>'s requires_grad, after the view
  fp::detail::IncomingBlocks incoming(blocks.storages());
  for (auto _ : state) {
    fp::Reader r(w.bytes(), {}, &incoming);
    if (state.range(0) == 0) {
      fp::Tensor made = fp::codec<fp::Tensor>::decode(r);
      benchmark::DoNotOptimize(made.raw_data());
    } else {
      at::Tensor made = fp::codec<at::Tensor>::decode(r);
      benchmark::DoNotOptimize(made.data_ptr());
    }
  }
  state.SetLabel(state.range(0) == 0   ? "forkpool::Tensor"
                 : state.range(0) == 1 ? "torch::Tensor, new storage"
                                       : "torch::Tensor, storage reused");
}
BENCHMARK(BM_TensorOverABlockMadeAndDropped)->DenseRange(0, 2);

// The other share: a shared tensor encoded into a message (its block named in the message's
// table). Arg 0: a forkpool::Tensor; 1: a torch::Tensor.
void BM_SharedTensorEncoded(benchmark::State& state) {
  fp::Tensor f = fp::Tensor::zeros({1024}, fp::DType::f32);
  at::Tensor t = fp::torch::from_forkpool(f);
  for (auto _ : state) {
    fp::detail::OutgoingBlocks blocks;
    fp::Writer w(&blocks);
    if (state.range(0) == 0)
      fp::codec<fp::Tensor>::encode(w, f);
    else
      fp::codec<at::Tensor>::encode(w, t);
    benchmark::DoNotOptimize(w.bytes().data());
  }
  state.SetLabel(state.range(0) == 0 ? "forkpool::Tensor" : "torch::Tensor");
}
BENCHMARK(BM_SharedTensorEncoded)->DenseRange(0, 1);

// A round trip's work without the trip, in one process: what both ends do to the tensor (encode,
// decode, the task, encode, decode, drop), so the torch::Tensor extra is seen without the
// scheduler's noise. Arg 0: forkpool::Tensor; 1: torch::Tensor.
template <class T>
T sent_and_read(const T& value) {
  fp::detail::OutgoingBlocks blocks;
  fp::Writer w(&blocks);
  fp::codec<T>::encode(w, value);
  fp::detail::IncomingBlocks incoming(blocks.storages());
  fp::Reader r(w.bytes(), {}, &incoming);
  return fp::codec<T>::decode(r);
}
template <class T, class F>
void round_trip_work(benchmark::State& state, const T& value, F task) {
  for (auto _ : state) {
    T back = sent_and_read(task(sent_and_read(value)));
    benchmark::DoNotOptimize(&back);
  }
}
void BM_RoundTripWorkWithoutTheTrip(benchmark::State& state) {
  fp::Tensor f = fp::Tensor::zeros({1024}, fp::DType::f32);
  at::Tensor t = fp::torch::from_forkpool(f);
  if (state.range(0) == 0)
    round_trip_work(state, f, touch_ends_fp);
  else
    round_trip_work(state, t, touch_ends);
  state.SetLabel(state.range(0) == 0 ? "forkpool::Tensor" : "torch::Tensor");
}
BENCHMARK(BM_RoundTripWorkWithoutTheTrip)->DenseRange(0, 1);

// The same work with the caches cold, each step timed alone after 1 MiB of other memory was read
// (as in a real trip, where the loop, the rings and the other process run between the steps).
// Counters: ns per trip of each step, for torch::Tensor (torch_*) and forkpool::Tensor (fp_*):
// the encodes, the decodes, the task, the drops. Warm, torch's steps cost what forkpool's do;
// cold, libtorch's TensorImpl and StorageImpl (made, filled, destroyed) are what it adds.
std::vector<std::uint64_t> g_other_memory(std::size_t{1} << 17);
void chill_caches() {
  std::uint64_t sum = 0;
  for (std::size_t i = 0; i < g_other_memory.size(); i += 8) sum += g_other_memory[i]++;
  benchmark::DoNotOptimize(sum);
}
enum Step { kEncode, kDecode, kTask, kDrop, kSteps };
template <class F>
auto timed_cold(Clock::duration& total, F step) {
  chill_caches();
  Clock::time_point start = Clock::now();
  auto out = step();
  total += Clock::now() - start;
  return out;
}
template <class T, class F>
void cold_round_trip(std::array<Clock::duration, kSteps>& total, const T& value, F task) {
  auto one_way = [&](const T& sent) {
    fp::detail::OutgoingBlocks blocks;
    fp::Writer w(&blocks);
    timed_cold(total[kEncode], [&] {
      fp::codec<T>::encode(w, sent);
      return 0;
    });
    fp::detail::IncomingBlocks incoming(blocks.storages());
    fp::Reader r(w.bytes(), {}, &incoming);
    return std::optional<T>(timed_cold(total[kDecode], [&] { return fp::codec<T>::decode(r); }));
  };
  std::optional<T> there = one_way(value);
  T result = timed_cold(total[kTask], [&] { return task(std::move(*there)); });
  auto drop = [&](std::optional<T>& kept) {
    timed_cold(total[kDrop], [&] {
      kept.reset();
      return 0;
    });
  };
  drop(there);
  std::optional<T> back = one_way(result);
  drop(back);
}
void BM_RoundTripWorkCold(benchmark::State& state) {
  fp::Tensor f = fp::Tensor::zeros({1024}, fp::DType::f32);
  at::Tensor t = fp::torch::from_forkpool(f);
  std::array<Clock::duration, kSteps> torch_total{}, fp_total{};
  for (auto _ : state) {
    cold_round_trip(torch_total, t, touch_ends);
    cold_round_trip(fp_total, f, touch_ends_fp);
  }
  auto per_trip = [&](Clock::duration d) {
    return ns(d) / static_cast<double>(std::max<benchmark::IterationCount>(state.iterations(), 1));
  };
  const char* names[kSteps] = {"encodes", "decodes", "task", "drops"};
  for (int step = 0; step < kSteps; ++step) {
    state.counters[std::string("torch_") + names[step]] = per_trip(torch_total[step]);
    state.counters[std::string("fp_") + names[step]] = per_trip(fp_total[step]);
  }
}
BENCHMARK(BM_RoundTripWorkCold);

// The DataLoader pattern with torch::Tensor batches: 2 workers each build a new float32 batch in
// shared memory per index (fp::torch::empty, filled), the parent consumes them in order.
std::int64_t g_batch_floats = 0;
at::Tensor build_batch(std::int64_t index) {
  at::Tensor t = fp::torch::empty({g_batch_floats}, at::kFloat);
  std::fill_n(t.data_ptr<float>(), g_batch_floats, static_cast<float>(index));
  return t;
}

void BM_TorchDataLoader(benchmark::State& state) {
  g_batch_floats = state.range(0) / 4;
  fp::Pool pool({.processes = 2});
  std::int64_t batches = 0;
  std::int64_t per_iteration = state.range(0) >= (8 << 20) ? 100 : 500;
  auto body = [&]() -> fp::Task<void> {
    fp::Stream<at::Tensor> warm = pool.imap(build_batch, std::views::iota(std::int64_t{0}, std::int64_t{20}));
    while (co_await warm.next()) {}
    for (auto _ : state) {
      fp::Stream<at::Tensor> stream = pool.imap(build_batch, std::views::iota(std::int64_t{0}, per_iteration));
      std::int64_t expected = 0;
      while (std::optional<at::Tensor> b = co_await stream.next()) {
        if (b->numel() != g_batch_floats || b->data_ptr<float>()[g_batch_floats - 1] != static_cast<float>(expected))
          state.SkipWithError("a batch out of order or not filled");
        ++expected;
        ++batches;
      }
    }
  };
  fp::run(body());
  state.SetItemsProcessed(batches);
  state.SetLabel(std::to_string(state.range(0) >> 10) + " KiB torch::Tensor");
}
BENCHMARK(BM_TorchDataLoader)->Arg(64 << 10)->Arg(1 << 20)->Arg(12 << 20)->UseRealTime()->Unit(benchmark::kMillisecond);

}  // namespace

BENCHMARK_MAIN();
