// libFuzzer target: arbitrary datagrams (with or without an attached descriptor) through the
// real receive path of a channel. Every outcome must be a Message or a forkpool::Error.

#include <sys/socket.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include <forkpool/ipc/internal/channel.hpp>
#include <forkpool/ipc/private/memfd.hpp>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static auto channels = forkpool::detail::Channel::make_pair();
  auto& [sender, receiver] = channels;
  if (size == 0 || size > forkpool::detail::kInlinePayloadMax + 1024) return 0;
  // First byte: how many memfds to attach (0-3), sized from the input, sealed or not.
  int attach = data[0] & 3;
  bool seal = data[0] & 4;
  std::vector<forkpool::UniqueFd> fds;
  for (int i = 0; i < attach; ++i) {
    fds.push_back(forkpool::create_memfd("fuzz", (size * 37) % 8192));
    if (seal) forkpool::seal_size(fds.back().get());
  }
  std::vector<int> raw;
  for (auto& fd : fds) raw.push_back(fd.get());
  iovec iov{const_cast<std::uint8_t*>(data + 1), size - 1};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  std::vector<char> control(CMSG_SPACE(sizeof(int) * 4));
  if (!raw.empty()) {
    msg.msg_control = control.data();
    msg.msg_controllen = CMSG_SPACE(sizeof(int) * raw.size());
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int) * raw.size());
    std::memcpy(CMSG_DATA(c), raw.data(), sizeof(int) * raw.size());
  }
  if (sendmsg(sender.fd(), &msg, MSG_NOSIGNAL) < 0) return 0;
  try {
    forkpool::detail::Message m = receiver.receive();
    (void)m.payload.bytes();
  } catch (const forkpool::Error&) {}
  return 0;
}
