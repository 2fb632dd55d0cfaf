#pragma once
// forkpool's MPI part: library and pkg-config name forkpool-mpi (API.md, "Across machines: MPI").
#include <forkpool/forkpool.hpp>
#include <forkpool/mpi/mpi_pool.hpp>
