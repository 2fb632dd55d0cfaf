// The event loop on real kernel objects: pipes, socketpairs, timers, fork, epoll embedding.

#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <linux/futex.h>
#include <sys/epoll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <cstdlib>
#include <stop_token>
#include <string>
#include <thread>
#include <vector>

#include <forkpool/runtime/internal/io.hpp>
#include <forkpool/runtime/private/process.hpp>
#include <forkpool/runtime/loop.hpp>
#include <forkpool/runtime/unique_fd.hpp>
#include <forkpool/runtime/when_all.hpp>
#include "support.hpp"

namespace forkpool {
namespace {

using namespace std::chrono_literals;

struct Pipe {
  UniqueFd read_end, write_end;
  Pipe() {
    int fds[2];
    if (pipe2(fds, O_CLOEXEC) != 0) std::abort();
    read_end.reset(fds[0]);
    write_end.reset(fds[1]);
  }
};

std::span<const std::byte> bytes_of(const std::string& s) { return std::as_bytes(std::span(s.data(), s.size())); }

TEST(Loop, UsesTheBackendTheEnvironmentAsksFor) {
  const char* forced = std::getenv("FORKPOOL_BACKEND");
  if (!forced) GTEST_SKIP() << "no backend forced";
  EXPECT_STREQ(Loop::current().backend_name(), forced);
}

TEST(Loop, ReadsWhatAPipeCarries) {
  Pipe p;
  auto body = [&]() -> Task<std::string> {
    std::string message = "hello";
    int wrote = co_await detail::async_write(p.write_end.get(), bytes_of(message));
    EXPECT_EQ(wrote, 5);
    std::array<std::byte, 16> buffer{};
    int got = co_await detail::async_read(p.read_end.get(), buffer);
    co_return std::string(reinterpret_cast<char*>(buffer.data()), got > 0 ? got : 0);
  };
  EXPECT_EQ(run(body()), "hello");
}

TEST(Loop, ResumesAPendingReadWhenAnotherTaskWrites) {
  Pipe p;
  std::vector<std::string> order;
  auto reader = [&]() -> Task<void> {
    std::array<std::byte, 8> buffer{};
    int got = co_await detail::async_read(p.read_end.get(), buffer);
    EXPECT_EQ(got, 1);
    order.push_back("read");
  };
  auto writer = [&]() -> Task<void> {
    co_await sleep_for(5ms);
    order.push_back("write");
    std::string one = "x";
    co_await detail::async_write(p.write_end.get(), bytes_of(one));
  };
  run(when_all(reader(), writer()));
  EXPECT_EQ(order, (std::vector<std::string>{"write", "read"}));
}

TEST(Loop, StopTokenCancelsAPendingRead) {
  Pipe p;
  std::stop_source source;
  auto reader = [&]() -> Task<int> {
    std::array<std::byte, 8> buffer{};
    co_return co_await detail::async_read(p.read_end.get(), buffer, {.stop = source.get_token()});
  };
  auto stopper = [&]() -> Task<void> {
    co_await sleep_for(5ms);
    source.request_stop();
  };
  auto [result, unused] = run(when_all(reader(), stopper()));
  EXPECT_EQ(result, -ECANCELED);
}

TEST(Loop, AStopRequestedBeforehandCompletesAtOnce) {
  Pipe p;
  std::stop_source source;
  source.request_stop();
  auto reader = [&]() -> Task<int> {
    std::array<std::byte, 8> buffer{};
    co_return co_await detail::async_read(p.read_end.get(), buffer, {.stop = source.get_token()});
  };
  EXPECT_EQ(run(reader()), -ECANCELED);
}

TEST(Loop, ADeadlineThatExpiresGivesETimedOut) {
  Pipe p;
  auto reader = [&]() -> Task<int> {
    std::array<std::byte, 8> buffer{};
    co_return co_await detail::async_read(p.read_end.get(), buffer, {.deadline = detail::Clock::now() + 10ms});
  };
  auto started = detail::Clock::now();
  EXPECT_EQ(run(reader()), -ETIMEDOUT);
  EXPECT_GE(detail::Clock::now() - started, 10ms);
}

TEST(Loop, AnOperationThatBeatsItsDeadlineKeepsItsResult) {
  Pipe p;
  ASSERT_EQ(write(p.write_end.get(), "abc", 3), 3);
  auto reader = [&]() -> Task<int> {
    std::array<std::byte, 8> buffer{};
    co_return co_await detail::async_read(p.read_end.get(), buffer, {.deadline = detail::Clock::now() + 5s});
  };
  auto started = detail::Clock::now();
  EXPECT_EQ(run(reader()), 3);
  EXPECT_LT(detail::Clock::now() - started,
            test_support::scaled(1s));  // the pending timer was cancelled, not waited out
}

TEST(Loop, TenThousandConcurrentOperationsAllComplete) {
  // Far more than the ring holds: the rest wait in the loop's queue and are submitted later.
  constexpr int kCount = 10'000;
  int fds[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0, fds), 0);
  UniqueFd a(fds[0]), b(fds[1]);
  int received = 0;
  auto one = [&](int) -> Task<void> {
    co_await detail::wait_writable(a.get());
    ++received;
  };
  std::vector<Task<void>> tasks;
  for (int i = 0; i < kCount; ++i) tasks.push_back(one(i));
  run(when_all(std::move(tasks)));
  EXPECT_EQ(received, kCount);

