// The suite's main: meson runs each test binary once per backend (FORKPOOL_BACKEND). A backend
// this kernel lacks is a skip (exit 77), never a silent pass.

#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include <forkpool/pool/init.hpp>
#include <forkpool/runtime/loop.hpp>

#include "support.hpp"

int main(int argc, char** argv) {
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
  return RUN_ALL_TESTS();
}
