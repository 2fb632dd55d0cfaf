// Processes, queues, events, locks and barriers across real processes, under every start method.

#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstdio>
#include <fstream>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <forkpool/pool/pool.hpp>
#include <forkpool/pool/process.hpp>
#include <forkpool/shm/shared_memory.hpp>
#include <forkpool/sync/pipe.hpp>
#include <forkpool/sync/queue.hpp>
#include <forkpool/pool/spawn.hpp>
#include <forkpool/sync/sync.hpp>
#include <forkpool/runtime/error.hpp>
#include <forkpool/runtime/loop.hpp>
#include <forkpool/shm/tensor.hpp>
#include <forkpool/shm/tensor_codec.hpp>

#include "support.hpp"

namespace forkpool {
namespace {

using namespace std::chrono_literals;

void put_square(Queue<int> q, int x) { q.put(x * x); }
void raise_domain_error(int) { throw std::domain_error("no such thing"); }
void sleep_for_ever(int) {
  for (;;) pause();
}

// Tensor `id` holds 256 floats, each id + i / 1000.
Tensor tensor_number(int id) {
  Tensor t = Tensor::empty({256}, DType::f32);
  for (int i = 0; i < 256; ++i) t.data<float>()[i] = static_cast<float>(id) + static_cast<float>(i) / 1000;
  return t;
}
bool is_tensor_number(const Tensor& t, int id) {
  if (t.numel() != 256) return false;
  for (int i = 0; i < 256; ++i)
    if (t.data<float>()[i] != static_cast<float>(id) + static_cast<float>(i) / 1000) return false;
  return true;
}

void produce_tensors(Queue<Tensor> q, int first, int count) {
  for (int id = first; id < first + count; ++id) q.put(tensor_number(id));
}

// Takes `count` tensors; reports the id of each intact one (-1 for a spoilt one).
void consume_tensors(Queue<Tensor> q, Queue<std::vector<int>> seen, int count) {
  std::vector<int> ids;
  for (int n = 0; n < count; ++n) {
    Tensor t = test_support::get_within(q);
    int id = static_cast<int>(t.data<float>()[0]);
    ids.push_back(is_tensor_number(t, id) ? id : -1);
  }
  seen.put(ids);
}

// Tensors of 64 KiB (32 to a 2 MiB slab), the first float of each its number.
void produce_large_tensors(Queue<Tensor> q, int count) {
  for (int id = 0; id < count; ++id) {
    Tensor t = Tensor::empty({16384}, DType::f32);
    std::fill_n(t.data<float>(), 16384, static_cast<float>(id));
    q.put(t);
  }
}

// A pipeline stage: forwards `count` tensors from `in` to `out` as they come.
void relay_tensors(Queue<Tensor> in, Queue<Tensor> out, int count) {
  for (int n = 0; n < count; ++n) out.put(in.get());
}

void report_first_value(Queue<float> q, Tensor t) { q.put(t.data<float>()[0]); }
void announce_with_a_tensor(Event started, Tensor t, Queue<float> report) {
  started.set();
  report.put(t.data<float>()[1]);
}
// 4 MiB of `value`: a slab of its own.
Tensor filled(float value) {
  Tensor t = Tensor::empty({1 << 20}, DType::f32);
  std::fill_n(t.data<float>(), t.numel(), value);
  return t;
}

void put_then_exit_at_once(Queue<Tensor> q, int id) {
  q.put(tensor_number(id));
  std::_Exit(0);  // no destructor, no flush: the item is the kernel's already
}

// Items of 30,000 ints (past the inline payload: a memfd each), all `n`, in an endless loop.
void put_for_ever(Queue<std::vector<int>> q, int) {
  for (int n = 0;; ++n) q.put(std::vector<int>(30000, n));
}

void hold_the_lock(Lock lock, Event held) {
  lock.lock();
  held.set();
  sleep_for_ever(0);
}

void arrive_and_pass(Barrier barrier, Queue<std::string> log) {
  log.put("arrived");
  barrier.wait();
  log.put("passed");
}

void wait_then_report(Event go, Queue<int> report) { report.put(go.wait(10s) ? 1 : 0); }

// The inode of the shared memory mapped at `address` in this process (0: none).
unsigned long inode_mapped_at(const void* address) {
  std::ifstream maps("/proc/self/maps");
  auto at = reinterpret_cast<std::uintptr_t>(address);
  for (std::string line; std::getline(maps, line);) {
    std::uintptr_t begin = 0, end = 0;
    unsigned long inode = 0;
    char perms[8], offset[32], device[32];
    if (std::sscanf(line.c_str(), "%lx-%lx %7s %31s %31s %lu", &begin, &end, perms, offset, device, &inode) == 6 &&
        at >= begin && at < end)
      return inode;
  }
  return 0;
}

class ProcessTest : public ::testing::TestWithParam<StartMethod> {
 protected:
  ProcessOptions options() { return {.start_method = GetParam()}; }
};

TEST_P(ProcessTest, AProcessRunsItsFunctionAndEndsWithExitCodeZero) {
  Queue<int> q;
  Process p = start_process(options(), put_square, q, 7);
  EXPECT_GT(p.pid(), 0);
  EXPECT_EQ(test_support::get_within(q), 49);
  EXPECT_TRUE(p.join(10s));
  EXPECT_FALSE(p.is_alive());
  EXPECT_EQ(p.exitcode(), std::optional<int>(0));
}

void sleep_then_put(Queue<int> q, int x) {
  std::this_thread::sleep_for(200ms);
  q.put(x);
}

// active_children() must not list what join() and is_alive() say has ended (CI once saw it
// listed, when it asked /proc rather than the pidfd).
TEST_P(ProcessTest, AJoinedProcessIsNoLongerAnActiveChild) {
  Queue<int> q;
  for (int round = 0; round < 20; ++round) {
    Process p = start_process(options(), put_square, q, round);
    ASSERT_TRUE(p.join(10s));
    EXPECT_FALSE(p.is_alive());
    EXPECT_FALSE(test_support::is_active_child(p.pid())) << "round " << round;
  }
}

// Assigning over a handle ends its process as destroying the handle would: a non-daemon
// process is waited for, not killed.
TEST_P(ProcessTest, AssigningOverANonDaemonProcessWaitsForItToFinish) {
  Queue<int> q;
  ProcessOptions waited = options();
  waited.daemon = false;
  Process p = start_process(waited, sleep_then_put, q, 1);
  pid_t first = p.pid();
  p = start_process(waited, put_square, q, 3);
  EXPECT_FALSE(test_support::is_active_child(first));
  std::vector<int> got{test_support::get_within(q), test_support::get_within(q)};
  std::sort(got.begin(), got.end());
  EXPECT_EQ(got, (std::vector<int>{1, 9}));
  EXPECT_TRUE(p.join(10s));
}

TEST_P(ProcessTest, AJoinOnAnotherThreadIsALogicErrorUntilTheProcessHasEnded) {
  // (It waited for ever: the exit code reaches only the starting thread's loop. A thread with a
  // loop of its own drove that one.)
  int status = test_support::run_in_child_within(20s, [&] {
    Queue<int> q;
    Process p = start_process(options(), sleep_then_put, q, 1);
    const std::string rule = " called on another thread than the one that started the process, before it ended";
    std::string plain = test_support::logic_error_on_another_thread([&] { p.join(); });
    EXPECT_NE(plain.find("Process::join" + rule), std::string::npos) << plain;
    std::string with_a_loop = test_support::logic_error_on_another_thread([&] {
      run(sleep_for(1ms));  // this thread now has a loop of its own
      p.join(5s);
    });
    EXPECT_NE(with_a_loop.find("Process::join" + rule), std::string::npos) << with_a_loop;
    std::string awaited = test_support::logic_error_on_another_thread([&] { run(p.async_join()); });
    EXPECT_NE(awaited.find("Process::async_join" + rule), std::string::npos) << awaited;
    EXPECT_EQ(test_support::get_within(q), 1);
    EXPECT_TRUE(p.join(10s));
    bool joined = false;
    int code = -1;
    std::thread([&] {  // ended: any thread may join it
      joined = p.join();
      code = run(p.async_join());
    })
        .join();
    EXPECT_TRUE(joined);
    EXPECT_EQ(code, 0);
    EXPECT_EQ(p.exitcode(), std::optional<int>(0));
    p.close();
    EXPECT_EQ(run(p.async_join()), 0);  // closed: as join(), at once (it threw std::bad_function_call)
  });
  test_support::expect_ended_well(status, "hung: a join on another thread");
}

TEST_P(ProcessTest, AnExceptionEscapingTheFunctionIsExitCodeOne) {
  Process p = start_process(options(), raise_domain_error, 0);
  EXPECT_TRUE(p.join(10s));
  EXPECT_EQ(p.exitcode(), std::optional<int>(1));
}

TEST_P(ProcessTest, AKilledProcessHasMinusTheSignalAsExitCodeAndJoinTimesOutBefore) {
  Process p = start_process(options(), sleep_for_ever, 0);
  EXPECT_FALSE(p.join(50ms));
  EXPECT_TRUE(p.is_alive());
  EXPECT_EQ(p.exitcode(), std::nullopt);
  p.terminate();
  EXPECT_TRUE(p.join(10s));
  EXPECT_EQ(p.exitcode(), std::optional<int>(-SIGTERM));
  Process q = start_process(options(), sleep_for_ever, 0);
  q.kill();
  EXPECT_EQ(run(q.async_join()), -SIGKILL);
}

TEST_P(ProcessTest, AThousandTensorsFromTwoProducersReachTwoConsumersEachOnceAndIntact) {
  Queue<Tensor> q;
  Queue<std::vector<int>> seen;
  std::vector<Process> processes;
  processes.push_back(start_process(options(), produce_tensors, q, 0, 500));
  processes.push_back(start_process(options(), produce_tensors, q, 500, 500));
  processes.push_back(start_process(options(), consume_tensors, q, seen, 500));
  processes.push_back(start_process(options(), consume_tensors, q, seen, 500));
  std::vector<int> all = seen.get();
  std::vector<int> more = seen.get();
  all.insert(all.end(), more.begin(), more.end());
  std::sort(all.begin(), all.end());
  std::vector<int> expected(1000);
  for (int i = 0; i < 1000; ++i) expected[i] = i;
  EXPECT_EQ(all, expected);
  for (Process& p : processes) {
    EXPECT_TRUE(p.join(10s));
    EXPECT_EQ(p.exitcode(), std::optional<int>(0));
  }
}

// A consumer that drops each tensor sends its block home: the producer's next tensors are
// written into the same slab, which the consumer has mapped already.
TEST_P(ProcessTest, TensorsThatTheConsumerDropsAreRecycledIntoTheSameSlab) {
  Queue<Tensor> q(4);
  Process p = start_process(options(), produce_large_tensors, q, 300);
  std::set<unsigned long> slabs;
  for (int i = 0; i < 300; ++i) {
    Tensor t = test_support::get_within(q);
    ASSERT_EQ(t.data<float>()[16383], static_cast<float>(i));
    slabs.insert(inode_mapped_at(t.raw_data()));
  }
  EXPECT_TRUE(p.join(10s));
  EXPECT_LE(slabs.size(), 2u) << "a new slab for every item: nothing came home";
}

// The relay's next put takes home what the parent dropped: the relay's hold on a block it only
// borrowed ends there, and that release must not wait for the lock the put holds.
TEST_P(ProcessTest, AStageThatForwardsTensorsItGotFromAQueueKeepsForwarding) {
  Queue<Tensor> in(2), out(2);
  Process producer = start_process(options(), produce_tensors, in, 0, 40);
  Process relay = start_process(options(), relay_tensors, in, out, 40);
  for (int id = 0; id < 40; ++id) {
    std::optional<Tensor> t = out.get(10s);
    ASSERT_TRUE(t.has_value()) << "the relay stopped after " << id << " tensors";
    EXPECT_TRUE(is_tensor_number(*t, id));
  }
  EXPECT_TRUE(relay.join(10s));
  EXPECT_TRUE(producer.join(10s));
}

// The parent as the router: what it forwards comes home through its own next put.
TEST_P(ProcessTest, TheParentForwardsTensorsFromOneQueueToAnother) {
  Queue<Tensor> in(2), out(2);
  Queue<std::vector<int>> seen;
  Process producer = start_process(options(), produce_tensors, in, 0, 40);
  Process consumer = start_process(options(), consume_tensors, out, seen, 40);
  for (int n = 0; n < 40; ++n) {
    std::optional<Tensor> t = in.get(10s);
    ASSERT_TRUE(t.has_value());
    ASSERT_TRUE(out.put(std::move(*t), 10s)) << "forwarding stopped after " << n << " tensors";
  }
  std::optional<std::vector<int>> ids = seen.get(10s);
  ASSERT_TRUE(ids.has_value());
  std::vector<int> expected(40);
  for (int i = 0; i < 40; ++i) expected[i] = i;
  EXPECT_EQ(*ids, expected);
  EXPECT_TRUE(consumer.join(10s));
  EXPECT_TRUE(producer.join(10s));
}

// Work leaves at the call: a tensor in a slab the worker has not seen (its introduction goes
// first) reaches the worker though the caller then blocks without driving the loop.
TEST_P(ProcessTest, ATaskWithATensorInANewSlabRunsWhileTheCallerBlocksOnAQueue) {
  Pool pool({.processes = 1, .start_method = GetParam()});
  Queue<float> q;
  for (float value : {3.0f, 4.0f}) {
    Tensor t = filled(value);
    AsyncResult<void> done = pool.apply_async(report_first_value, q, t);
    EXPECT_EQ(q.get(10s), std::optional<float>(value));
    done.get();
  }
}

// Python's p.start(); event.wait() (or a barrier): the process's arguments carry a tensor.
TEST_P(ProcessTest, AProcessStartedWithATensorRunsWhileTheParentBlocksOnAnEvent) {
  Event started;
  Queue<float> report;
  Tensor t = filled(5.0f);
  Process p = start_process(options(), announce_with_a_tensor, started, t, report);
  EXPECT_TRUE(started.wait(10s)) << "the process never started";
  EXPECT_EQ(report.get(10s), std::optional<float>(5.0f));
  EXPECT_TRUE(p.join(10s));
}

TEST_P(ProcessTest, ATensorPutByAProducerThatExitsAtOnceArrives) {
  Queue<Tensor> q;
  Process p = start_process(options(), put_then_exit_at_once, q, 42);
  EXPECT_TRUE(p.join(10s));  // gone before anyone took its tensor
  std::optional<Tensor> t = q.get(5s);
  ASSERT_TRUE(t.has_value());
  EXPECT_TRUE(is_tensor_number(*t, 42));
}

TEST_P(ProcessTest, AProducerKilledInALoopOfPutsLeavesOnlyWholeItems) {
  Queue<std::vector<int>> q;
  Process p = start_process(options(), put_for_ever, q, 0);
  ASSERT_TRUE(q.get(10s).has_value());
  std::this_thread::sleep_for(20ms);
  p.kill();
  ASSERT_TRUE(p.join(10s));
  int items = 0;
  while (std::optional<std::vector<int>> item = q.get(200ms)) {
    ASSERT_EQ(item->size(), 30000u);
    EXPECT_TRUE(std::all_of(item->begin(), item->end(), [&](int v) { return v == item->front(); }));
    ++items;
  }
  EXPECT_FALSE(q.get_nowait().has_value());  // and nothing hangs
}

TEST_P(ProcessTest, ALockWhoseHolderIsKilledPassesToTheNextWhoSeesThePreviousOwnerDied) {
  Lock lock;
  Event held;
  Process p = start_process(options(), hold_the_lock, lock, held);
  ASSERT_TRUE(held.wait(10s));
  EXPECT_FALSE(lock.try_lock());
  p.kill();
  ASSERT_TRUE(p.join(10s));
  lock.lock();  // returns: the holder is dead
  EXPECT_TRUE(lock.previous_owner_died());
  lock.unlock();
  lock.lock();
  EXPECT_FALSE(lock.previous_owner_died());
  lock.unlock();
}

TEST_P(ProcessTest, TryLockForGivesUpAfterItsTimeoutAndTakesALockWhoseHolderDied) {
  Lock lock;
  Event held;
  Process p = start_process(options(), hold_the_lock, lock, held);
  ASSERT_TRUE(held.wait(10s));
  auto started = std::chrono::steady_clock::now();
  EXPECT_FALSE(lock.try_lock_for(50ms));
  EXPECT_GE(std::chrono::steady_clock::now() - started, 50ms);
  p.kill();
  ASSERT_TRUE(p.join(10s));
  ASSERT_TRUE(lock.try_lock_for(10s));
  EXPECT_TRUE(lock.previous_owner_died());
  lock.unlock();
}

TEST_P(ProcessTest, ABarrierOfThreeProcessesLetsNoneThroughBeforeAllArrived) {
  Barrier barrier(3);
  Queue<std::string> log;
  std::vector<Process> processes;
  for (int i = 0; i < 3; ++i) processes.push_back(start_process(options(), arrive_and_pass, barrier, log));
  std::vector<std::string> order;
  for (int i = 0; i < 6; ++i) order.push_back(log.get());
  EXPECT_EQ(order, (std::vector<std::string>{"arrived", "arrived", "arrived", "passed", "passed", "passed"}));
  for (Process& p : processes) EXPECT_TRUE(p.join(10s));
}

TEST_P(ProcessTest, AnEventSetHereWakesAProcessWaitingForIt) {
  Event go;
  Queue<int> report;
  Process p = start_process(options(), wait_then_report, go, report);
  EXPECT_FALSE(report.get(50ms).has_value());  // it waits
  go.set();
  EXPECT_EQ(report.get(10s), std::optional<int>(1));
  EXPECT_TRUE(p.join(10s));
}

INSTANTIATE_TEST_SUITE_P(StartMethods, ProcessTest, test_support::all_start_methods(), test_support::start_method_name);

void set_event(Event e, int) { e.set(); }

TEST(EventTest, AnEventIsAwaitedOnTheLoopWhileAnotherProcessSetsIt) {
  Event e;
  EXPECT_FALSE(e.is_set());
  Process p = start_process(set_event, e, 0);
  run(e.async_wait());
  EXPECT_TRUE(e.is_set());
  e.clear();
  EXPECT_FALSE(e.is_set());
  EXPECT_FALSE(e.wait(10ms));
  p.join();
}

TEST(QueueTest, AQueuePassedToAPoolTaskIsUsedThere) {
  Queue<int> q;
  Pool pool({.processes = 2});
  pool.apply_async(put_square, q, 5).get();
  EXPECT_EQ(test_support::get_within(q), 25);
}

// The routes a tensor can take between processes, each a task or process of the walk below.
Tensor take_from_queue(Queue<Tensor> q) { return test_support::get_within(q); }
int put_argument(Queue<Tensor> q, Tensor t) {
  q.put(t);
  return 0;
}
Tensor take_from_pipe(Connection<Tensor> end) { return end.recv(); }
Tensor return_argument(Tensor t) { return t; }
void put_from_process(Queue<Tensor> q, Tensor t) { q.put(t); }
int make_and_put(Queue<Tensor> q, int id) {
  q.put(tensor_number(id));
  return 0;
}

// Issue 58.1: a tensor that reached a worker by a queue and came back as its result broke the
// lending books (the next tensor argument was refused: "not one lent to it"). Every route, in
// both directions, many times over: the values stay, the pool serves on, and once everything is
// dropped no block is held anywhere.
TEST(QueueTest, ATensorWalkingEveryRouteManyTimesKeepsItsValuesAndTheBooksRight) {
  std::size_t in_use_before = shared_memory_stats().in_use_bytes;
  {
    Queue<Tensor> to_worker, to_parent;
    auto [here, there] = Pipe<Tensor>();
    Pool pool({.processes = 1});
    Tensor t = tensor_number(7);
    for (int round = 0; round < 20; ++round) {
      to_worker.put(t);  // parent -> queue -> worker -> result
      t = pool.apply_async(take_from_queue, to_worker).get(20s);
      ASSERT_TRUE(is_tensor_number(t, 7)) << "round " << round;
      ASSERT_EQ(pool.apply_async(put_argument, to_parent, t).get(20s), 0);  // argument -> queue -> parent
      t = test_support::get_within(to_parent);
      ASSERT_TRUE(is_tensor_number(t, 7)) << "round " << round;
      here.send(t);  // parent -> pipe -> worker -> result
      t = pool.apply_async(take_from_pipe, there).get(20s);
      t = pool.apply_async(return_argument, t).get(20s);          // argument -> result
      Process p = start_process(put_from_process, to_parent, t);  // process argument -> queue -> parent
      t = test_support::get_within(to_parent);
      p.join();
      ASSERT_EQ(p.exitcode(), 0);
      ASSERT_TRUE(is_tensor_number(t, 7)) << "round " << round;
      // A worker's own tensor: worker -> queue -> parent -> argument -> queue -> worker -> result.
      ASSERT_EQ(pool.apply_async(make_and_put, to_parent, round).get(20s), 0);
      Tensor made = test_support::get_within(to_parent);
      to_worker.put(pool.apply_async(return_argument, made).get(20s));
      made = pool.apply_async(take_from_queue, to_worker).get(20s);
      ASSERT_TRUE(is_tensor_number(made, round)) << "round " << round;
    }
    EXPECT_EQ(pool.apply_async(put_argument, to_parent, tensor_number(9)).get(20s), 0) << "the pool serves on";
    EXPECT_TRUE(is_tensor_number(test_support::get_within(to_parent), 9));
  }
  EXPECT_TRUE(test_support::eventually([&] { return shared_memory_stats().in_use_bytes <= in_use_before; }))
      << "blocks still held: " << shared_memory_stats().in_use_bytes - in_use_before << " bytes";
}

TEST(QueueTest, AFullQueueMakesPutWaitAndPutWithATimeoutTimesOut) {
  Queue<int> q(2);
  q.put(1);
  q.put(2);
  auto started = std::chrono::steady_clock::now();
  EXPECT_FALSE(q.put(3, 50ms));
  EXPECT_GE(std::chrono::steady_clock::now() - started, 50ms);
  EXPECT_EQ(test_support::get_within(q), 1);
  EXPECT_TRUE(q.put(3, 50ms));
  EXPECT_EQ(test_support::get_within(q), 2);
  EXPECT_EQ(test_support::get_within(q), 3);
}

TEST(QueueTest, GetWithATimeoutTimesOutAndGetNowaitOfAnEmptyQueueIsEmpty) {
  Queue<int> q;
  auto started = std::chrono::steady_clock::now();
  EXPECT_FALSE(q.get(50ms).has_value());
  EXPECT_GE(std::chrono::steady_clock::now() - started, 50ms);
  EXPECT_FALSE(q.get_nowait().has_value());
}

TEST(QueueTest, PutAndGetOnTheLoop) {
  Queue<std::string> q(1);
  auto body = [&]() -> Task<std::string> {
    co_await q.async_put("one");
    std::string first = co_await q.async_get();
    co_await q.async_put("two");
    co_return first + (co_await q.async_get());
  };
  EXPECT_EQ(run(body()), "onetwo");
}

TEST(QueueTest, PutAfterCloseIsALogicError) {
  Queue<int> q;
  q.put(1);
  q.close();
  EXPECT_THROW(q.put(2), std::logic_error);
  EXPECT_EQ(test_support::get_within(q), 1);
}

}  // namespace
}  // namespace forkpool

