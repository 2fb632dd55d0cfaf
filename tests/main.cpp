// The suite's main: meson runs each test binary once per backend (FORKPOOL_BACKEND). A backend
// this kernel lacks is a skip (exit 77), never a silent pass; nor is a filter that matches no test.

#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include <forkpool/worker/init.hpp>
#include <forkpool/runtime/loop.hpp>

#include "support.hpp"

int main(int argc, char** argv) {
  // A main that exits before init(), as one that parses its arguments first might: the spawn
  // tests check that the pool says so instead of waiting.
  if (std::getenv("FORKPOOL_TEST_EXIT_BEFORE_INIT") && std::getenv("FORKPOOL_SPAWNED_WORKER")) return 3;
  // Spawned workers that go on to init() only once `parties` of them have started: a pool that
  // starts them one after another never gets there (the spawn tests check it does).
  if (const char* parties = std::getenv("FORKPOOL_TEST_MEET_BEFORE_INIT");
      parties && std::getenv("FORKPOOL_SPAWNED_WORKER"))
    if (!forkpool::test_support::meet_before_init(std::atoi(parties))) return 4;
  forkpool::test_support::mark_test_run();
  forkpool::init();  // a spawned worker serves from here; the suite starts its fork server
  ::testing::InitGoogleTest(&argc, argv);
  const char* forced = std::getenv("FORKPOOL_BACKEND");
  try {
    forkpool::Loop::current();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "skipping: backend %s unavailable: %s\n", forced ? forced : "(default)", e.what());
    return 77;
  }
  int result = RUN_ALL_TESTS();
  // A filter that matches nothing would pass without testing anything (the threads suite's
  // tensor run did, for a while): that is a failure.
  if (::testing::UnitTest::GetInstance()->test_to_run_count() == 0) {
    std::fprintf(stderr, "no test ran: the filter matches none\n");
    return 1;
  }
  return result;
}