  // And the same many timers, resumed in deadline order.
  std::vector<int> fired;
  std::vector<Task<void>> timers;
  auto timer = [&](int i) -> Task<void> {
    co_await sleep_until(detail::Clock::now() + std::chrono::microseconds((kCount - i) * 2));
    fired.push_back(i);
  };
  for (int i = 0; i < kCount; ++i) timers.push_back(timer(i));
  run(when_all(std::move(timers)));
  EXPECT_EQ(fired.size(), static_cast<std::size_t>(kCount));
}

TEST(Loop, ProcessExitIsSeenThroughAPidfd) {
  pid_t pid = fork();
  if (pid == 0) {
    usleep(20'000);
    _exit(7);
  }
  UniqueFd pidfd(static_cast<int>(syscall(SYS_pidfd_open, pid, 0)));
  ASSERT_TRUE(pidfd);
  int events = run([&]() -> Task<int> { co_return co_await detail::wait_process_exit(pidfd.get()); }());
  EXPECT_TRUE(events & POLLIN);
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, WNOHANG), pid);
  EXPECT_EQ(WEXITSTATUS(status), 7);
}

// A futex word in memory another process maps, as the sync primitives keep theirs.
struct SharedWord {
  std::uint32_t* word =
      static_cast<std::uint32_t*>(mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0));
  ~SharedWord() { munmap(word, 4096); }
};

int futex_wait_on_loop(std::uint32_t* word, std::uint32_t expected, detail::IoOptions options = {}) {
  return run([&]() -> Task<int> { co_return co_await detail::wait_futex(word, expected, options); }());
}

