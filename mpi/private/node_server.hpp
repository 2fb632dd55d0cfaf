#pragma once
// What a rank other than 0 does after init(): serves rank 0 until it says shutdown. For each
// mpi::Pool rank 0 makes, this rank (if it runs a node) makes an ordinary local pool, runs the
// jobs rank 0 sends on it, with all of a local pool's machinery (WorkerLost, retries, timeouts,
// cancel), and sends each result back. Polls MPI with backoff (polling.hpp) the whole time: idle,
// that is one probe a millisecond.

namespace forkpool::mpi::detail {

struct World;

// Drives this thread's loop until rank 0 says shutdown.
void serve_node(World& world);

}  // namespace forkpool::mpi::detail
