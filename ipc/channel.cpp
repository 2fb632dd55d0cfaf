#include <forkpool/ipc/internal/channel.hpp>

#include <errno.h>
#include <sys/socket.h>

#include <algorithm>
#include <string>
#include <system_error>

#include <forkpool/runtime/error.hpp>
#include <forkpool/runtime/private/errno.hpp>

namespace forkpool::detail {
namespace {

constexpr int kSendFlags = MSG_NOSIGNAL;
constexpr int kReceiveFlags = MSG_CMSG_CLOEXEC;

void check_sent(long result, const OutgoingFrame& frame) {
  if (result >= 0) {
    if (static_cast<std::size_t>(result) != frame.size()) throw Error("forkpool: short send of a frame");
    return;
  }
  int error = static_cast<int>(-result);
  if (ChannelClosed::is_peer_gone(error)) ChannelClosed::throw_peer_gone(error);
  throw std::system_error(error, std::generic_category(), "forkpool: sendmsg");
}

// sendmsg() restarted after signals; the byte count or -errno.
long sendmsg_retrying(int fd, const OutgoingFrame& frame, int flags) {
  long rc;
  do rc = ::sendmsg(fd, frame.message(), flags);
  while (rc < 0 && errno == EINTR);
  return rc < 0 ? -errno : rc;
}

}  // namespace

std::pair<Channel, Channel> Channel::make_pair() {
  int fds[2];
  if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, fds) < 0) detail::throw_last_errno("forkpool: socketpair");
  std::pair<Channel, Channel> ends{Channel(UniqueFd(fds[0])), Channel(UniqueFd(fds[1]))};
  // Room for an inline payload of kInlinePayloadMax (the kernel caps this at net.core.wmem_max
  // and doubles it; inline_limit() reads back what it got).
  int wanted = static_cast<int>(kInlinePayloadMax + 4096);
  for (int fd : fds) (void)setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &wanted, sizeof wanted);
  return ends;
}

std::size_t Channel::inline_limit() {
  std::size_t limit = inline_limit_.load(std::memory_order_relaxed);
  if (limit == kUnknownLimit) {
    // A unix datagram of more than the send buffer less 32 bytes is EMSGSIZE.
    constexpr std::size_t kSpare = 512 + sizeof(FrameHeader);
    int sndbuf = 0;
    socklen_t length = sizeof sndbuf;
    std::size_t fits = 0;  // a descriptor we cannot ask: every payload through a memfd
    if (getsockopt(fd_.get(), SOL_SOCKET, SO_SNDBUF, &sndbuf, &length) == 0 &&
        static_cast<std::size_t>(sndbuf) > kSpare)
      fits = static_cast<std::size_t>(sndbuf) - kSpare;
    limit = std::min(fits, kInlinePayloadMax);
    inline_limit_.store(limit, std::memory_order_relaxed);
  }
  return limit;
}

void Channel::send(std::uint16_t kind, std::uint64_t request_id, std::span<const std::byte> payload,
                   std::span<const int> fds) {
  OutgoingFrame frame(kind, request_id, payload, fds, inline_limit());
  check_sent(sendmsg_retrying(fd_.get(), frame, kSendFlags), frame);
}

bool Channel::try_send(std::uint16_t kind, std::uint64_t request_id, std::span<const std::byte> payload,
                       std::span<const int> fds) {
  OutgoingFrame frame(kind, request_id, payload, fds, inline_limit());
  long rc = sendmsg_retrying(fd_.get(), frame, kSendFlags | MSG_DONTWAIT);
  if (rc == -EAGAIN || rc == -EWOULDBLOCK) return false;
  check_sent(rc, frame);
  return true;
}

// A peer that closed its end with our messages unread makes the kernel report ECONNRESET once,
// before the messages the peer sent us: it says nothing of those, which are read on (a worker's
// last word, sent just before it exited with a task of ours unread). End-of-file follows them.
Message Channel::receive() {
  long rc;
  do rc = ::recvmsg(fd_.get(), receiver().prepare(), kReceiveFlags);
  while (rc < 0 && (errno == EINTR || errno == ECONNRESET));
  return receiver().finish(rc < 0 ? -errno : rc);
}

std::optional<Message> Channel::try_receive() {
  long rc;
  do rc = ::recvmsg(fd_.get(), receiver().prepare(), kReceiveFlags | MSG_DONTWAIT);
  while (rc < 0 && (errno == EINTR || errno == ECONNRESET));
  if (rc < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return std::nullopt;
  return receiver().finish(rc < 0 ? -errno : rc);
}

std::optional<std::uint64_t> Channel::peek_request_id() {
  // No control buffer: the kernel keeps the descriptors with the message (MSG_CTRUNC here).
  FrameHeader header{};
  long rc;
  do rc = ::recv(fd_.get(), &header, sizeof header, MSG_PEEK | MSG_DONTWAIT);
  while (rc < 0 && (errno == EINTR || errno == ECONNRESET));
  if (rc < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return std::nullopt;
  if (rc < 0) detail::throw_last_errno("forkpool: peek");
  return rc == static_cast<long>(sizeof header) ? header.request_id : 0;
}

Task<void> Channel::async_send(std::uint16_t kind, std::uint64_t request_id, std::span<const std::byte> payload,
                               std::span<const int> fds, IoOptions options) {
  OutgoingFrame frame(kind, request_id, payload, fds, inline_limit());
  long rc = -EAGAIN;
  if (!options.stop.get().stop_requested()) rc = sendmsg_retrying(fd_.get(), frame, kSendFlags | MSG_DONTWAIT);
  if (rc == -EAGAIN || rc == -EWOULDBLOCK) rc = co_await async_sendmsg(fd_.get(), frame.message(), kSendFlags, options);
  check_sent(rc, frame);
}

Task<Message> Channel::async_receive(IoOptions options) {
  int rc;
  do rc = co_await async_recvmsg(fd_.get(), receiver().prepare(), kReceiveFlags, options);
  while (rc == -ECONNRESET);  // reported once, before what the peer sent (receive())
  if (rc == -ECANCELED || rc == -ETIMEDOUT) throw std::system_error(-rc, std::generic_category(), "forkpool: receive");
  co_return receiver().finish(rc);
}

FrameReceiver& Channel::receiver() {
  if (!receiver_) receiver_ = std::make_unique<FrameReceiver>();
  return *receiver_;
}

void Channel::shutdown_write() noexcept { ::shutdown(fd_.get(), SHUT_WR); }
void Channel::shutdown_read() noexcept { ::shutdown(fd_.get(), SHUT_RD); }

}  // namespace forkpool::detail
