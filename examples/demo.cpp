// The main job: count the primes below N on every core, with a live progress line, then compare
// the wall time on one worker process with all of them.

#include <forkpool/forkpool.hpp>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <unistd.h>
#include <utility>
#include <vector>

namespace fp = forkpool;

// Primes in [begin, end), by trial division: deliberately CPU-bound.
std::int64_t count_primes(std::pair<std::int64_t, std::int64_t> range) {
  std::int64_t count = 0;
  for (std::int64_t n = std::max<std::int64_t>(range.first, 2); n < range.second; ++n) {
    bool prime = true;
    for (std::int64_t d = 2; d * d <= n; ++d)
      if (n % d == 0) {
        prime = false;
        break;
      }
    count += prime;
  }
  return count;
}

struct Outcome {
  std::int64_t primes = 0;
  double seconds = 0;
};

fp::Task<std::int64_t> sum(fp::Stream<std::int64_t>& counts) {
  std::int64_t total = 0;
  while (std::optional<std::int64_t> count = co_await counts.next()) total += *count;
  co_return total;
}

fp::Task<Outcome> count_on(int processes, const std::vector<std::pair<std::int64_t, std::int64_t>>& ranges) {
  fp::Pool pool({.processes = processes});
  auto started = std::chrono::steady_clock::now();
  fp::Stream<std::int64_t> counts = pool.imap_unordered(count_primes, ranges);
  std::string label = "  " + std::to_string(processes) + (processes == 1 ? " process" : " processes");
  // The sum and the progress line run side by side on the loop.
  auto [primes, shown] = co_await fp::when_all(sum(counts), fp::show_progress(counts, label));
  Outcome outcome{primes, std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count()};
  pool.close();
  co_await pool.join();
  co_return outcome;
}

fp::Task<int> amain(std::int64_t limit) {
  std::vector<std::pair<std::int64_t, std::int64_t>> ranges;
  const std::int64_t step = limit / 200;
  for (std::int64_t begin = 0; begin < limit; begin += step) ranges.emplace_back(begin, std::min(begin + step, limit));

  int cores = static_cast<int>(std::max(1L, sysconf(_SC_NPROCESSORS_ONLN)));
  std::printf("counting primes below %lld in %zu ranges (%s backend)\n", static_cast<long long>(limit), ranges.size(),
              fp::Loop::current().backend_name());
  Outcome one = co_await count_on(1, ranges);
  Outcome all = co_await count_on(cores, ranges);
  if (one.primes != all.primes) {
    std::printf("mismatch: %lld vs %lld\n", static_cast<long long>(one.primes), static_cast<long long>(all.primes));
    co_return 1;
  }
  std::printf("primes below %lld: %lld\n", static_cast<long long>(limit), static_cast<long long>(all.primes));
  std::printf("1 process: %.2f s   %d processes: %.2f s   speedup %.2fx (efficiency %.0f%%)\n", one.seconds, cores,
              all.seconds, one.seconds / all.seconds, 100.0 * one.seconds / all.seconds / cores);
  co_return 0;
}

int main(int argc, char** argv) {
  fp::init();  // first: starts the fork server while the program has no threads
  std::int64_t limit = argc > 1 ? std::atoll(argv[1]) : 6'000'000;
  return fp::run(amain(limit));
}
