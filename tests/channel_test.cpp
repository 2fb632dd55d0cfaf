// Channels on real socketpairs, memfds and forked peers.

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include <forkpool/ipc/internal/channel.hpp>
#include <forkpool/ipc/internal/spare_buffers.hpp>
#include <forkpool/ipc/private/memfd.hpp>
#include <forkpool/runtime/loop.hpp>
#include <forkpool/runtime/when_all.hpp>
#include "support.hpp"

namespace forkpool {
namespace {

std::span<const std::byte> bytes_of(const std::string& s) { return std::as_bytes(std::span(s.data(), s.size())); }

// The numbers of owned descriptors, to attach them to a frame.
std::vector<int> raw_fds(std::span<const UniqueFd> fds) {
  std::vector<int> raw;
  for (const UniqueFd& fd : fds) raw.push_back(fd.get());
  return raw;
}
std::string string_of(const detail::Message& m) {
  auto b = m.payload.bytes();
  return std::string(reinterpret_cast<const char*>(b.data()), b.size());
}

UniqueFd pipe_read_end(std::string content) {
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) std::abort();
  if (write(fds[1], content.data(), content.size()) != static_cast<ssize_t>(content.size())) std::abort();
  close(fds[1]);
  return UniqueFd(fds[0]);
}

std::string read_all(int fd) {
  char buffer[64];
  ssize_t n = read(fd, buffer, sizeof buffer);
  return n > 0 ? std::string(buffer, n) : std::string();
}

// A small message buffer given back is the next one taken (no malloc per small message), and
// the small ones kept are bounded.
TEST(SpareBuffers, ASmallBufferGivenBackIsTakenAgainAndTheKeptOnesAreBounded) {
  using namespace detail;
  std::thread([] {  // a fresh thread: its own spares, none kept yet
    ByteBuffer small;
    small.reserve(128);
    const std::byte* memory = small.data();
    give_back_buffer(std::move(small));
    ByteBuffer again = take_spare_buffer();
    EXPECT_EQ(again.data(), memory);
    EXPECT_TRUE(again.empty());
    EXPECT_GE(again.capacity(), 128u);
    EXPECT_EQ(take_spare_buffer().capacity(), 0u);  // nothing more kept
    for (std::size_t i = 0; i < kMaxSmallSpares + 10; ++i) {
      ByteBuffer b;
      b.reserve(64);
      give_back_buffer(std::move(b));
    }
    std::size_t taken = 0;
    while (take_spare_buffer().capacity() > 0) ++taken;
    EXPECT_EQ(taken, kMaxSmallSpares);
  })
      .join();
}

TEST(Channel, CarriesKindIdPayloadAndADescriptor) {
  auto [a, b] = detail::Channel::make_pair();
  std::vector<UniqueFd> fds;
  fds.push_back(pipe_read_end("through the pipe"));
  a.send(7, 99, bytes_of("payload"), raw_fds(fds));
  detail::Message m = b.receive();
  EXPECT_EQ(m.kind, 7);
  EXPECT_EQ(m.request_id, 99u);
  EXPECT_EQ(string_of(m), "payload");
  ASSERT_EQ(m.fds.size(), 1u);
  EXPECT_EQ(read_all(m.fds[0].get()), "through the pipe");
  EXPECT_TRUE(fcntl(m.fds[0].get(), F_GETFD) & FD_CLOEXEC);
}

// A peer that exits with our message unread: the kernel says ECONNRESET first, but what the peer
// sent before it went (a worker's initializer error) is still read, then end-of-file.
TEST(Channel, APeersLastMessagesAreReadThoughItClosedWithOursUnread) {
  for (int form = 0; form < 3; ++form) {
    auto [ours, theirs] = detail::Channel::make_pair();
    std::vector<std::byte> last_word(8, std::byte{7});
    theirs.send(3, 0, last_word);
    ours.send(1, 42, last_word);           // never read
    theirs = detail::Channel(UniqueFd());  // closed with our message in its queue
    detail::Message got;
    if (form == 0) got = ours.receive();
    if (form == 1) got = *ours.try_receive();
    if (form == 2) got = run(ours.async_receive());
    EXPECT_EQ(got.kind, 3) << "form " << form;
    EXPECT_EQ(got.payload.bytes().size(), 8u);
    EXPECT_THROW(ours.receive(), detail::ChannelClosed);
  }
}

TEST(Channel, CarriesTheMaximumNumberOfDescriptors) {
  auto [a, b] = detail::Channel::make_pair();
  std::vector<UniqueFd> fds;
  for (std::size_t i = 0; i < detail::kMaxMessageFds; ++i) fds.push_back(pipe_read_end(std::to_string(i)));
  a.send(1, 1, {}, raw_fds(fds));
  detail::Message m = b.receive();
  ASSERT_EQ(m.fds.size(), detail::kMaxMessageFds);
  EXPECT_EQ(read_all(m.fds[0].get()), "0");
  EXPECT_EQ(read_all(m.fds[detail::kMaxMessageFds - 1].get()), std::to_string(detail::kMaxMessageFds - 1));
}

TEST(Channel, RefusesToSendMoreThanTheMaximumOfDescriptors) {
  auto [a, b] = detail::Channel::make_pair();
  std::vector<UniqueFd> fds;
  for (std::size_t i = 0; i <= detail::kMaxMessageFds; ++i) fds.push_back(pipe_read_end("x"));
  EXPECT_THROW(a.send(1, 1, {}, raw_fds(fds)), Error);
}

TEST(Channel, CarriesA64MiBPayloadThroughASealedMemfd) {
  auto [a, b] = detail::Channel::make_pair();
  std::string big(64 << 20, '\0');
  for (std::size_t i = 0; i < big.size(); i += 4096) big[i] = static_cast<char>(i / 4096);
  a.send(2, 3, bytes_of(big));
  detail::Message m = b.receive();
  EXPECT_EQ(m.payload.bytes().size(), big.size());
  EXPECT_TRUE(m.fds.empty());
  EXPECT_EQ(std::memcmp(m.payload.bytes().data(), big.data(), big.size()), 0);
}

// Raw datagrams, as a broken or hostile peer would send them.
void send_raw(int fd, const void* data, std::size_t size, std::vector<int> fds = {}) {
  iovec iov{const_cast<void*>(data), size};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  std::vector<char> control(CMSG_SPACE(fds.size() * sizeof(int)));
  if (!fds.empty()) {
    msg.msg_control = control.data();
    msg.msg_controllen = control.size();
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(fds.size() * sizeof(int));
    std::memcpy(CMSG_DATA(c), fds.data(), fds.size() * sizeof(int));
  }
  ASSERT_GE(sendmsg(fd, &msg, MSG_NOSIGNAL), 0);
}

void expect_protocol_error(detail::Channel& receiver, const char* fragment) {
  try {
    receiver.receive();
    FAIL() << "no ProtocolError";
  } catch (const ProtocolError& e) {
    EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
  }
}

detail::FrameHeader header(std::uint16_t fd_count, std::uint64_t payload, std::uint32_t flags = 0) {
  return detail::FrameHeader{detail::kFrameMagic, 1, fd_count, flags, 0, payload, 1};
}

TEST(Channel, ATruncatedFrameIsAProtocolError) {
  auto [a, b] = detail::Channel::make_pair();
  char three[3] = {1, 2, 3};
  send_raw(a.fd(), three, sizeof three);
  expect_protocol_error(b, "shorter than a header");
  detail::FrameHeader h = header(0, 100);  // claims 100 bytes, carries none
  send_raw(a.fd(), &h, sizeof h);
  expect_protocol_error(b, "announces 100 payload bytes, 0 arrived");
}

TEST(Channel, AnOversizedDatagramIsAProtocolError) {
  auto [a, b] = detail::Channel::make_pair();
  int size = 1 << 20;
  setsockopt(a.fd(), SOL_SOCKET, SO_SNDBUF, &size, sizeof size);
  std::vector<char> big(sizeof(detail::FrameHeader) + detail::kInlinePayloadMax + 100);
  detail::FrameHeader h = header(0, big.size() - sizeof(detail::FrameHeader));
  std::memcpy(big.data(), &h, sizeof h);
  send_raw(a.fd(), big.data(), big.size());
  expect_protocol_error(b, "MSG_TRUNC");
}

TEST(Channel, ADescriptorCountMismatchIsAProtocolErrorAndClosesWhatArrived) {
  auto [a, b] = detail::Channel::make_pair();
  int before = test_support::open_fd_count();
  UniqueFd fd = pipe_read_end("x");
  detail::FrameHeader h = header(2, 0);  // announces two, carries one
  send_raw(a.fd(), &h, sizeof h, {fd.get()});
  expect_protocol_error(b, "announces 2 descriptors, 1 arrived");
  fd.reset();
  EXPECT_EQ(test_support::open_fd_count(), before);
}

TEST(Channel, AnUnsealedPayloadMemfdIsAProtocolError) {
  auto [a, b] = detail::Channel::make_pair();
  UniqueFd unsealed = create_memfd("unsealed", 1 << 20);
  detail::FrameHeader h = header(1, 1 << 20, detail::kPayloadInMemfd);
  send_raw(a.fd(), &h, sizeof h, {unsealed.get()});
  expect_protocol_error(b, "not sealed");
}

TEST(Channel, AShortPayloadMemfdIsAProtocolError) {
  auto [a, b] = detail::Channel::make_pair();
  UniqueFd small = create_memfd("short", 4096);
  seal_size(small.get());
  detail::FrameHeader h = header(1, 1 << 20, detail::kPayloadInMemfd);  // claims more than the memfd holds
  send_raw(a.fd(), &h, sizeof h, {small.get()});
  expect_protocol_error(b, "holds 4096 bytes");
}

TEST(Channel, ASparsePayloadMemfdThatClaimsAGibibyteIsAProtocolErrorAndNothingIsRead) {
  auto [a, b] = detail::Channel::make_pair();
  constexpr std::size_t kClaimed = std::size_t{1} << 30;
  UniqueFd sparse = create_memfd("sparse", kClaimed);  // a hole but for the 16 bytes written
  ASSERT_EQ(pwrite(sparse.get(), "sixteen bytes!!!", 16, 0), 16);
  seal_size(sparse.get());
  detail::FrameHeader h = header(1, kClaimed, detail::kPayloadInMemfd);
  send_raw(a.fd(), &h, sizeof h, {sparse.get()});
  long rss_before = test_support::rss_kib();
  expect_protocol_error(b, "has only 4096 written");
  EXPECT_LT(test_support::rss_kib() - rss_before, 16 * 1024);
}

TEST(Channel, APipeInPlaceOfAPayloadMemfdIsAProtocolError) {
  auto [a, b] = detail::Channel::make_pair();
  UniqueFd pipe = pipe_read_end("x");
  detail::FrameHeader h = header(1, 100, detail::kPayloadInMemfd);
  send_raw(a.fd(), &h, sizeof h, {pipe.get()});
  expect_protocol_error(b, "not a memfd");
}

TEST(Channel, PeerDeathMidConversationIsChannelClosed) {
  auto [parent, child] = detail::Channel::make_pair();
  pid_t pid = fork();
  if (pid == 0) {
    parent.release().reset();
    child.send(1, 1, bytes_of("first"));
    child.receive();  // the request
    _exit(0);         // dies without answering
  }
  child.release().reset();
  detail::Message first = parent.receive();
  EXPECT_EQ(string_of(first), "first");
  parent.send(1, 2, bytes_of("request"));
  EXPECT_THROW(parent.receive(), detail::ChannelClosed);
  EXPECT_THROW(parent.send(1, 3, bytes_of("more")), detail::ChannelClosed);
  waitpid(pid, nullptr, 0);
}

TEST(Channel, AsyncRoundTripWithAForkedEchoPeer) {
  auto [parent, child] = detail::Channel::make_pair();
  pid_t pid = fork();
  if (pid == 0) {
    parent.release().reset();
    try {
      for (;;) {
        detail::Message m = child.receive();
        child.send(m.kind, m.request_id, m.payload.bytes(), raw_fds(m.fds));
      }
    } catch (const detail::ChannelClosed&) {}
    _exit(0);
  }
  child.release().reset();
  auto body = [&]() -> Task<std::string> {
    std::string reply;
    for (int i = 0; i < 100; ++i) {
      std::string text = "ping " + std::to_string(i);
      co_await parent.async_send(5, i, bytes_of(text));
      detail::Message m = co_await parent.async_receive();
      EXPECT_EQ(m.request_id, static_cast<std::uint64_t>(i));
      reply = string_of(m);
    }
    co_return reply;
  };
  EXPECT_EQ(run(body()), "ping 99");
  parent.shutdown_write();
  int status = 0;
  waitpid(pid, &status, 0);
  EXPECT_TRUE(WIFEXITED(status));
}

TEST(Channel, AStoppedReceiveThrowsAndLosesNothingLater) {
  auto [a, b] = detail::Channel::make_pair();
  std::stop_source stop;
  auto body = [&]() -> Task<std::string> {
    auto stopper = [&]() -> Task<void> {
      co_await sleep_for(std::chrono::milliseconds(2));
      stop.request_stop();
    };
    auto receive = [&]() -> Task<int> {
      try {
        co_await b.async_receive({.stop = stop.get_token()});
      } catch (const std::system_error& e) {
        co_return e.code().value();
      }
      co_return 0;
    };
    auto [code, unused] = co_await when_all(receive(), stopper());
    EXPECT_EQ(code, ECANCELED);
    a.send(1, 1, bytes_of("after"));
    detail::Message m = co_await b.async_receive();
    co_return string_of(m);
  };
  EXPECT_EQ(run(body()), "after");
}

TEST(Channel, AHundredThousandMessagesWithDescriptorsLeakNoDescriptor) {
  auto [a, b] = detail::Channel::make_pair();
  UniqueFd memfd = create_memfd("shared", 4096);
  std::vector<int> fds{memfd.get()};
  int before = test_support::open_fd_count();
  auto body = [&]() -> Task<void> {
    for (int i = 0; i < 100'000; ++i) {
      co_await a.async_send(1, i, {}, fds);
      detail::Message m = co_await b.async_receive();
      if (m.fds.size() != 1) throw std::runtime_error("descriptor missing");
    }
  };
  run(body());
  EXPECT_EQ(test_support::open_fd_count(), before);
}

}  // namespace
}  // namespace forkpool

namespace forkpool {
namespace {

TEST(Channel, AnEmptyDatagramWithDescriptorsIsAProtocolErrorAndLeaksNothing) {
  // Found by the frame fuzzer: zero bytes read looked like end-of-file, and the descriptors
  // that came with them were never closed.
  auto [a, b] = detail::Channel::make_pair();
  int before = test_support::open_fd_count();
  {
    UniqueFd fd = pipe_read_end("x");
    send_raw(a.fd(), "", 0, {fd.get()});
  }
  expect_protocol_error(b, "shorter than a header");
  EXPECT_EQ(test_support::open_fd_count(), before);
}

}  // namespace
}  // namespace forkpool
