#pragma once
// The physical limit for a small round trip: a parent and a forked child over a blocking
// SOCK_SEQPACKET socketpair (as ../shared/anchors/pingpong.c), measured in the same binary.

#include <benchmark/benchmark.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>

inline void BM_RawSocketpairPingPong64B(benchmark::State& state) {
  int sv[2];
  socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv);
  pid_t pid = fork();
  char buf[64] = {};
  if (pid == 0) {
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
