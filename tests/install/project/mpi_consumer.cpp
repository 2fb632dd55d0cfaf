// forkpool-mpi found through CMake's forkpool::mpi (or `pkg-config forkpool-mpi`): it compiles and
// links against the installed library. Run outside mpirun it only reports that it is not in a job.
#include <forkpool/mpi.hpp>

#include <cstdio>

int main() {
  std::printf("forkpool-mpi linked; mpi::Pool is %zu bytes\n", sizeof(forkpool::mpi::Pool));
  return 0;
}
