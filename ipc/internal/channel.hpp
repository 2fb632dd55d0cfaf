#pragma once
// Channel: one end of an AF_UNIX SOCK_SEQPACKET socketpair carrying frames. The parent side
// sends and receives on the event loop; a worker may use the blocking calls. send() and
// try_send() may be called from several threads at once (a datagram is sent whole); the
// receiving calls and async_send belong to one thread.

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>

#include <forkpool/ipc/internal/frame.hpp>
#include <forkpool/runtime/internal/io.hpp>
#include <forkpool/runtime/task.hpp>
#include <forkpool/runtime/unique_fd.hpp>

namespace forkpool::detail {

class Channel {
 public:
  explicit Channel(UniqueFd fd) : fd_(std::move(fd)) {}
  Channel(Channel&& other) noexcept
      : fd_(std::move(other.fd_)),
        inline_limit_(other.inline_limit_.load(std::memory_order_relaxed)),
        receiver_(std::move(other.receiver_)) {}
  Channel& operator=(Channel&& other) noexcept {
    fd_ = std::move(other.fd_);
    inline_limit_.store(other.inline_limit_.load(std::memory_order_relaxed), std::memory_order_relaxed);
    receiver_ = std::move(other.receiver_);
    return *this;
  }

  // Two connected ends, close-on-exec.
  static std::pair<Channel, Channel> make_pair();

  int fd() const noexcept { return fd_.get(); }
  UniqueFd release() noexcept { return UniqueFd(fd_.release()); }

  // Blocking. Throw ChannelClosed when the peer is gone, ProtocolError on a malformed frame.
  void send(std::uint16_t kind, std::uint64_t request_id, std::span<const std::byte> payload,
            std::span<const int> fds = {});
  Message receive();
  // Never blocks: nothing when no message is waiting. Throws like receive().
  std::optional<Message> try_receive();
  // The request id of the message try_receive() would take next, leaving it in place (its
  // descriptors too); nothing when none is waiting; 0 when it is too short to be a frame (or the
  // peer is gone): try_receive() then says what it is. Never blocks.
  std::optional<std::uint64_t> peek_request_id();
  // Never blocks: false when the socket's buffer is full. Throws like send().
  bool try_send(std::uint16_t kind, std::uint64_t request_id, std::span<const std::byte> payload,
                std::span<const int> fds = {});

  // On the calling thread's loop. Sent at once when the socket has room (so the message leaves
  // at the call, even if the caller then blocks without driving the loop), else through the
  // loop. An operation that is stopped or passes its deadline throws std::system_error
  // (ECANCELED or ETIMEDOUT).
  Task<void> async_send(std::uint16_t kind, std::uint64_t request_id, std::span<const std::byte> payload,
                        std::span<const int> fds = {}, IoOptions options = {});
  Task<Message> async_receive(IoOptions options = {});

  // Stops one direction (shutdown(2)): the peer's receive sees end-of-file.
  void shutdown_write() noexcept;
  void shutdown_read() noexcept;

 private:
  FrameReceiver& receiver();

  // The largest payload this socket sends inline: one datagram must fit in its send buffer.
  std::size_t inline_limit();

  UniqueFd fd_;
  static constexpr std::size_t kUnknownLimit = ~std::size_t{0};
  // Asked of the kernel on first use, by whichever sending thread comes first (all find the same).
  std::atomic<std::size_t> inline_limit_{kUnknownLimit};
  // Heap-allocated on first receive: the buffers are large, the Channel moves, and a Channel
  // that only sends never needs them.
  std::unique_ptr<FrameReceiver> receiver_;
};

}  // namespace forkpool::detail
