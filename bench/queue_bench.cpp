// Queue and Lock across processes, against bench/py_queue.py (torch.multiprocessing.Queue,
// multiprocessing.Lock) in the same run: the same patterns.

#include <benchmark/benchmark.h>

#include <forkpool/forkpool.hpp>

namespace fp = forkpool;

namespace {

// Puts n items made by `make` each time it is told n on `go`; a negative n ends it.
template <class T, T (*make)(int)>
void producer(fp::Queue<int> go, fp::Queue<T> out) {
  for (int n; (n = go.get()) >= 0;)
    for (int i = 0; i < n; ++i) out.put(make(i));
}

int make_int(int i) { return i; }

template <std::int64_t Floats>
fp::Tensor make_tensor(int i) {
  fp::Tensor t = fp::Tensor::empty({Floats}, fp::DType::f32);
  std::fill_n(t.data<float>(), Floats, static_cast<float>(i));  // a new batch, written in full
  return t;
}

// Items per second from a producer process to this one, `batch` at a time.
template <class T, T (*make)(int)>
void queue_rate(benchmark::State& state, int batch) {
  fp::Queue<int> go;
  fp::Queue<T> items;
  fp::Process process = fp::start_process(producer<T, make>, go, items);
  go.put(50);
  for (int i = 0; i < 50; ++i) benchmark::DoNotOptimize(items.get());
  for (auto _ : state) {
    go.put(batch);
    for (int i = 0; i < batch; ++i) benchmark::DoNotOptimize(items.get());
  }
  go.put(-1);
  process.join();
  state.SetItemsProcessed(state.iterations() * batch);
}

void BM_QueueInts(benchmark::State& state) { queue_rate<int, make_int>(state, 1000); }
BENCHMARK(BM_QueueInts)->UseRealTime()->Unit(benchmark::kMillisecond);

void BM_QueueTensors64KiB(benchmark::State& state) { queue_rate<fp::Tensor, make_tensor<16384>>(state, 100); }
BENCHMARK(BM_QueueTensors64KiB)->UseRealTime()->Unit(benchmark::kMillisecond);

void BM_QueueTensors1MiB(benchmark::State& state) { queue_rate<fp::Tensor, make_tensor<262144>>(state, 30); }
BENCHMARK(BM_QueueTensors1MiB)->UseRealTime()->Unit(benchmark::kMillisecond);

void lock_loop(fp::Lock lock, int n) {
  for (int i = 0; i < n; ++i) {
    lock.lock();
    lock.unlock();
  }
}

void BM_LockUncontended(benchmark::State& state) {
  fp::Lock lock;
  for (auto _ : state) lock_loop(lock, 1000);
  state.SetItemsProcessed(state.iterations() * 1000);
}
BENCHMARK(BM_LockUncontended)->UseRealTime();

// This process and another take turns at one lock, 200,000 times each.
void BM_LockContendedByTwoProcesses(benchmark::State& state) {
  fp::Lock lock;
  constexpr int kPairs = 200000;
  for (auto _ : state) {
    fp::Process other = fp::start_process(lock_loop, lock, kPairs);
    lock_loop(lock, kPairs);
    other.join();
  }
  state.SetItemsProcessed(state.iterations() * 2 * kPairs);
}
BENCHMARK(BM_LockContendedByTwoProcesses)->UseRealTime()->Unit(benchmark::kMillisecond);

}  // namespace

int main(int argc, char** argv) {
  fp::init();
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
