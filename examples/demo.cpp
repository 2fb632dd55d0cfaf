// Placeholder demo: the event loop with timers and when_all (replaced by the pool demo).
#include <forkpool/forkpool.hpp>

#include <cstdio>

namespace fp = forkpool;

fp::Task<int> tick(int id, int ms) {
  co_await fp::sleep_for(std::chrono::milliseconds(ms));
  std::printf("task %d woke after %d ms\n", id, ms);
  co_return id;
}

int main() {
  auto [a, b] = fp::run(fp::when_all(tick(1, 20), tick(2, 10)));
  std::printf("when_all gave %d and %d on the %s backend\n", a, b, fp::Loop::current().backend_name());
}
