// Queue, Lock, Pipe, Semaphore and Condition across processes, against bench/py_queue.py
// (torch.multiprocessing.Queue and Pipe, multiprocessing.Lock and Pipe) and the machine's
// round-trip anchors (raw_pingpong.hpp), in the same run: the same patterns.

#include <benchmark/benchmark.h>

#include <array>
#include <cstdint>
#include <mutex>

#include <forkpool/forkpool.hpp>

#include "raw_pingpong.hpp"

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

// ---- One item there and back: a Pipe against a pair of Queues (64 bytes, and a 1 MiB tensor
// that crosses as shared memory), and hand-offs on two Semaphores and on a Condition, against
// the anchors registered below. The echo process stops at `stop`.

using Bytes64 = std::array<std::uint8_t, 64>;
bool is_stop(const Bytes64& bytes) { return bytes[0] == 1; }
bool is_stop(const fp::Tensor& tensor) { return tensor.numel() == 0; }

template <class T>
void pipe_echo(fp::Connection<T> end) {
  for (T item = end.recv(); !is_stop(item); item = end.recv()) end.send(item);
}

template <class T>
void queue_echo(fp::Queue<T> in, fp::Queue<T> out) {
  for (T item = in.get(); !is_stop(item); item = in.get()) out.put(item);
}

template <class T>
void pipe_round_trip(benchmark::State& state, const T& item, const T& stop) {
  auto [here, there] = fp::Pipe<T>();
  fp::Process echo = fp::start_process(pipe_echo<T>, there);
  for (auto _ : state) {
    here.send(item);
    benchmark::DoNotOptimize(here.recv());
  }
  here.send(stop);
  echo.join();
  state.SetItemsProcessed(state.iterations());
}

template <class T>
void queue_round_trip(benchmark::State& state, const T& item, const T& stop) {
  fp::Queue<T> there, back;
  fp::Process echo = fp::start_process(queue_echo<T>, there, back);
  for (auto _ : state) {
    there.put(item);
    benchmark::DoNotOptimize(back.get());
  }
  there.put(stop);
  echo.join();
  state.SetItemsProcessed(state.iterations());
}

Bytes64 stop_bytes() {
  Bytes64 stop{};
  stop[0] = 1;
  return stop;
}
fp::Tensor tensor_1mib() { return fp::Tensor::zeros({262144}, fp::DType::f32); }
fp::Tensor stop_tensor() { return fp::Tensor::empty({0}, fp::DType::f32); }

void BM_PipeRoundTrip64B(benchmark::State& state) { pipe_round_trip(state, Bytes64{}, stop_bytes()); }
BENCHMARK(BM_PipeRoundTrip64B)->UseRealTime();

void BM_QueueRoundTrip64B(benchmark::State& state) { queue_round_trip(state, Bytes64{}, stop_bytes()); }
BENCHMARK(BM_QueueRoundTrip64B)->UseRealTime();

void BM_PipeRoundTripTensor1MiB(benchmark::State& state) { pipe_round_trip(state, tensor_1mib(), stop_tensor()); }
BENCHMARK(BM_PipeRoundTripTensor1MiB)->UseRealTime();

void BM_QueueRoundTripTensor1MiB(benchmark::State& state) { queue_round_trip(state, tensor_1mib(), stop_tensor()); }
BENCHMARK(BM_QueueRoundTripTensor1MiB)->UseRealTime();

// The other process gives `pong` back for each `ping` until `stop` is set.
void semaphore_echo(fp::Semaphore ping, fp::Semaphore pong, fp::Value<int> stop) {
  for (;;) {
    ping.acquire();
    if (stop.load() != 0) return;
    pong.release();
  }
}

void BM_SemaphoreHandOff(benchmark::State& state) {
  fp::Semaphore ping(0), pong(0);
  fp::Value<int> stop(0);
  fp::Process echo = fp::start_process(semaphore_echo, ping, pong, stop);
  for (auto _ : state) {
    ping.release();
    pong.acquire();
  }
  stop.store(1);
  ping.release();
  echo.join();
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_SemaphoreHandOff)->UseRealTime();

// The same hand-off with this side awaiting on its loop (async_acquire): the loop sleeps on the
// semaphore's futex (io_uring, Linux 6.7 and later; the epoll backend looks at it after pauses).
void BM_SemaphoreHandOffOnTheLoop(benchmark::State& state) {
  fp::Semaphore ping(0), pong(0);
  fp::Value<int> stop(0);
  fp::Process echo = fp::start_process(semaphore_echo, ping, pong, stop);
  fp::run([&]() -> fp::Task<void> {
    for (auto _ : state) {
      ping.release();
      co_await pong.async_acquire();
    }
  }());
  stop.store(1);
  ping.release();
  echo.join();
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_SemaphoreHandOffOnTheLoop)->UseRealTime();

// `turn` 1: the other process's turn (it sets 0 and notifies); -1: it ends.
void condition_echo(fp::Condition condition, fp::Value<int> turn) {
  std::unique_lock held(condition.get_lock());
  for (;;) {
    condition.wait(held, [&] { return turn.load() != 0; });
    if (turn.load() < 0) return;
    turn.store(0);
    condition.notify();
  }
}

void BM_ConditionHandOff(benchmark::State& state) {
  fp::Condition condition;
  fp::Value<int> turn(0);
  fp::Process echo = fp::start_process(condition_echo, condition, turn);
  for (auto _ : state) {
    std::unique_lock held(condition.get_lock());
    turn.store(1);
    condition.notify();
    condition.wait(held, [&] { return turn.load() == 0; });
  }
  {
    std::unique_lock held(condition.get_lock());
    turn.store(-1);
    condition.notify();
  }
  echo.join();
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_ConditionHandOff)->UseRealTime();

// The machine's anchors, in this binary: a blocking socket ping-pong, and a spin-then-futex one.
BENCHMARK(BM_RawSocketpairPingPong64B)->UseRealTime();
BENCHMARK(BM_RawSpinThenFutexPingPong)->Arg(0)->UseRealTime();

}  // namespace

int main(int argc, char** argv) {
  fp::init();
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
