#pragma once
// The physical limit for a small round trip: a parent and a forked child over a blocking
// SOCK_SEQPACKET socketpair (as ../shared/anchors/pingpong.c), measured in the same binary.

#include <benchmark/benchmark.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>

// The machine's limit for a round trip that may sleep: a forked child and the parent over one
// shared page, each side polling up to 2 µs for its turn and then sleeping on a futex, and the
// other side waking it only when it announced sleep (../shared/anchors/latency/futex_pingpong.c
// with a spin of 2000 ns). forkpool's rings do the same, plus validation and the event loop.
#include <linux/futex.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/syscall.h>

#include <atomic>
#include <chrono>
#include <cstdint>

namespace raw_pingpong {

struct Turn {
  alignas(64) std::atomic<std::uint32_t> value{0};
  std::atomic<std::uint32_t> sleeping{0};
};

inline void wait_for(Turn& turn, std::uint32_t want) {
  auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(2);
  while (turn.value.load(std::memory_order_acquire) != want)
    if (std::chrono::steady_clock::now() > until) {
      turn.sleeping.store(1, std::memory_order_seq_cst);
      std::uint32_t seen;
      while ((seen = turn.value.load(std::memory_order_seq_cst)) != want)
        syscall(SYS_futex, &turn.value, FUTEX_WAIT, seen, nullptr, nullptr, 0);
      turn.sleeping.store(0, std::memory_order_relaxed);
      return;
    }
}

inline void give(Turn& turn, std::uint32_t value) {
  turn.value.store(value, std::memory_order_seq_cst);
  if (turn.sleeping.load(std::memory_order_seq_cst))
    syscall(SYS_futex, &turn.value, FUTEX_WAKE, 1, nullptr, nullptr, 0);
}

}  // namespace raw_pingpong

// Pins the calling process (and what it forks later) to `cpu`; returns the mask it had.
inline cpu_set_t pin_to_cpu(int cpu) {
  cpu_set_t before, only;
  sched_getaffinity(0, sizeof before, &before);
  CPU_ZERO(&only);
  CPU_SET(cpu, &only);
  sched_setaffinity(0, sizeof only, &only);
  return before;
}

// A pool's initializer: its workers on CPU 1 (with the parent pinned to CPU 0: apart).
inline void pin_worker_to_cpu_1() { pin_to_cpu(1); }

// While it lives, when `wanted` and the machine has a second CPU: the calling process on CPU 0
// (the other side pins itself to CPU 1), so every message crosses CPUs. Otherwise nothing: both
// where the scheduler puts them.
class PinnedApart {
 public:
  explicit PinnedApart(bool wanted) : apart_(wanted && sysconf(_SC_NPROCESSORS_ONLN) >= 2) {
    if (apart_) before_ = pin_to_cpu(0);
  }
  ~PinnedApart() {
    if (apart_) sched_setaffinity(0, sizeof before_, &before_);
  }
  PinnedApart(const PinnedApart&) = delete;
  PinnedApart& operator=(const PinnedApart&) = delete;
  explicit operator bool() const { return apart_; }

 private:
  bool apart_;
  cpu_set_t before_{};
};

// The parent and a forked child over a blocking SOCK_SEQPACKET socketpair. `wanted_apart`: the parent on
// CPU 0 and the child on CPU 1, so every wake-up crosses CPUs (../shared/anchors/latency's
// socket_seqpacket_cross); otherwise where the scheduler puts them, which flips between the two.
inline void socketpair_pingpong(benchmark::State& state, bool wanted_apart) {
  PinnedApart apart(wanted_apart);
  int sv[2];
  socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv);
  pid_t pid = fork();
  char buf[64] = {};
  if (pid == 0) {
    if (apart) pin_to_cpu(1);
    close(sv[0]);
    while (read(sv[1], buf, sizeof buf) > 0)
      if (write(sv[1], buf, sizeof buf) != sizeof buf) break;
    _exit(0);
  }
  close(sv[1]);
  for (auto _ : state) {
    if (write(sv[0], buf, sizeof buf) != sizeof buf || read(sv[0], buf, sizeof buf) != sizeof buf) std::abort();
  }
  close(sv[0]);
  waitpid(pid, nullptr, 0);
  state.SetItemsProcessed(state.iterations());
}
inline void BM_RawSocketpairPingPong64B(benchmark::State& state) { socketpair_pingpong(state, false); }
inline void BM_RawSocketpairPingPong64BApart(benchmark::State& state) { socketpair_pingpong(state, true); }

// Arg 1: the parent on CPU 0, the child on CPU 1 (a wake-up crosses CPUs); 0: where the
// scheduler puts them.
inline void BM_RawSpinThenFutexPingPong(benchmark::State& state) {
  using raw_pingpong::Turn;
  void* page = mmap(nullptr, 2 * sizeof(Turn), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (page == MAP_FAILED) std::abort();
  Turn* ping = new (page) Turn;
  Turn* pong = new (static_cast<char*>(page) + sizeof(Turn)) Turn;
  constexpr std::uint32_t kStop = ~std::uint32_t{0};
  PinnedApart apart(state.range(0) == 1);
  pid_t pid = fork();
  if (pid == 0) {
    if (apart) pin_to_cpu(1);
    for (std::uint32_t n = 1;; ++n) {
      raw_pingpong::wait_for(*ping, n);
      if (ping->value.load() == kStop) _exit(0);
      raw_pingpong::give(*pong, n);
    }
  }
  std::uint32_t n = 0;
  for (auto _ : state) {
    ++n;
    raw_pingpong::give(*ping, n);
    raw_pingpong::wait_for(*pong, n);
  }
  raw_pingpong::give(*ping, kStop);
  kill(pid, SIGKILL);
  waitpid(pid, nullptr, 0);
  munmap(page, 2 * sizeof(Turn));
  state.SetItemsProcessed(state.iterations());
}
