// Channels between the parent (on the event loop) and forked children, against a raw blocking
// socketpair ping-pong in the same binary; payloads inline against through a sealed memfd.

#include <benchmark/benchmark.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "raw_pingpong.hpp"
#include <forkpool/ipc/internal/channel.hpp>
#include <forkpool/runtime/loop.hpp>
#include <forkpool/runtime/when_all.hpp>

namespace fp = forkpool;

namespace {

// A forked child that answers every frame with an empty frame of the same id (after touching
// the payload's first and last byte, so a memfd payload is really mapped).
struct EchoChild {
  fp::detail::Channel parent_end;
  pid_t pid;

  static EchoChild start() {
    auto [ours, theirs] = fp::detail::Channel::make_pair();
    pid_t pid = fork();
    if (pid == 0) {
      ours.release().reset();
      try {
        for (;;) {
          fp::detail::Message m = theirs.receive();
          auto bytes = m.payload.bytes();
          if (!bytes.empty())
            benchmark::DoNotOptimize(static_cast<int>(bytes.front()) + static_cast<int>(bytes.back()));
          theirs.send(m.kind, m.request_id, {});
        }
      } catch (...) {}
      _exit(0);
    }
    return {std::move(ours), pid};
  }
  ~EchoChild() {
    if (parent_end.fd() >= 0) {
      parent_end.shutdown_write();
      waitpid(pid, nullptr, 0);
    }
  }
};

BENCHMARK(BM_RawSocketpairPingPong64B)->UseRealTime();

void BM_ChannelRoundTrip64B(benchmark::State& state) {
  EchoChild child = EchoChild::start();
  std::array<std::byte, 64 - sizeof(fp::detail::FrameHeader)> payload{};  // 64 bytes on the wire
  auto body = [&]() -> fp::Task<void> {
    std::uint64_t id = 0;
    for (auto _ : state) {
      co_await child.parent_end.async_send(1, ++id, payload);
      fp::detail::Message reply = co_await child.parent_end.async_receive();
      benchmark::DoNotOptimize(reply.request_id);
    }
  };
  fp::run(body());
  state.SetItemsProcessed(state.iterations());
  state.SetLabel(fp::Loop::current().backend_name());
}
BENCHMARK(BM_ChannelRoundTrip64B)->UseRealTime();

// 64 requests in flight, 32 to each of two children: messages per second.
void BM_ChannelPipelined64InFlight(benchmark::State& state) {
  std::array<EchoChild, 2> children{EchoChild::start(), EchoChild::start()};
  std::array<std::byte, 32> payload{};
  constexpr int kPerChild = 32;
  auto lane = [&](EchoChild& child, int messages) -> fp::Task<void> {
    // Keep kPerChild requests outstanding: send them all, then one more per reply.
    int sent = 0, received = 0;
    for (; sent < std::min(kPerChild, messages); ++sent) co_await child.parent_end.async_send(1, sent, payload);
    while (received < messages) {
      co_await child.parent_end.async_receive();
      ++received;
      if (sent < messages) co_await child.parent_end.async_send(1, sent++, payload);
    }
  };
  const int batch = 4096;
  for (auto _ : state) fp::run(fp::when_all(lane(children[0], batch), lane(children[1], batch)));
  state.SetItemsProcessed(state.iterations() * 2 * batch);
}
BENCHMARK(BM_ChannelPipelined64InFlight)->UseRealTime();

// Round trip of a payload of N bytes; Arg 1 = 1 through a sealed memfd, 0 inline in the datagram.
void BM_PayloadRoundTrip(benchmark::State& state) {
  EchoChild child = EchoChild::start();
  std::vector<std::byte> payload(state.range(0), std::byte{1});
  bool via_memfd = state.range(1) == 1;
  fp::detail::FrameReceiver receiver;
  for (auto _ : state) {
    fp::detail::OutgoingFrame frame(1, 1, payload, {}, via_memfd ? 0 : fp::detail::kInlinePayloadMax);
    if (sendmsg(child.parent_end.fd(), frame.message(), MSG_NOSIGNAL) < 0) std::abort();
    long rc = recvmsg(child.parent_end.fd(), receiver.prepare(), MSG_CMSG_CLOEXEC);
    benchmark::DoNotOptimize(receiver.finish(rc < 0 ? -errno : rc).request_id);
  }
  state.SetBytesProcessed(state.iterations() * state.range(0));
  state.SetLabel(via_memfd ? "memfd" : "inline");
}
BENCHMARK(BM_PayloadRoundTrip)->ArgsProduct({{4 << 10, 16 << 10, 32 << 10, 60 << 10}, {0, 1}})->UseRealTime();

// 64 MiB: through a sealed memfd (one copy in, none across) against a stream socket (copied
// through the kernel and read into the child's memory).
void BM_Payload64MiBViaMemfd(benchmark::State& state) {
  EchoChild child = EchoChild::start();
  std::vector<std::byte> payload(64 << 20, std::byte{1});
  auto body = [&]() -> fp::Task<void> {
    for (auto _ : state) {
      co_await child.parent_end.async_send(1, 1, payload);
      co_await child.parent_end.async_receive();
    }
  };
  fp::run(body());
  state.SetBytesProcessed(state.iterations() * payload.size());
}
BENCHMARK(BM_Payload64MiBViaMemfd)->UseRealTime()->Unit(benchmark::kMillisecond);

void BM_Payload64MiBViaStreamSocket(benchmark::State& state) {
  const std::size_t size = 64 << 20;
  int sv[2];
  socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv);
  pid_t pid = fork();
  if (pid == 0) {
    close(sv[0]);
    std::vector<char> into(size);
    for (;;) {
      std::size_t got = 0;
      while (got < size) {
        ssize_t n = read(sv[1], into.data() + got, size - got);
        if (n <= 0) _exit(0);
        got += n;
      }
      char ack = 1;
      if (write(sv[1], &ack, 1) != 1) _exit(0);
    }
  }
  close(sv[1]);
  std::vector<char> payload(size, 1);
  for (auto _ : state) {
    std::size_t sent = 0;
    while (sent < size) {
      ssize_t n = write(sv[0], payload.data() + sent, size - sent);
      if (n <= 0) std::abort();
      sent += n;
    }
    char ack;
    if (read(sv[0], &ack, 1) != 1) std::abort();
  }
  close(sv[0]);
  waitpid(pid, nullptr, 0);
  state.SetBytesProcessed(state.iterations() * size);
}
BENCHMARK(BM_Payload64MiBViaStreamSocket)->UseRealTime()->Unit(benchmark::kMillisecond);

}  // namespace

BENCHMARK_MAIN();
