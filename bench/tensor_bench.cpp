// Tensor round trips through a worker (it touches the first and last element and returns the
// tensor), against sending the same bytes serialized through the channel: shared memory is flat
// in the size, serialization is linear.

#include <benchmark/benchmark.h>

#include <string>
#include <vector>

#include <forkpool/pool/pool.hpp>
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
    ->Arg(256)->Arg(1 << 10)->Arg(4 << 10)->Arg(16 << 10)->Arg(64 << 10)->Arg(256 << 10)->Arg(1 << 20)->Arg(64 << 20)
    ->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
