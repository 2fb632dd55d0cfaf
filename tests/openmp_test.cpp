// Workers and OpenMP: a fork copies the OpenMP runtime's team without its threads, and a forked
// worker's next parallel region would wait for them for ever (libgomp; pytorch#17199).

#include <gtest/gtest.h>
#include <omp.h>

#include <chrono>

#include <forkpool/forkpool.hpp>

namespace forkpool {
namespace {

using namespace std::chrono_literals;

struct Region {
  int threads;
  long sum;
};
Region a_parallel_sum(int n) {
  long sum = 0;
  int threads = 0;
#pragma omp parallel reduction(+ : sum)
  {
#pragma omp single
    threads = omp_get_num_threads();
#pragma omp for
    for (int i = 0; i < n; ++i) sum += i % 7;
  }
  return {threads, sum};
}
std::pair<int, long> region_in_worker(int n) {
  Region r = a_parallel_sum(n);
  return {r.threads, r.sum};
}

void two_threads() { omp_set_num_threads(2); }

TEST(OpenMpTest, AForkedWorkerRunsParallelRegionsAfterTheParentRanThemOnOneThread) {
  omp_set_num_threads(2);
  Region parent = a_parallel_sum(1 << 20);
  ASSERT_EQ(parent.threads, 2);  // the parent's team: two threads
  for (StartMethod method : {StartMethod::fork, StartMethod::forkserver}) {
    SCOPED_TRACE(static_cast<int>(method));
    Pool pool({.processes = 1, .start_method = method});
    AsyncResult<std::pair<int, long>> region = pool.apply_async(region_in_worker, 1 << 20);
    ASSERT_TRUE(region.wait(20s)) << "the worker's parallel region never finished";
    EXPECT_EQ(region.get(), std::make_pair(1, parent.sum));
  }
  // The suite's fork server started clean (init() first in main): an initializer may ask for more.
  Pool chosen({.processes = 1, .initializer = two_threads, .start_method = StartMethod::forkserver});
  EXPECT_EQ(chosen.apply_async(region_in_worker, 1 << 20).get(20s), std::make_pair(2, parent.sum));
}

}  // namespace
}  // namespace forkpool
