#include <forkpool/sync/pipe.hpp>

#include <poll.h>
#include <sys/socket.h>

#include <cerrno>
#include <stdexcept>

#include <forkpool/sync/private/waits.hpp>
#include <forkpool/runtime/error.hpp>
#include <forkpool/runtime/private/errno.hpp>

namespace forkpool {
namespace detail {

void encode_connection(Writer& w, const std::shared_ptr<ConnectionEnd>& end) {
  if (end->channel.fd() < 0) throw std::logic_error("forkpool: a closed Connection cannot be sent");
  w.write(static_cast<std::uint8_t>(end->readable));
  w.write(static_cast<std::uint8_t>(end->writable));
  w.write_fd(end->channel.fd(), end);
}

std::shared_ptr<ConnectionEnd> decode_connection(Reader& r) {
  bool readable = r.read<std::uint8_t>() != 0;
  bool writable = r.read<std::uint8_t>() != 0;
  UniqueFd fd = r.read_fd();
  int type = 0;
  socklen_t size = sizeof type;
  if (getsockopt(fd.get(), SOL_SOCKET, SO_TYPE, &type, &size) != 0 || type != SOCK_SEQPACKET)
    r.fail("a Connection's descriptor is not a SOCK_SEQPACKET socket");
  return std::make_shared<ConnectionEnd>(Channel(std::move(fd)), readable, writable);
}

void check_connection(const ConnectionEnd& end, bool for_sending) {
  if (end.channel.fd() < 0) throw std::logic_error("forkpool: Connection used after close()");
  if (for_sending && !end.writable) throw std::logic_error("forkpool: send() on the receiving end of a one-way Pipe");
  if (!for_sending && !end.readable) throw std::logic_error("forkpool: recv() on the sending end of a one-way Pipe");
}

bool connection_poll(const ConnectionEnd& end, std::chrono::nanoseconds timeout) {
  check_connection(end, false);
  return wait_for_fd(end.channel.fd(), POLLIN, deadline_unless_forever(timeout), "forkpool: Connection::poll");
}

}  // namespace detail

std::vector<int> wait_ready(std::span<const int> fds, std::chrono::nanoseconds timeout) {
  std::vector<pollfd> polled;
  for (int fd : fds) polled.push_back({fd, POLLIN, 0});
  detail::Deadline deadline = detail::deadline_unless_forever(timeout);
  for (;;) {
    int ready = ::poll(polled.data(), polled.size(), detail::poll_timeout(deadline));
    if (ready < 0 && errno == EINTR) continue;
    if (ready < 0) detail::throw_last_errno("forkpool: wait_ready");
    std::vector<int> readable;
    for (const pollfd& p : polled)
      if (p.revents) readable.push_back(p.fd);
    return readable;
  }
}

}  // namespace forkpool
