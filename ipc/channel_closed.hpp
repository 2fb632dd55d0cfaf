#pragma once
// ChannelClosed: the peer of a channel is gone (EOF, ECONNRESET, EPIPE), distinct from a malformed
// message. What a Connection's recv() throws at the end (Python's EOFError):
//   catch (const forkpool::ChannelClosed&) { ... }

#include <forkpool/runtime/error.hpp>

namespace forkpool {

class ChannelClosed : public Error {
 public:
  using Error::Error;
  // True for the errno values that mean the peer is gone.
  static bool is_peer_gone(int error) noexcept;
  [[noreturn]] static void throw_peer_gone(int error);
};

}  // namespace forkpool