TEST(Loop, AFutexWaitEndsWhenAnotherProcessWakesTheWord) {
  if (!detail::loop_waits_on_futexes()) GTEST_SKIP() << "this loop cannot wait on a futex (epoll, or Linux < 6.7)";
  SharedWord shared;
  ASSERT_NE(shared.word, MAP_FAILED);
  pid_t pid = fork();
  if (pid == 0) {
    usleep(50'000);  // the parent is asleep on the word by now
    __atomic_store_n(shared.word, 1, __ATOMIC_RELEASE);
    syscall(SYS_futex, shared.word, FUTEX_WAKE, 1, nullptr, nullptr, 0);
    _exit(0);
  }
  auto started = std::chrono::steady_clock::now();
  int rc = futex_wait_on_loop(shared.word, 0, {.deadline = detail::deadline_after(10s)});
  waitpid(pid, nullptr, 0);
  EXPECT_TRUE(rc == 0 || rc == -EAGAIN) << rc;  // -EAGAIN: the store came before the wait
  EXPECT_EQ(*shared.word, 1u);
  EXPECT_LT(std::chrono::steady_clock::now() - started, test_support::scaled(5s));
}

TEST(Loop, AFutexWaitOnAWordThatChangedEndsAtOnce) {
  if (!detail::loop_waits_on_futexes()) GTEST_SKIP() << "this loop cannot wait on a futex (epoll, or Linux < 6.7)";
  SharedWord shared;
  *shared.word = 3;
  EXPECT_EQ(futex_wait_on_loop(shared.word, 0, {.deadline = detail::deadline_after(10s)}), -EAGAIN);
}

TEST(Loop, AFutexWaitNobodyWakesEndsAtItsDeadlineOrStop) {
  if (!detail::loop_waits_on_futexes()) GTEST_SKIP() << "this loop cannot wait on a futex (epoll, or Linux < 6.7)";
  SharedWord shared;
  EXPECT_EQ(futex_wait_on_loop(shared.word, 0, {.deadline = detail::deadline_after(20ms)}), -ETIMEDOUT);
  std::stop_source source;
  int rc = run([&]() -> Task<int> {
    auto stopper = [&]() -> Task<int> {
      co_await sleep_for(20ms);
      source.request_stop();
      co_return 0;
    };
    auto waiter = [&]() -> Task<int> {
      co_return co_await detail::wait_futex(shared.word, 0, {.stop = source.get_token()});
    };
    auto [waited, stopped] = co_await when_all(waiter(), stopper());
    (void)stopped;
    co_return waited;
  }());
  EXPECT_EQ(rc, -ECANCELED);
}

TEST(Loop, AFutexWaitOnALoopThatCannotSaysSo) {
  if (detail::loop_waits_on_futexes()) GTEST_SKIP() << "this loop waits on futexes";
  SharedWord shared;
  EXPECT_EQ(futex_wait_on_loop(shared.word, 0, {.deadline = detail::deadline_after(10s)}), -EOPNOTSUPP);
}

// A host that ignores SIGCHLD: the kernel reaps a child the moment it exits, before we look.
TEST(Loop, AChildReapedBeforeItIsWatchedIsSeenAsEndedWithAnUnknownStatus) {
  struct sigaction ignore {
  }, old{};
  ignore.sa_handler = SIG_IGN;
  ASSERT_EQ(sigaction(SIGCHLD, &ignore, &old), 0);
  pid_t pid = fork();
  if (pid == 0) _exit(0);
  std::this_thread::sleep_for(50ms);  // gone and reaped
  UniqueFd watched;
  EXPECT_NO_THROW(watched = detail::watch_child(pid));
  sigaction(SIGCHLD, &old, nullptr);
  ASSERT_TRUE(watched);
  EXPECT_EQ(run([&]() -> Task<int> { co_return co_await detail::wait_process_exit(watched.get()); }()) & POLLIN,
            POLLIN);
  detail::ExitStatus status = detail::reap(watched.get());
  EXPECT_EQ(status.exit_code, -1);
  EXPECT_EQ(status.signal, 0);
}

TEST(Loop, AForkedChildRunsItsOwnLoop) {
  // The parent has a loop with a pending operation; the child must not touch it.
  Pipe p;
  run(sleep_for(1ms));
  int status = test_support::run_in_child([] {
    auto body = []() -> Task<int> {
      co_await sleep_for(2ms);
      co_return 5;
    };
    if (run(body()) != 5) throw std::runtime_error("wrong value in child");
  });
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
  EXPECT_EQ(run([]() -> Task<int> {
              co_await sleep_for(1ms);
              co_return 9;
            }()),
            9);
}

TEST(Loop, EmbedsInAHostEpollLoop) {
  // The host owns the waiting: epoll_wait on Loop::fd(), then run_ready().
  Loop& loop = Loop::current();
  UniqueFd host(epoll_create1(EPOLL_CLOEXEC));
  epoll_event ev{};
  ev.events = EPOLLIN;
  ASSERT_EQ(epoll_ctl(host.get(), EPOLL_CTL_ADD, loop.fd(), &ev), 0);

  Pipe p;
  bool done = false;
  std::string got;
  auto body = [&]() -> Task<void> {
    co_await sleep_for(5ms);
    std::array<std::byte, 8> buffer{};
    int n = co_await detail::async_read(p.read_end.get(), buffer);
    got.assign(reinterpret_cast<char*>(buffer.data()), n > 0 ? n : 0);
    done = true;
  };
  Task<void> task = body();
  task.handle().resume();  // the host starts the task itself
  bool wrote = false;
  std::size_t handled = 0;
  for (int rounds = 0; !done && rounds < 1000; ++rounds) {
    epoll_event out;
    int n = epoll_wait(host.get(), &out, 1, 1000);
    if (n < 0 && errno == EINTR) continue;  // io_uring task work interrupts waits, as signals do
    ASSERT_GE(n, 0) << strerror(errno);
    if (n == 1) handled += loop.run_ready();
    if (!wrote) {
      ASSERT_EQ(write(p.write_end.get(), "hi", 2), 2);
      wrote = true;
    }
  }
  EXPECT_TRUE(done);
  EXPECT_EQ(got, "hi");
  EXPECT_GE(handled, 2u);
}

TEST(Loop, RunReadyHandlesNothingWhenIdle) { EXPECT_EQ(Loop::current().run_ready(), 0u); }

TEST(Loop, RunReadyFromAThreadThatDoesNotOwnTheLoopIsALogicErrorNamingPost) {
  Loop& loop = Loop::current();
  // run_ready there would drive this thread's ring beside its owner.
  std::string error = test_support::logic_error_on_another_thread([&] { loop.run_ready(); });
  EXPECT_NE(error.find("does not own it"), std::string::npos) << error;
  EXPECT_NE(error.find("Loop::post"), std::string::npos) << error;
  EXPECT_EQ(loop.run_ready(), 0u);  // its own thread still drives it
}

TEST(Loop, RunReadyFromInsideACoroutineThrows) {
  auto body = []() -> Task<bool> {
    try {
      Loop::current().run_ready();
    } catch (const std::logic_error&) {
      co_return true;
    }
    co_return false;
  };
  EXPECT_TRUE(run(body()));
}

// Drives the loop until a posted function stops `done`, or `limit` passes (a broken door then
// fails the test instead of hanging it).
void run_until_stopped(std::stop_source& done, std::chrono::seconds limit) {
  auto body = [&]() -> Task<void> { co_await detail::wait_until(detail::deadline_after(limit), done.get_token()); };
  run(body());
}

// Loop::post, the door for other threads: also run under TSan (the "threads" suite).
TEST(LoopPostThreadsTest, APostFromAnotherThreadWakesALoopAsleepInTheKernel) {
  Loop& loop = Loop::current();
  std::stop_source posted;
  std::thread::id ran_on;
  auto started = std::chrono::steady_clock::now();
  std::thread poster([&] {
    std::this_thread::sleep_for(50ms);  // the loop is asleep in the kernel by now
    loop.post([&] {
      ran_on = std::this_thread::get_id();
      posted.request_stop();
    });
  });
  run_until_stopped(posted, 10s);
  poster.join();
  EXPECT_EQ(ran_on, std::this_thread::get_id());
  EXPECT_LT(std::chrono::steady_clock::now() - started, test_support::scaled(5s));
}

TEST(Loop, APostedFunctionThatThrowsIsReportedAsOneAndThoseAfterItStillRun) {
  Loop& loop = Loop::current();
  std::stop_source after_ran;
  testing::internal::CaptureStderr();
  loop.post([] { throw std::runtime_error("posted boom"); });
  loop.post([&] { after_ran.request_stop(); });
  run_until_stopped(after_ran, 10s);
  std::string reported = testing::internal::GetCapturedStderr();
  EXPECT_TRUE(after_ran.stop_requested());
  // (It had said "a done-callback threw": no result had a callback.)
  EXPECT_NE(reported.find("a function given to Loop::post threw std::runtime_error: posted boom"), std::string::npos)
      << reported;
}

TEST(LoopPostThreadsTest, PostsFromManyThreadsAllRunOnTheLoopInEachThreadsOrder) {
  Loop& loop = Loop::current();
  constexpr int kThreads = 4, kEach = 2000;
  std::vector<std::vector<int>> seen(kThreads);  // touched on the loop's thread only
  int total = 0;
  std::stop_source all_ran;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&, t] {
      for (int i = 0; i < kEach; ++i)
        loop.post([&, t, i] {
          seen[t].push_back(i);
          if (++total == kThreads * kEach) all_ran.request_stop();
        });
    });
  loop.post([] { throw std::runtime_error("a posted function that throws (reported, harmless)"); });
  run_until_stopped(all_ran, 20s);
  for (auto& t : threads) t.join();
  for (int t = 0; t < kThreads; ++t) {
    ASSERT_EQ(seen[t].size(), static_cast<std::size_t>(kEach));
    EXPECT_TRUE(std::is_sorted(seen[t].begin(), seen[t].end()));
  }
}

TEST(LoopPostThreadsTest, APostWakesAHostLoopWatchingFd) {
  Loop& loop = Loop::current();
  UniqueFd host(epoll_create1(EPOLL_CLOEXEC));
  epoll_event ev{};
  ev.events = EPOLLIN;
  ASSERT_EQ(epoll_ctl(host.get(), EPOLL_CTL_ADD, loop.fd(), &ev), 0);
  loop.run_ready();
  bool ran = false;
  std::thread poster([&] { loop.post([&] { ran = true; }); });
  for (int rounds = 0; !ran && rounds < 50; ++rounds) {
    epoll_event out;
    if (epoll_wait(host.get(), &out, 1, 100) == 1) loop.run_ready();
  }
  poster.join();
  EXPECT_TRUE(ran);
}

}  // namespace
}  // namespace forkpool
