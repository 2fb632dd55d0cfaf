// expect: an aggregate with a pointer member cannot cross as its bytes
#include <forkpool/forkpool.hpp>

struct Sample {
  int id;
  float* pixels;  // means nothing in another process
};
Sample identity(Sample s) { return s; }

int main() {
  forkpool::Pool pool({.processes = 1});
  return pool.apply_async(identity, Sample{}).get().id;
}
