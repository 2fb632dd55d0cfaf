#pragma once
// forkpool's MPI part: library and pkg-config name forkpool-mpi (docs/mpi.md).
#include <forkpool/forkpool.hpp>
#include <forkpool/mpi/mpi_pool.hpp>