// A consumer that dies in the middle of a take, stopped between its real steps.
struct forkpool::detail::QueueInternals {
  enum class DieAfter { finding_the_item, receiving_it };
  [[noreturn]] static void die_in_take(QueueCore& queue, DieAfter where) {
    queue.enter_turn(/*wait=*/true);
    if (!queue.begin_take()) _exit(2);
    if (where == DieAfter::receiving_it && !queue.receive_taken()) _exit(3);
    _exit(0);  // with the turn held, as SIGKILL would leave it
  }
};

namespace forkpool {
namespace {

using detail::QueueInternals;

// The same queue as `q`, as another process receives it.
std::shared_ptr<detail::QueueCore> core_of(const Queue<int>& q) {
  Writer w;
  w.write(q);
  std::vector<UniqueFd> fds;
  for (int attached : w.fds()) fds.emplace_back(dup(attached));
  Reader r(w.bytes(), fds);
  return detail::decode_queue(r);
}

TEST(QueueTest, AConsumerThatDiesAfterReceivingAnItemGivesItsPlaceBack) {
  Queue<int> q(1);
  q.put(7);
  int status = test_support::run_in_child(
      [&] { QueueInternals::die_in_take(*core_of(q), QueueInternals::DieAfter::receiving_it); });
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  // Item 7 died with its consumer; its place comes back to the waiting producer.
  ASSERT_TRUE(q.put(8, 5s));
  EXPECT_EQ(test_support::get_within(q), 8);
  // One place, not two.
  ASSERT_TRUE(q.put(9, 1s));
  EXPECT_FALSE(q.put(10, 150ms));
  EXPECT_EQ(test_support::get_within(q), 9);
}

TEST(QueueTest, AConsumerThatDiesBeforeReceivingLeavesItsItemAndNoExtraPlace) {
  Queue<int> q(1);
  q.put(7);
  int status = test_support::run_in_child(
      [&] { QueueInternals::die_in_take(*core_of(q), QueueInternals::DieAfter::finding_the_item); });
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  EXPECT_FALSE(q.put(8, 250ms));  // still full: the item stayed
  EXPECT_EQ(test_support::get_within(q), 7);
  EXPECT_TRUE(q.put(8, 1s));
  EXPECT_EQ(test_support::get_within(q), 8);
}

TEST(QueueTest, AProducerOnTheLoopGetsThePlaceOfAConsumerThatDied) {
  Queue<int> q(1);
  q.put(7);
  int status = test_support::run_in_child(
      [&] { QueueInternals::die_in_take(*core_of(q), QueueInternals::DieAfter::receiving_it); });
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  status = test_support::run_in_child_within(10s, [&] {
    auto body = [&]() -> Task<int> {
      co_await q.async_put(8);
      co_return co_await q.async_get();
    };
    _exit(run(body()) == 8 ? 0 : 1);
  });
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
}

// Where threads meet: a Lock between the threads of one process, and tensors got from a queue
// dropped on other threads (their releases go home from there). Also run under TSan.
TEST(ThreadsTest, ALockSerializesThreadsAndQueueTensorsMayBeDroppedOnAnyThread) {
  Lock lock;
  long counter = 0;
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&] {
      for (int i = 0; i < 2000; ++i) {
        std::lock_guard guard(lock);
        ++counter;
      }
    });
  for (auto& t : threads) t.join();
  EXPECT_EQ(counter, 8000);

