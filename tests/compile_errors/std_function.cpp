// expect: a std::function, a member function pointer
#include <forkpool/forkpool.hpp>

#include <functional>

int main() {
  forkpool::Pool pool({.processes = 1});
  std::function<int(int)> f = [](int x) { return x; };
  return pool.apply_async(f, 1).get();
}
