// forkpool across machines: the same map over every node's workers, started with mpirun.
//
//   mpirun --mca pml ob1 -n 3 build/examples/mpi_map          (one rank per node)
//
// Rank 0 runs main() past init(); every other rank serves its node's workers until rank 0 exits.
// On one machine the ranks are one node; FORKPOOL_MPI_NODE_PER_RANK=1 makes each its own.

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <string>
#include <vector>

#include <forkpool/mpi.hpp>

namespace fp = forkpool;

// Where a call ran: the MPI rank whose node's worker ran it (mpirun puts it in the environment).
static int rank_of_worker(int) {
  for (const char* name : {"OMPI_COMM_WORLD_RANK", "PMI_RANK"})
    if (const char* value = std::getenv(name)) return std::atoi(value);
  return 0;
}

static long square(long x) { return x * x; }

static fp::Task<int> amain() {
  fp::mpi::Pool pool({.processes = 2});
  std::printf("%d ranks, %d nodes, %d workers\n", fp::mpi::world_size(), fp::mpi::node_count(), pool.processes());

  std::vector<long> inputs(100000);
  std::iota(inputs.begin(), inputs.end(), 0L);
  std::vector<long> squares = co_await pool.map(square, inputs, 1000);
  long sum = std::accumulate(squares.begin(), squares.end(), 0L);
  std::printf("sum of squares of 0..99999: %ld\n", sum);

  std::vector<int> ranks = co_await pool.map(rank_of_worker, std::vector<int>(64), 1);
  std::vector<int> per_rank(static_cast<std::size_t>(fp::mpi::world_size()));
  for (int rank : ranks) ++per_rank[static_cast<std::size_t>(rank)];
  for (std::size_t r = 0; r < per_rank.size(); ++r) std::printf("rank %zu's node ran %d of 64 calls\n", r, per_rank[r]);

  long one = co_await pool.apply_async(square, 12L);
  std::printf("apply_async(square, 12) = %ld\n", one);
  pool.close();
  co_await pool.join();
  co_return sum == 333328333350000L && one == 144 ? 0 : 1;
}

int main(int argc, char** argv) {
  fp::mpi::init(argc, argv);  // ranks other than 0 serve here and never return
  return fp::run(amain());
}