  Queue<Tensor> q(8);
  Process p = start_process(produce_large_tensors, q, 200);
  threads.clear();
  for (int t = 0; t < 2; ++t)
    threads.emplace_back([&] {
      for (int i = 0; i < 100; ++i) {
        Tensor got = test_support::get_within(q);  // dropped here, on this thread
        EXPECT_EQ(got.numel(), 16384);
      }
    });
  for (auto& t : threads) t.join();
  EXPECT_TRUE(p.join(10s));
}

// What another process sends in place of a queue or a lock: a descriptor of the wrong kind.
template <class T>
void expect_refused_with(int fd) {
  Writer w;
  if constexpr (std::is_same_v<T, Queue<int>>) {
    w.write(std::uint64_t{0});
    w.write_fd(fd);
    w.write_fd(fd);
  }
  w.write_fd(fd);
  std::vector<UniqueFd> fds;
  for (int attached : w.fds()) fds.emplace_back(dup(attached));
  Reader r(w.bytes(), fds);
  EXPECT_THROW(r.read<T>(), ProtocolError);
}

TEST(HostileInputTest, AQueueEventLockOrBarrierOfTheWrongDescriptorIsAProtocolError) {
  int ends[2];
  ASSERT_EQ(pipe(ends), 0);
  expect_refused_with<Queue<int>>(ends[0]);  // a pipe, not a socket
  expect_refused_with<Event>(ends[0]);       // not an eventfd
  expect_refused_with<Lock>(ends[0]);        // not a sealed page
  expect_refused_with<Barrier>(ends[0]);
  close(ends[0]);
  close(ends[1]);
}

}  // namespace
}  // namespace forkpool
