#include <forkpool/ipc/internal/frame.hpp>

#include <errno.h>
#include <sys/stat.h>
#include <sys/mman.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <system_error>

#include <forkpool/ipc/private/memfd.hpp>
#include <forkpool/runtime/error.hpp>

namespace forkpool::detail {
namespace {

constexpr std::size_t control_space(std::size_t fd_count) { return CMSG_SPACE(fd_count * sizeof(int)); }

}  // namespace

OutgoingFrame::OutgoingFrame(std::uint16_t kind, std::uint64_t request_id, std::span<const std::byte> payload,
                             std::span<const int> fds, std::size_t inline_max) {
  bool via_memfd = payload.size() > std::min(inline_max, kInlinePayloadMax);
  if (via_memfd) payload_memfd_ = sealed_memfd_with("forkpool-payload", payload);
  std::size_t fd_count = fds.size() + (via_memfd ? 1 : 0);
  if (fd_count > kMaxMessageFds)
    throw Error("forkpool: a message may carry at most " + std::to_string(kMaxMessageFds) + " descriptors, not " +
                std::to_string(fd_count));

  header_ = {kFrameMagic,    kind,      static_cast<std::uint16_t>(fd_count), via_memfd ? kPayloadInMemfd : 0u, 0,
             payload.size(), request_id};
  iov_[0] = {&header_, sizeof header_};
  iov_[1] = {via_memfd ? nullptr : const_cast<std::byte*>(payload.data()), via_memfd ? 0 : payload.size()};
  msg_.msg_iov = iov_.data();
  msg_.msg_iovlen = 2;
  if (fd_count > 0) {
    control_.assign(control_space(fd_count), std::byte{0});
    msg_.msg_control = control_.data();
    msg_.msg_controllen = control_.size();
    cmsghdr* cmsg = CMSG_FIRSTHDR(&msg_);
    cmsg->cmsg_level = SOL_SOCKET;
    cmsg->cmsg_type = SCM_RIGHTS;
    cmsg->cmsg_len = CMSG_LEN(fd_count * sizeof(int));
    auto* out = reinterpret_cast<unsigned char*>(CMSG_DATA(cmsg));
    std::size_t i = 0;
    auto put = [&](int fd) { std::memcpy(out + sizeof(int) * i++, &fd, sizeof fd); };
    if (via_memfd) put(payload_memfd_.get());
    for (int fd : fds) put(fd);
  }
}

FrameReceiver::FrameReceiver()
    : buffer_(sizeof(FrameHeader) + kInlinePayloadMax), control_(control_space(kMaxMessageFds)) {}

msghdr* FrameReceiver::prepare() {
  iov_ = {buffer_.data(), buffer_.size()};
  msg_ = {};
  msg_.msg_iov = &iov_;
  msg_.msg_iovlen = 1;
  msg_.msg_control = control_.data();
  msg_.msg_controllen = control_.size();
  return &msg_;
}

}  // namespace forkpool::detail

namespace forkpool {

bool ChannelClosed::is_peer_gone(int error) noexcept {
  return error == ECONNRESET || error == EPIPE || error == ENOTCONN;
}

void ChannelClosed::throw_peer_gone(int error) {
  throw ChannelClosed(std::string("forkpool: the peer is gone (") + strerrorname_np(error) + ")");
}

}  // namespace forkpool

namespace forkpool::detail {

Message FrameReceiver::finish(long result) {
  if (result < 0) {
    int error = static_cast<int>(-result);
    if (ChannelClosed::is_peer_gone(error)) ChannelClosed::throw_peer_gone(error);
    throw std::system_error(error, std::generic_category(), "recvmsg");
  }
  // Own every descriptor that arrived before looking at anything else: even an empty datagram
  // can carry some.
  std::vector<UniqueFd> fds;
  for (cmsghdr* cmsg = CMSG_FIRSTHDR(&msg_); cmsg; cmsg = CMSG_NXTHDR(&msg_, cmsg)) {
    if (cmsg->cmsg_level != SOL_SOCKET || cmsg->cmsg_type != SCM_RIGHTS) continue;
    std::size_t count = (cmsg->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (std::size_t i = 0; i < count; ++i) {
      int fd;
      std::memcpy(&fd, CMSG_DATA(cmsg) + i * sizeof(int), sizeof fd);
      fds.emplace_back(fd);
    }
  }
  if (result == 0 && fds.empty() && !(msg_.msg_flags & MSG_CTRUNC))
    throw ChannelClosed("forkpool: the peer closed the channel");
  auto fail = [](const std::string& what) -> ProtocolError { return ProtocolError("forkpool: bad frame: " + what); };
  if (msg_.msg_flags & MSG_CTRUNC)
    throw fail(
        "descriptors were truncated (MSG_CTRUNC): too many were sent, or this process's descriptor table "
        "is full (RLIMIT_NOFILE)");
  if (msg_.msg_flags & MSG_TRUNC) throw fail("the datagram was larger than any valid frame (MSG_TRUNC)");
  auto size = static_cast<std::size_t>(result);
  if (size < sizeof(FrameHeader)) throw fail("only " + std::to_string(size) + " bytes, shorter than a header");
  FrameHeader header;
  std::memcpy(&header, buffer_.data(), sizeof header);
  if (header.magic != kFrameMagic) throw fail("wrong magic number");
  if (header.fd_count != fds.size())
    throw fail("header announces " + std::to_string(header.fd_count) + " descriptors, " + std::to_string(fds.size()) +
               " arrived");
  if (header.flags & ~kPayloadInMemfd) throw fail("unknown flags");

  Message message;
  message.kind = header.kind;
  message.request_id = header.request_id;
  std::size_t inline_size = size - sizeof(FrameHeader);
  if (header.flags & kPayloadInMemfd) {
    if (inline_size != 0) throw fail("payload both inline and in a memfd");
    if (fds.empty()) throw fail("payload memfd missing");
    if (header.payload_size > kMaxPayload) throw fail("payload of " + std::to_string(header.payload_size) + " bytes");
    check_sealed_memfd(fds.front().get(), header.payload_size, "forkpool: payload memfd");
    auto payload_size = static_cast<std::size_t>(header.payload_size);
    // A payload is written whole by its sender. One with holes (16 real bytes claiming a GiB)
    // would make us fault in, and decode, memory the sender never paid for.
    struct stat st {};
    if (fstat(fds.front().get(), &st) != 0 || allocated_bytes(st) < payload_size)
      throw fail("payload memfd of " + std::to_string(payload_size) + " bytes has only " +
                 std::to_string(allocated_bytes(st)) + " written");
    message.payload = Payload(Mapping::map(fds.front().get(), payload_size, PROT_READ), payload_size);
    fds.erase(fds.begin());
  } else {
    if (header.payload_size != inline_size)
      throw fail("header announces " + std::to_string(header.payload_size) + " payload bytes, " +
                 std::to_string(inline_size) + " arrived");
    message.payload = Payload(std::span<const std::byte>(buffer_.data() + sizeof(FrameHeader), inline_size));
  }
  message.fds = std::move(fds);
  return message;
}

}  // namespace forkpool::detail
