// The pool against the physical limit (raw ping-pong, same binary) and, through
// bench/run_all.sh, against CPython's Pool and torch.multiprocessing in the same run.

#include <benchmark/benchmark.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <numeric>
#include <optional>
#include <ranges>
#include <vector>

#include "raw_pingpong.hpp"
#include <forkpool/worker/init.hpp>
#include <forkpool/pool/pool.hpp>
#include <forkpool/runtime/when_all.hpp>

namespace fp = forkpool;

namespace {

int ident(int x) { return x; }
int square(int x) { return x * x; }

// About `ms` milliseconds of arithmetic.
long spin(int ms) {
  auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
  long x = 0;
  while (std::chrono::steady_clock::now() < until)
    for (int i = 0; i < 1000; ++i) x += i ^ (x >> 3);
  return x;
}

long rss_kib() {
  FILE* f = std::fopen("/proc/self/statm", "r");
  long pages = 0, resident = 0;
  if (f && std::fscanf(f, "%ld %ld", &pages, &resident) != 2) resident = 0;
  if (f) std::fclose(f);
  return resident * (sysconf(_SC_PAGESIZE) / 1024);
}

BENCHMARK(BM_RawSocketpairPingPong64B)->UseRealTime();
BENCHMARK(BM_RawSocketpairPingPong64BApart)->UseRealTime();
BENCHMARK(BM_RawSpinThenFutexPingPong)->Arg(0)->Arg(1)->UseRealTime();

// PoolOptions::spin for Arg 0 (adaptive, the default) and 1 (never spin: the kernel wakes).
std::optional<std::chrono::nanoseconds> spin_arg(long arg) {
  if (arg == 1) return std::chrono::nanoseconds{0};
  return std::nullopt;
}

// Back to back, one in flight: the latency of a trivial task. Arg 0/1: spin_arg, two workers
// where the scheduler puts them; 2: adaptive, one worker on CPU 1 and the parent on CPU 0 (as
// BM_RawSpinThenFutexPingPong/1: every message crosses CPUs).
void BM_ApplyAsyncRoundTripSpin(benchmark::State& state) {
  PinnedApart apart(state.range(0) == 2);
  fp::PoolOptions options{.processes = apart ? 1 : 2};
  options.spin = spin_arg(state.range(0));
  if (apart) options.initializer = pin_worker_to_cpu_1;
  fp::Pool pool(options);
  auto body = [&]() -> fp::Task<void> {
    for (int i = 0; i < 200; ++i) co_await pool.apply_async(ident, i);
    for (auto _ : state) benchmark::DoNotOptimize(co_await pool.apply_async(ident, 1));
  };
  fp::run(body());
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_ApplyAsyncRoundTripSpin)->Arg(0)->Arg(1)->Arg(2)->UseRealTime();

// 100,000 trivial tasks in flight at once, then every result: tasks per second. Arg: spin_arg.
void BM_ApplyAsync100kInFlight(benchmark::State& state) {
  fp::PoolOptions options{.processes = static_cast<int>(state.range(1))};
  options.spin = spin_arg(state.range(0));
  fp::Pool pool(options);
  std::vector<fp::AsyncResult<int>> results;
  results.reserve(100'000);
  for (auto _ : state) {
    results.clear();
    for (int i = 0; i < 100'000; ++i) results.push_back(pool.apply_async(ident, i));
    for (auto& r : results) benchmark::DoNotOptimize(r.get());
  }
  state.SetItemsProcessed(state.iterations() * 100'000);
}
BENCHMARK(BM_ApplyAsync100kInFlight)->ArgsProduct({{0, 1}, {1, 2}})->UseRealTime()->Unit(benchmark::kMillisecond);

int sleep_ms_then(int ms, int x) {
  std::this_thread::sleep_for(std::chrono::milliseconds(ms));
  return x;
}

// Work given from plain code while the program computes without calling forkpool: N tasks of
// M ms on 2 workers, then C ms of the program's own computing, then every result. The time from
// the first submit to the last result: C when the work ran meanwhile, more when only what the
// workers took at first did. Args: N, M, C: 100 x 10 ms then 500 ms (all within the 64 a worker
// was ever sent at once), and 1000 x 1 ms then 600 ms (past it). Three rounds in one pool, as
// py_overlap.py (the peer) runs them: a later round finds the pool's judgement of the last one.
void BM_WorkWhileTheProgramComputes(benchmark::State& state) {
  const int tasks = static_cast<int>(state.range(0)), task_ms = static_cast<int>(state.range(1));
  const auto computing = std::chrono::milliseconds(state.range(2));
  fp::Pool pool({.processes = 2});
  pool.apply_async(sleep_ms_then, task_ms, 0).get();
  for (auto _ : state) {
    auto start = std::chrono::steady_clock::now();
    std::vector<fp::AsyncResult<int>> results;
    for (int i = 0; i < tasks; ++i) results.push_back(pool.apply_async(sleep_ms_then, task_ms, i));
    double computed = 0;
    while (std::chrono::steady_clock::now() - start < computing) benchmark::DoNotOptimize(computed += 1.0);
    for (auto& r : results) benchmark::DoNotOptimize(r.get());
  }
}
BENCHMARK(BM_WorkWhileTheProgramComputes)
    ->Args({100, 10, 500})
    ->Args({1000, 1, 600})
    ->Iterations(3)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

// imap at chunksize 1 over 100,000 items: items per second. Args: spin_arg, workers.
void BM_ImapChunksize1(benchmark::State& state) {
  fp::PoolOptions options{.processes = static_cast<int>(state.range(1))};
  options.spin = spin_arg(state.range(0));
  fp::Pool pool(options);
  auto body = [&]() -> fp::Task<void> {
    fp::Stream<int> results = pool.imap(ident, std::views::iota(0, 100'000), 1);
    while (auto r = co_await results.next()) benchmark::DoNotOptimize(*r);
  };
  for (auto _ : state) fp::run(body());
  state.SetItemsProcessed(state.iterations() * 100'000);
}
BENCHMARK(BM_ImapChunksize1)->ArgsProduct({{0, 1}, {1, 2}})->UseRealTime()->Unit(benchmark::kMillisecond);

// Arg: task_timeout in ms (0: none), to see what the timeout machinery costs.
void BM_ApplyAsyncRoundTrip(benchmark::State& state) {
  fp::PoolOptions options{.processes = 2};
  options.task_timeout = std::chrono::milliseconds(state.range(0));
  fp::Pool pool(options);
  auto body = [&]() -> fp::Task<void> {
    for (int i = 0; i < 200; ++i) co_await pool.apply_async(ident, i);
    for (auto _ : state) benchmark::DoNotOptimize(co_await pool.apply_async(ident, 1));
  };
  fp::run(body());
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_ApplyAsyncRoundTrip)->Arg(0)->Arg(10000)->UseRealTime();

constexpr fp::StartMethod kStartMethods[] = {fp::StartMethod::fork, fp::StartMethod::forkserver,
                                             fp::StartMethod::spawn};

// From making a pool to its first result; Args: start method (0 fork, 1 forkserver, 2 spawn),
// workers (forkpool::init() in main started the program's fork server, as CPython's is warm in
// bench/py_start.py). Spawned workers start at the same time: 4 cost about what 1 costs when
// the program's start-up waits rather than computes.
void BM_WorkerStart(benchmark::State& state) {
  for (auto _ : state) {
    auto started = std::chrono::steady_clock::now();
    fp::Pool pool({.processes = static_cast<int>(state.range(1)), .start_method = kStartMethods[state.range(0)]});
    benchmark::DoNotOptimize(pool.apply_async(ident, 1).get());
    state.SetIterationTime(std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count());
  }
}
BENCHMARK(BM_WorkerStart)
    ->ArgsProduct({{0, 1, 2}, {1, 4}})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond)
    ->Iterations(20);

// The round trip per start method: a function is named once per worker, then costs nothing.
void BM_ApplyAsyncRoundTripUnder(benchmark::State& state) {
  fp::Pool pool({.processes = 2, .start_method = kStartMethods[state.range(0)]});
  auto body = [&]() -> fp::Task<void> {
    for (int i = 0; i < 200; ++i) co_await pool.apply_async(ident, i);
    for (auto _ : state) benchmark::DoNotOptimize(co_await pool.apply_async(ident, 1));
  };
  fp::run(body());
}
BENCHMARK(BM_ApplyAsyncRoundTripUnder)->DenseRange(0, 2)->UseRealTime();

// Set by nap() in the worker: memory shared with every worker, mapped in main() before init().
std::atomic<int>* naps_started() {
  static auto* started =
      new (mmap(nullptr, sizeof(std::atomic<int>), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0))
          std::atomic<int>(0);
  return started;
}

int nap(int ms) {
  naps_started()->fetch_add(1);
  usleep(static_cast<useconds_t>(ms) * 1000);
  return ms;
}

// How long until a pool of one serves again after its running task is stopped. Arg 0: the
// task is cancelled (AsyncResult::cancel); 1: its worker is SIGKILLed from outside, the plain
// replacement; both measured from the stop to the next task's result.
void BM_StopToReplacementServing(benchmark::State& state) {
  fp::Pool pool({.processes = 1});
  for (auto _ : state) {
    int before = naps_started()->load();
    auto running = pool.apply_async(nap, 60000);
    while (naps_started()->load() == before) running.wait(std::chrono::microseconds(100));
    pid_t worker = pool.worker_pids().at(0);
    auto stopped = std::chrono::steady_clock::now();
    if (state.range(0) == 0) {
      running.cancel();
    } else {
      kill(worker, SIGKILL);
    }
    benchmark::DoNotOptimize(pool.apply_async(ident, 1).get());
    state.SetIterationTime(std::chrono::duration<double>(std::chrono::steady_clock::now() - stopped).count());
    try {
      running.get();
    } catch (const fp::Error&) {}
  }
}
BENCHMARK(BM_StopToReplacementServing)->Arg(0)->Arg(1)->UseManualTime()->Unit(benchmark::kMicrosecond)->Iterations(50);

// map of 1,000,000 trivial ints; Arg: chunksize (0 = CPython's default rule).
void BM_Map1MInts(benchmark::State& state) {
  fp::Pool pool({.processes = 2});
  std::vector<int> xs(1'000'000);
  std::iota(xs.begin(), xs.end(), 0);
  std::vector<int> ys;
  for (auto _ : state) {
    ys = fp::run(pool.map(square, xs, static_cast<std::size_t>(state.range(0))));
    benchmark::DoNotOptimize(ys.data());
  }
  for (std::size_t i = 0; i < xs.size(); i += 997)
    if (ys[i] != square(xs[i])) state.SkipWithError("a wrong result");
  state.SetItemsProcessed(state.iterations() * xs.size());
}
BENCHMARK(BM_Map1MInts)->Arg(0)->Arg(10000)->UseRealTime()->Unit(benchmark::kMillisecond);

long square_long(long x) { return x * x; }

// The same with longs: a chunk of 10,000 is 80 KB, past the inline payload (issue 11's case).
void BM_Map1MLongs(benchmark::State& state) {
  fp::Pool pool({.processes = 2});
  std::vector<long> xs(1'000'000);
  std::iota(xs.begin(), xs.end(), 0L);
  std::vector<long> ys;
  for (auto _ : state) {
    ys = fp::run(pool.map(square_long, xs, static_cast<std::size_t>(state.range(0))));
    benchmark::DoNotOptimize(ys.data());
  }
  for (std::size_t i = 0; i < xs.size(); i += 997)
    if (ys[i] != square_long(xs[i])) state.SkipWithError("a wrong result");
  state.SetItemsProcessed(state.iterations() * xs.size());
}
BENCHMARK(BM_Map1MLongs)->Arg(10000)->UseRealTime()->Unit(benchmark::kMillisecond);

// CPU-bound map at P = cores: efficiency = time on 1 process / (P × time on P).
void BM_CpuBoundMapEfficiency(benchmark::State& state) {
  int cores = static_cast<int>(sysconf(_SC_NPROCESSORS_ONLN));
  std::vector<int> work(40, 10);  // 40 tasks of 10 ms
  auto time_on = [&](int processes) {
    fp::Pool pool({.processes = processes});
    fp::run(pool.map(spin, std::vector<int>{1, 1}));  // workers warm
    auto start = std::chrono::steady_clock::now();
    fp::run(pool.map(spin, work, 1));
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  double efficiency = 0;
  for (auto _ : state) {
    double one = time_on(1), all = time_on(cores);
    efficiency = one / (cores * all);
    state.SetIterationTime(all);
  }
  state.counters["efficiency"] = efficiency;
  state.counters["processes"] = cores;
}
BENCHMARK(BM_CpuBoundMapEfficiency)->UseManualTime()->Iterations(3)->Unit(benchmark::kMillisecond);

// Oversubscribed: three pools of two workers each on this machine's cores, all busy with
// CPU-bound tasks (120 of 2 ms per pool, in chunks of one, so replies come back to back). Arg:
// spin_arg. Spinning must back off here: compare the two Args of the same run (within 5%).
void BM_ThreePoolsOfTwoCpuBound(benchmark::State& state) {
  fp::PoolOptions options{.processes = 2};
  options.spin = spin_arg(state.range(0));
  fp::Pool a(options), b(options), c(options);
  std::vector<int> work(120, 2);
  for (auto _ : state) {
    auto all = [&]() -> fp::Task<void> {
      auto [x, y, z] = co_await fp::when_all(a.map(spin, work, 1), b.map(spin, work, 1), c.map(spin, work, 1));
      benchmark::DoNotOptimize(x.size() + y.size() + z.size());
    };
    fp::run(all());
  }
}
BENCHMARK(BM_ThreePoolsOfTwoCpuBound)->Arg(0)->Arg(1)->UseRealTime()->Unit(benchmark::kMillisecond)->Iterations(3);

// imap over 10,000,000 items: the input is lazy and the window bounded, so RSS stays flat.
void BM_Imap10MFlatMemory(benchmark::State& state) {
  fp::Pool pool({.processes = 2});
  long growth = 0;
  for (auto _ : state) {
    long before = rss_kib();
    auto body = [&]() -> fp::Task<long> {
      fp::Stream<int> results = pool.imap(ident, std::views::iota(0, 10'000'000), 10000);
      long sum = 0;
      while (std::optional<int> r = co_await results.next()) sum += *r;
      co_return sum;
    };
    benchmark::DoNotOptimize(fp::run(body()));
    growth = rss_kib() - before;
  }
  state.counters["rss_growth_kib"] = static_cast<double>(growth);
  state.SetItemsProcessed(state.iterations() * 10'000'000);
}
BENCHMARK(BM_Imap10MFlatMemory)->Iterations(1)->UseRealTime()->Unit(benchmark::kMillisecond);

}  // namespace

int main(int argc, char** argv) {
  naps_started();  // before init(): the program's fork server, every worker's ancestor, must share it
  fp::init();      // spawned workers serve from here; later pools fork from the program's fork server
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
