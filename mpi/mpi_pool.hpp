#pragma once
// forkpool across machines on MPI. A program started with `mpirun -n <nodes> ./program` calls
// mpi::init() first in main(); rank 0 goes on to run the program, every other rank serves it.
// An mpi::Pool is a Pool (pool.hpp) whose chunks run on the workers of every node: rank 0's own
// node, and one rank per other node, each running an ordinary local pool.
//
//   int main(int argc, char** argv) {
//     forkpool::mpi::init(argc, argv);       // ranks other than 0 serve here, then exit
//     forkpool::mpi::Pool pool({.processes = 4});   // 4 workers on each node
//     auto squares = forkpool::run(pool.map(square, inputs));
//   }
//
// Thread: init() and every mpi::Pool belong to the thread that called init() (MPI is initialised
// MPI_THREAD_FUNNELED); elsewhere they throw std::logic_error.

#include <forkpool/pool/pool.hpp>
#include <forkpool/runtime/error.hpp>

namespace forkpool::mpi {

// The ranks do not all run the same build of the program (their GNU build ids differ): code
// addresses could not be translated between them. Thrown by init() on every rank.
class BuildMismatch : public Error {
 public:
  using Error::Error;
};

// First in main(), before any thread is started. Starts this node's fork server (the workers'
// ancestor, made before MPI's threads exist), initialises MPI (MPI_THREAD_FUNNELED) and checks
// that every rank runs the same build. Rank 0 returns; another rank serves rank 0's pools until
// rank 0's program exits, then finalises MPI and exits 0 (it never returns). Rank 0 finalises
// MPI when its program exits. Throws BuildMismatch (after MPI_Finalize) when builds differ,
// std::logic_error when called twice.
void init(int& argc, char**& argv);

// The number of ranks (after init()).
int world_size();
// The number of nodes whose workers an mpi::Pool uses: ranks sharing one machine are one node
// (MPI_COMM_TYPE_SHARED), unless FORKPOOL_MPI_NODE_PER_RANK=1 makes every rank its own.
int node_count();

namespace detail {
std::shared_ptr<forkpool::detail::PoolCore> make_pool_core(PoolOptions options);
}

// Pool's interface over every node: map, imap, apply_async and the rest, close/terminate/join,
// cancel and timeouts, as on one machine. PoolOptions::processes counts workers per node (0: one
// per CPU of each node); processes() is the total. Workers are always started by each node's fork
// server. A chunk goes to the node with the most free workers, rank 0's own on a tie. Tensors
// cross to another node as bytes in MPI messages, written into the receiving rank's shared
// memory; within a node they cross as shared memory. A chunk whose arguments carry other
// descriptors (queues, events) runs on rank 0's node. worker_pids() lists rank 0's node's.
// A worker's death on any node is a WorkerLost (or a retry) for its tasks; a rank's death ends
// the MPI job (mpirun exits non-zero).
class Pool : public forkpool::Pool {
 public:
  explicit Pool(PoolOptions options = {}) : forkpool::Pool(detail::make_pool_core(std::move(options))) {}
};

}  // namespace forkpool::mpi
