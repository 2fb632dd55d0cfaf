#pragma once
// What forkpool::mpi::init() learnt about the job, for the rest of the MPI part.

#include <string>
#include <thread>
#include <vector>

#include <forkpool/mpi/private/transport.hpp>
#include <forkpool/worker/internal/protocol.hpp>

namespace forkpool::mpi::detail {

struct World {
  int rank = 0;
  int size = 1;
  // Rank 0's view: the rank that runs each other node's workers (the lowest rank of the node).
  std::vector<int> node_ranks;
  // Rank 0's loaded objects, in whose terms task payloads name code.
  std::vector<forkpool::detail::ObjectRecord> rank0_objects;
  std::thread::id thread;  // the thread that called init(): the only one that may call MPI
  Transport transport;
};

// The world init() made. Throws std::logic_error before init(), or on another thread than init()'s.
World& world(const char* who);

}  // namespace forkpool::mpi::detail
