// Task, run and when_all: order of resumption, exceptions, stack depth, nesting.

#include <gtest/gtest.h>

#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include <forkpool/runtime/internal/io.hpp>
#include <forkpool/runtime/internal/one_shot.hpp>
#include <forkpool/runtime/loop.hpp>
#include <forkpool/runtime/scope.hpp>
#include <forkpool/runtime/task.hpp>
#include <forkpool/runtime/when_all.hpp>

#include "support.hpp"

namespace forkpool {
namespace {

Task<int> constant(int value) { co_return value; }

Task<int> add_one(int value) { co_return co_await constant(value) + 1; }

TEST(Task, RunReturnsTheValueOfTheAwaitedChain) { EXPECT_EQ(run(add_one(41)), 42); }

TEST(Task, IsLazyUntilAwaited) {
  bool started = false;
  auto body = [&]() -> Task<void> {
    started = true;
    co_return;
  };
  Task<void> task = body();
  EXPECT_FALSE(started);
  run(std::move(task));
  EXPECT_TRUE(started);
}

Task<int> throws_runtime_error() {
  throw std::runtime_error("boom");
  co_return 0;
}

TEST(Task, ExceptionsPropagateThroughCoAwait) {
  auto outer = []() -> Task<std::string> {
    try {
      co_await throws_runtime_error();
    } catch (const std::runtime_error& e) {
      co_return std::string("caught ") + e.what();
    }
    co_return "not caught";
  };
  EXPECT_EQ(run(outer()), "caught boom");
  EXPECT_THROW(run(throws_runtime_error()), std::runtime_error);
}

// A Task runs once. Before, a second co_await gave its value again, moved from (an empty vector,
// silently); one awaited while it ran was resumed in the middle of its run; and a Task a move
// emptied was read through null.
Task<std::vector<int>> three_numbers() { co_return std::vector<int>{1, 2, 3}; }
Task<void> sleep_a_little() { co_await sleep_for(std::chrono::milliseconds(20)); }

TEST(Task, ATaskAwaitedOrRunTwiceOrAfterAMoveIsALogicError) {
  auto expect_runs_once = [](auto attempt) {
    try {
      attempt();
      ADD_FAILURE() << "a Task ran a second time";
    } catch (const std::logic_error& e) {
      EXPECT_NE(std::string(e.what()).find("a Task runs once"), std::string::npos) << e.what();
    }
  };
  Task<std::vector<int>> numbers = three_numbers();
  EXPECT_EQ(run([&]() -> Task<std::vector<int>> { co_return co_await numbers; }()), (std::vector<int>{1, 2, 3}));
  expect_runs_once([&] { run([&]() -> Task<std::vector<int>> { co_return co_await numbers; }()); });

  Task<std::vector<int>> ran = three_numbers();
  EXPECT_EQ(run(std::move(ran)).size(), 3u);  // run() takes it: `ran` is empty now
  test_support::expect_moved_from_error("Task", [&] { run(std::move(ran)); });

  Task<void> sleeping = sleep_a_little();
  auto twice = [&]() -> Task<void> {
    co_await when_all([&]() -> Task<void> { co_await sleeping; }(), [&]() -> Task<void> { co_await sleeping; }());
  };
  expect_runs_once([&] { run(twice()); });

  Task<int> moved = constant(7);
  Task<int> kept = std::move(moved);
  test_support::expect_moved_from_error("Task", [&] { run([&]() -> Task<int> { co_return co_await moved; }()); });
  EXPECT_EQ(run(std::move(kept)), 7);
}

TEST(Task, AMillionSynchronousAwaitsDoNotGrowTheStack) {
  auto loop_body = []() -> Task<long> {
    long sum = 0;
    for (int i = 0; i < 1'000'000; ++i) sum += co_await constant(1);
    co_return sum;
  };
  EXPECT_EQ(run(loop_body()), 1'000'000);
}

TEST(Task, ResumesInTheOrderItsTimersFire) {
  std::vector<int> order;
  auto after = [&](int ms, int tag) -> Task<void> {
    co_await sleep_for(std::chrono::milliseconds(ms));
    order.push_back(tag);
  };
  run(when_all(after(30, 3), after(10, 1), after(20, 2)));
  EXPECT_EQ(order, (std::vector<int>{1, 2, 3}));
}

TEST(WhenAll, GivesEveryValueInArgumentOrder) {
  auto [a, b, c] = run(when_all(constant(1), add_one(1), constant(3)));
  EXPECT_EQ(a, 1);
  EXPECT_EQ(b, 2);
  EXPECT_EQ(c, 3);
}

TEST(WhenAll, OfAVectorGivesValuesInOrder) {
  std::vector<Task<int>> tasks;
  for (int i = 0; i < 100; ++i) tasks.push_back(add_one(i));
  std::vector<int> values = run(when_all(std::move(tasks)));
  ASSERT_EQ(values.size(), 100u);
  for (int i = 0; i < 100; ++i) EXPECT_EQ(values[i], i + 1);
}

TEST(WhenAll, FirstExceptionWinsOnlyAfterAllEnded) {
  bool slow_finished = false;
  auto fails_after = [](int ms, std::string what) -> Task<int> {
    co_await sleep_for(std::chrono::milliseconds(ms));
    throw std::runtime_error(what);
  };
  auto slow = [&]() -> Task<int> {
    co_await sleep_for(std::chrono::milliseconds(40));
    slow_finished = true;
    co_return 1;
  };
  try {
    run(when_all(fails_after(20, "second"), fails_after(5, "first"), slow()));
    FAIL() << "when_all did not throw";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "first");
  }
  EXPECT_TRUE(slow_finished);
}

TEST(WhenAll, OfVoidTasksCompletes) {
  int ran = 0;
  auto bump = [&]() -> Task<void> {
    ++ran;
    co_return;
  };
  run(when_all(bump(), bump()));
  EXPECT_EQ(ran, 2);
}

TEST(Run, CalledFromInsideACoroutineThrowsLogicError) {
  auto nested = []() -> Task<bool> {
    try {
      run(constant(1));
    } catch (const std::logic_error&) {
      co_return true;
    }
    co_return false;
  };
  EXPECT_TRUE(run(nested()));
}

TEST(Run, AfterANestedFailureTheLoopStillRuns) {
  auto nested = []() -> Task<void> {
    EXPECT_THROW(run(constant(1)), std::logic_error);
    co_await sleep_for(std::chrono::milliseconds(1));
  };
  run(nested());
  EXPECT_EQ(run(constant(5)), 5);
}

TEST(Scope, StartRunsATaskWithoutAwaitingItAndJoinWaitsForAll) {
  std::vector<int> order;
  auto step = [](std::vector<int>& out, int id, std::chrono::milliseconds delay) -> Task<void> {
    co_await sleep_for(delay);
    out.push_back(id);
  };
  auto body = [&]() -> Task<int> {
    Scope scope;
    scope.start(step(order, 2, std::chrono::milliseconds(20)));
    scope.start(step(order, 1, std::chrono::milliseconds(5)));
    EXPECT_EQ(scope.active(), 2u);
    EXPECT_TRUE(order.empty());  // started, not finished: start() did not wait
    co_await scope.join();
    EXPECT_EQ(scope.active(), 0u);
    co_return static_cast<int>(order.size());
  };
  EXPECT_EQ(run(body()), 2);
  EXPECT_EQ(order, (std::vector<int>{1, 2}));
}

TEST(Scope, JoinRethrowsTheFirstExceptionAfterAllEnded) {
  bool slow_finished = false;
  auto fails = []() -> Task<void> {
    co_await sleep_for(std::chrono::milliseconds(1));
    throw std::runtime_error("first");
  };
  auto slow = [](bool& done) -> Task<void> {
    co_await sleep_for(std::chrono::milliseconds(20));
    done = true;
  };
  auto body = [&]() -> Task<void> {
    Scope scope;
    scope.start(fails());
    scope.start(slow(slow_finished));
    co_await scope.join();
  };
  EXPECT_THROW(
      {
        try {
          run(body());
        } catch (const std::runtime_error& e) {
          EXPECT_STREQ(e.what(), "first");
          throw;
        }
      },
      std::runtime_error);
  EXPECT_TRUE(slow_finished);
}

TEST(Scope, JoinOfAnEmptyScopeCompletesAtOnce) {
  auto body = []() -> Task<int> {
    Scope scope;
    co_await scope.join();
    co_return 7;
  };
  EXPECT_EQ(run(body()), 7);
}

TEST(OneShot, SetResumesEveryWaiterOnceInTheOrderTheyCame) {
  std::vector<int> order;
  auto waiter = [](detail::OneShot& flag, std::vector<int>& out, int id) -> Task<void> {
    co_await flag;
    out.push_back(id);
  };
  auto body = [&]() -> Task<void> {
    detail::OneShot flag;
    Scope scope;
    for (int id = 1; id <= 3; ++id) scope.start(waiter(flag, order, id));
    EXPECT_TRUE(order.empty());
    flag.set();
    flag.set();                           // a second set() resumes nobody again
    scope.start(waiter(flag, order, 4));  // set already: does not wait
    // set() resumes inline: a waiter still suspended now would never end, so it fails the test
    // here rather than hang it in join().
    EXPECT_EQ(scope.active(), 0u) << "a waiter set() did not resume";
    if (scope.active() == 0) co_await scope.join();
  };
  run(body());
  EXPECT_EQ(order, (std::vector<int>{1, 2, 3, 4}));
}

TEST(OneShot, AWaiterMayDestroyTheFlagItWasResumedBy) {
  auto flag = std::make_unique<detail::OneShot>();
  int resumed = 0;
  auto waiter = [](std::unique_ptr<detail::OneShot>& owner, int& count) -> Task<void> {
    co_await *owner;
    ++count;
    owner.reset();  // the flag's set() is still on the stack, with a waiter left to resume
  };
  auto body = [&]() -> Task<void> {
    Scope scope;
    scope.start(waiter(flag, resumed));
    scope.start(waiter(flag, resumed));
    flag->set();
    EXPECT_EQ(scope.active(), 0u) << "a waiter set() did not resume";
    if (scope.active() == 0) co_await scope.join();
  };
  run(body());
  EXPECT_EQ(resumed, 2);
  EXPECT_EQ(flag, nullptr);
}

}  // namespace
}  // namespace forkpool
