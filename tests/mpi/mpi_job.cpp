// The program the MPI tests start with mpirun: one scenario per run (argv[1]). Rank 0 prints
// what it checked, one "ok <what>" line each, and exits 0 when every check held; any failure
// prints "FAIL <what>" and exits 1. Built twice (mpi_job, mpi_job_other): FORKPOOL_OTHER_BUILD
// changes the code, so the two builds have different build ids.

#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <numeric>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <forkpool/mpi.hpp>

namespace fp = forkpool;

namespace {

int failures = 0;

void check(bool ok, const std::string& what) {
  std::printf("%s %s\n", ok ? "ok" : "FAIL", what.c_str());
  std::fflush(stdout);
  if (!ok) ++failures;
}

// The MPI rank whose node's worker runs the call (mpirun puts it in every rank's environment,
// and the workers inherit it).
int my_rank() {
  for (const char* name : {"OMPI_COMM_WORLD_RANK", "PMI_RANK"})
    if (const char* value = std::getenv(name)) return std::atoi(value);
  return 0;
}

int rank_of(int) { return my_rank(); }
long square(long x) { return x * x; }
long add(long a, long b) {
#ifdef FORKPOOL_OTHER_BUILD
  return a + b + 0;  // another build: other code, another build id
#else
  return a + b;
#endif
}

// A copy of the tensor's bytes, made on whichever node runs it, and that node's rank.
std::pair<int, fp::Tensor> copy_on_node(fp::Tensor t) {
  fp::Tensor copy = fp::Tensor::empty(std::vector<std::int64_t>(t.shape().begin(), t.shape().end()), t.dtype());
  std::memcpy(copy.raw_data(), t.raw_data(), t.nbytes());
  return {my_rank(), copy};
}

long inode_of(fp::Tensor t) {
  struct stat st;
  if (fstat(t.storage()->fd(), &st) != 0) return -1;
  return static_cast<long>(st.st_ino);
}

// Dies (SIGKILL) when run by a worker of another node than rank 0's and x is 1.
int die_on_other_node(int x) {
  if (x == 1 && my_rank() != 0) raise(SIGKILL);
  return x;
}

// As die_on_other_node, but only the first time (a marker file remembers).
int die_once_on_other_node(int x) {
  if (x == 1 && my_rank() != 0) {
    std::string marker = std::string(std::getenv("FORKPOOL_TEST_MARKER"));
    if (access(marker.c_str(), F_OK) != 0) {
      std::ofstream(marker) << "died";
      raise(SIGKILL);
    }
  }
  return x;
}

// Kills the rank whose node runs it (its pid was put in the environment before init()).
int kill_my_rank(int x) {
  if (my_rank() != 0) kill(std::atoi(std::getenv("FORKPOOL_TEST_RANK_PID")), SIGKILL);
  return x;
}

// Sleeps, then says which rank's node ran it.
int sleep_ms(int ms) {
  std::this_thread::sleep_for(std::chrono::milliseconds(ms));
  return my_rank();
}

std::vector<int> ints(int n) {
  std::vector<int> v(static_cast<std::size_t>(n));
  std::iota(v.begin(), v.end(), 0);
  return v;
}

fp::Task<void> map_and_apply() {
  fp::mpi::Pool pool({.processes = 2});
  check(pool.processes() == 2 * fp::mpi::node_count(), "processes() counts every node's workers");
  std::vector<long> inputs(5000);
  std::iota(inputs.begin(), inputs.end(), 0L);
  auto squares = co_await pool.map(square, inputs, 50);
  bool in_order = squares.size() == inputs.size();
  for (std::size_t i = 0; in_order && i < inputs.size(); ++i) in_order = squares[i] == inputs[i] * inputs[i];
  check(in_order, "map gives the local results in input order");

  std::vector<std::pair<long, long>> pairs;
  for (long i = 0; i < 300; ++i) pairs.emplace_back(i, 2 * i);
  auto sums = co_await pool.starmap(add, pairs, 7);
  bool sums_ok = sums.size() == pairs.size();
  for (std::size_t i = 0; sums_ok && i < pairs.size(); ++i) sums_ok = sums[i] == 3 * static_cast<long>(i);
  check(sums_ok, "starmap gives the local results in input order");

  bool applied = true;
  for (long i = 0; i < 50; ++i) applied = applied && co_await pool.apply_async(add, i, 1L) == i + 1;
  check(applied, "apply_async gives the local results");

  std::vector<long> streamed;
  auto stream = pool.imap(square, inputs, 25);
  while (auto value = co_await stream.next()) streamed.push_back(*value);
  check(streamed == squares, "imap gives the results in input order");
  long unordered_sum = 0;
  auto unordered = pool.imap_unordered(square, inputs, 25);
  while (auto value = co_await unordered.next()) unordered_sum += *value;
  check(unordered_sum == std::accumulate(squares.begin(), squares.end(), 0L), "imap_unordered gives every result");

  auto ranks = co_await pool.map(rank_of, ints(600), 1);
  std::set<int> ran(ranks.begin(), ranks.end());
  check(static_cast<int>(ran.size()) == fp::mpi::node_count(),
        "every node ran calls (" + std::to_string(ran.size()) + " of " + std::to_string(fp::mpi::node_count()) + ")");
  // close() while an imap still feeds its input, as Python allows: the stream finishes, then join.
  auto late = pool.imap(square, inputs, 25);
  pool.close();
  long late_sum = 0;
  while (auto value = co_await late.next()) late_sum += *value;
  check(late_sum == std::accumulate(squares.begin(), squares.end(), 0L),
        "an imap opened before close() completes after it");
  bool refused = false;
  try {
    (void)pool.apply_async(square, 1L);
  } catch (const fp::PoolClosed&) {
    refused = true;
  }
  check(refused, "after close(), new work is PoolClosed");
  co_await pool.join();
  check(true, "close and join return");
}

fp::Task<void> tensors() {
  fp::mpi::Pool pool({.processes = 1});
  std::vector<std::uint8_t> bytes(300000);
  for (std::size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<std::uint8_t>((i * 2654435761u) >> 13);
  auto tensor = fp::Tensor::from<std::uint8_t>(bytes, {300, 1000});
  auto copies = co_await pool.map(copy_on_node, std::vector<fp::Tensor>(24, tensor), 1);
  int remote = 0;
  bool identical = true;
  for (auto& [rank, copy] : copies) {
    remote += rank != 0;
    identical = identical && copy.numel() == tensor.numel() && copy.shape()[0] == 300 &&
                std::memcmp(copy.raw_data(), bytes.data(), bytes.size()) == 0;
  }
  check(identical,
        "a tensor crosses and comes back byte-identical (" + std::to_string(remote) + " of 24 on another node)");
  if (fp::mpi::node_count() > 1) check(remote > 0, "some copies were made on another node");

  long inode = co_await pool.apply_async(inode_of, tensor);
  struct stat st;
  fstat(tensor.storage()->fd(), &st);
  check(inode == static_cast<long>(st.st_ino), "on rank 0's node a tensor arrives as the same memory (same inode)");
}

fp::Task<void> worker_killed() {
  {
    fp::mpi::Pool pool({.processes = 1});
    bool lost = false;
    try {
      (void)co_await pool.map(die_on_other_node, ints(40), 1);
    } catch (const fp::WorkerLost& e) {
      lost = e.signal() == SIGKILL;
    }
    check(lost, "a worker killed on another node is WorkerLost (SIGKILL)");
    std::vector<long> inputs(8, 3);  // (a braced list here trips g++ 12's coroutine frames)
    auto after = co_await pool.map(square, inputs, 1);
    check(after == std::vector<long>(8, 9), "the pool goes on after it");
  }
  fp::mpi::Pool retrying({.processes = 1, .max_retries = 1});
  auto values = co_await retrying.map(die_once_on_other_node, ints(40), 1);
  check(values == ints(40), "with max_retries, the killed worker's task is run again and the map succeeds");
}

fp::Task<void> rank_killed() {
  fp::mpi::Pool pool({.processes = 1});
  (void)co_await pool.map(kill_my_rank, ints(40), 1);
  check(false, "a map whose node's rank was killed cannot complete");
}

fp::Task<void> idle() {
  fp::mpi::Pool pool({.processes = 1});
  (void)co_await pool.map(square, std::vector<long>(100, 3), 1);
  std::printf("idle\n");
  std::fflush(stdout);
  std::this_thread::sleep_for(std::chrono::seconds(3));  // the harness measures the ranks' CPU now
  check(true, "idle");
}

// cancel(), timeouts, terminate() and join() on a pool over every node (blocking API).
void control() {
  using Clock = std::chrono::steady_clock;
  fp::mpi::Pool pool({.processes = 1});
  std::vector<fp::AsyncResult<int>> sleepers;
  for (int i = 0; i < fp::mpi::node_count(); ++i) sleepers.push_back(pool.apply_async(sleep_ms, 20000));
  (void)sleepers[0].wait(std::chrono::milliseconds(300));  // they reach their nodes' workers
  auto start = Clock::now();
  for (auto& sleeper : sleepers) sleeper.cancel();
  int cancelled = 0;
  for (auto& sleeper : sleepers) {
    try {
      sleeper.get();
    } catch (const fp::Cancelled&) {
      ++cancelled;
    }
  }
  check(cancelled == fp::mpi::node_count(), "cancel() stops a task on every node (" + std::to_string(cancelled) + ")");
  auto ranks = pool.map_async(rank_of, ints(60), 1).get();
  check(std::set<int>(ranks.begin(), ranks.end()).size() == static_cast<std::size_t>(fp::mpi::node_count()) &&
            Clock::now() - start < std::chrono::seconds(10),
        "the cancelled tasks' workers were stopped: every node serves again at once");

  auto slow = pool.apply_async(sleep_ms, 400);
  bool timed_out = false;
  try {
    slow.get(std::chrono::milliseconds(50));
  } catch (const fp::TimeoutError&) {
    timed_out = true;
  }
  (void)slow.get();
  check(timed_out, "get(timeout) throws TimeoutError, and the result still comes");

  auto pending = pool.map_async(sleep_ms, std::vector<int>(20, 1000), 1);
  (void)pending.wait(std::chrono::milliseconds(200));
  pool.terminate();
  bool terminated = false;
  try {
    (void)pending.get();
  } catch (const fp::PoolTerminated&) {
    terminated = true;
  }
  check(terminated, "terminate() fails the pending work with PoolTerminated");
  fp::run(pool.join());
  check(Clock::now() - start < std::chrono::seconds(20),
        "join() after terminate() returns once every node has stopped");

  // ~Pool on another thread hands the shutdown to the pool's thread (the nodes are told there:
  // MPI_THREAD_FUNNELED), where it runs at the loop's next turn: the pending work fails there.
  // (It ran on the destroying thread, and the work's done-callback with it.)
  auto doomed = std::make_unique<fp::mpi::Pool>(fp::PoolOptions{.processes = 1});
  auto pending_there = doomed->map_async(sleep_ms, std::vector<int>(2 * fp::mpi::node_count(), 20000), 1);
  (void)pending_there.wait(std::chrono::milliseconds(300));  // they reach their nodes' workers
  std::thread::id failed_on;
  pending_there.add_done_callback([&](auto&) { failed_on = std::this_thread::get_id(); });
  std::thread([&] { doomed.reset(); }).join();
  bool terminated_here = false;
  try {
    (void)pending_there.get(std::chrono::seconds(10));
  } catch (const fp::PoolTerminated&) {
    terminated_here = true;
  }
  check(terminated_here && failed_on == std::this_thread::get_id(),
        "a Pool destroyed on another thread is shut down on its own: its work fails there");
  fp::mpi::Pool next({.processes = 1});
  auto next_ranks = next.map_async(rank_of, ints(60), 1).get(std::chrono::seconds(20));
  check(std::set<int>(next_ranks.begin(), next_ranks.end()).size() == static_cast<std::size_t>(fp::mpi::node_count()),
        "every node serves the next pool");
}

}  // namespace

int main(int argc, char** argv) {
  setenv("FORKPOOL_TEST_RANK_PID", std::to_string(getpid()).c_str(), 1);
  try {
    fp::mpi::init(argc, argv);
  } catch (const fp::mpi::BuildMismatch& e) {
    // Handled: exits 0, since mpirun would kill the other ranks before they report at the first
    // rank that exits non-zero.
    std::printf("BuildMismatch: %s\n", e.what());
    return 0;
  }
  std::string scenario = argc > 1 ? argv[1] : "";
  if (scenario == "control") {
    try {
      control();
    } catch (const std::exception& e) {
      check(false, std::string("unexpected exception: ") + e.what());
    }
    return failures == 0 ? 0 : 1;
  }
  fp::Task<void> (*run)() = scenario == "map"             ? map_and_apply
                            : scenario == "tensors"       ? tensors
                            : scenario == "worker_killed" ? worker_killed
                            : scenario == "rank_killed"   ? rank_killed
                            : scenario == "idle"          ? idle
                                                          : nullptr;
  if (!run) {
    std::fprintf(stderr, "usage: mpi_job map|tensors|worker_killed|rank_killed|idle|control\n");
    return 2;
  }
  try {
    fp::run(run());
  } catch (const std::exception& e) {
    check(false, std::string("unexpected exception: ") + e.what());
  }
  return failures == 0 ? 0 : 1;
}
