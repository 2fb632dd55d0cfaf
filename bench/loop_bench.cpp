// The event loop against a raw liburing loop doing the same work in the same binary.
// Run with FORKPOOL_BACKEND=io_uring and =epoll to compare the backends.

#include <benchmark/benchmark.h>
#include <fcntl.h>
#include <liburing.h>
#include <unistd.h>

#include <array>
#include <cstdlib>

#include <forkpool/runtime/internal/io.hpp>
#include <forkpool/runtime/loop.hpp>
#include <forkpool/runtime/task.hpp>

namespace fp = forkpool;

namespace {

struct Pipe {
  int read_end, write_end;
  Pipe() {
    int fds[2];
    if (pipe2(fds, O_CLOEXEC) != 0) std::abort();
    read_end = fds[0];
    write_end = fds[1];
  }
  ~Pipe() {
    close(read_end);
    close(write_end);
  }
};

fp::Task<int> ready_value(int x) { co_return x; }

void BM_CoAwaitReadyTask(benchmark::State& state) {
  auto body = [&]() -> fp::Task<void> {
    long sum = 0;
    for (auto _ : state) sum += co_await ready_value(1);
    benchmark::DoNotOptimize(sum);
  };
  fp::run(body());
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_CoAwaitReadyTask);

void BM_SleepForZero(benchmark::State& state) {
  auto body = [&]() -> fp::Task<void> {
    for (auto _ : state) co_await fp::sleep_for(std::chrono::nanoseconds(0));
  };
  fp::run(body());
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_SleepForZero);

// One 64-byte write then one read of it, each awaited: two operations through the loop.
void BM_LoopPipeWriteRead(benchmark::State& state) {
  Pipe p;
  std::array<std::byte, 64> out{}, in{};
  auto body = [&]() -> fp::Task<void> {
    for (auto _ : state) {
      co_await fp::detail::async_write(p.write_end, out);
      co_await fp::detail::async_read(p.read_end, in);
    }
  };
  fp::run(body());
  state.SetItemsProcessed(state.iterations() * 2);
  state.SetLabel(fp::Loop::current().backend_name());
}
BENCHMARK(BM_LoopPipeWriteRead);

// The same two operations on a bare io_uring: the ceiling for the loop.
void BM_RawUringPipeWriteRead(benchmark::State& state) {
  Pipe p;
  io_uring ring;
  if (io_uring_queue_init(256, &ring, 0) < 0) {
    state.SkipWithError("io_uring unavailable");
    return;
  }
  std::array<std::byte, 64> out{}, in{};
  auto one = [&](auto prep) {
    io_uring_sqe* sqe = io_uring_get_sqe(&ring);
    prep(sqe);
    io_uring_submit_and_wait(&ring, 1);
    io_uring_cqe* cqe;
    io_uring_peek_cqe(&ring, &cqe);
    benchmark::DoNotOptimize(cqe->res);
    io_uring_cqe_seen(&ring, cqe);
  };
  for (auto _ : state) {
    one([&](io_uring_sqe* sqe) { io_uring_prep_write(sqe, p.write_end, out.data(), out.size(), -1); });
    one([&](io_uring_sqe* sqe) { io_uring_prep_read(sqe, p.read_end, in.data(), in.size(), -1); });
  }
  io_uring_queue_exit(&ring);
  state.SetItemsProcessed(state.iterations() * 2);
}
BENCHMARK(BM_RawUringPipeWriteRead);

}  // namespace

BENCHMARK_MAIN();
