// forkpool::mpi under mpirun, 3 ranks on this machine: the apply_async round trip (the peer is
// mpi4py.futures, bench/py_mpi4py.py, started the same way) and map throughput over every node
// against a local pool of the same total workers.
//
//   FORKPOOL_MPI_NODE_PER_RANK=1 mpirun --mca pml ob1 --oversubscribe -n 3 build-release/bench/mpi_bench
//
// With FORKPOOL_MPI_NODE_PER_RANK=1 each rank is a node, so chunks do cross MPI; without it the
// three ranks are one node and only rank 0's workers run.

#include <benchmark/benchmark.h>

#include <cstdint>
#include <vector>

#include <forkpool/mpi.hpp>

namespace fp = forkpool;

namespace {

long add(long a, long b) { return a + b; }

// About 40 µs of arithmetic: enough that a chunk's work outweighs its trip.
std::uint64_t work(std::uint64_t x) {
  for (int i = 0; i < 20000; ++i) x = x * 6364136223846793005ULL + 1442695040888963407ULL;
  return x;
}

fp::mpi::Pool& mpi_pool() {
  static fp::mpi::Pool pool({.processes = 1});
  return pool;
}

void BM_MpiApplyAsyncRoundTrip(benchmark::State& state) {
  auto& pool = mpi_pool();
  for (auto _ : state) benchmark::DoNotOptimize(pool.apply_async(add, 1L, 2L).get());
  state.counters["nodes"] = fp::mpi::node_count();
}
BENCHMARK(BM_MpiApplyAsyncRoundTrip)->UseRealTime();

void map_rate(benchmark::State& state, fp::Pool& pool) {
  std::vector<std::uint64_t> inputs(3000, 7);
  for (auto _ : state) benchmark::DoNotOptimize(fp::run(pool.map(work, inputs, 10)));
  state.SetItemsProcessed(state.iterations() * static_cast<std::int64_t>(inputs.size()));
  state.counters["workers"] = pool.processes();
}

void BM_MpiMapOverNodes(benchmark::State& state) { map_rate(state, mpi_pool()); }
BENCHMARK(BM_MpiMapOverNodes)->UseRealTime()->Unit(benchmark::kMillisecond);

void BM_LocalMapSameWorkers(benchmark::State& state) {
  static fp::Pool pool({.processes = mpi_pool().processes()});
  map_rate(state, pool);
}
BENCHMARK(BM_LocalMapSameWorkers)->UseRealTime()->Unit(benchmark::kMillisecond);

}  // namespace

int main(int argc, char** argv) {
  fp::mpi::init(argc, argv);  // the other ranks serve here
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
