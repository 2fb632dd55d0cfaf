#pragma once
// Frames: one message is one SOCK_SEQPACKET datagram, a fixed header + payload + descriptors
// sent with SCM_RIGHTS, so framing can never desynchronise. A payload above kInlinePayloadMax
// travels in a sealed memfd attached as the first descriptor instead of through the socket.

#include <sys/socket.h>
#include <sys/uio.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include <forkpool/ipc/channel_closed.hpp>
#include <forkpool/ipc/codec.hpp>
#include <forkpool/ipc/internal/mapping.hpp>
#include <forkpool/ipc/internal/spare_buffers.hpp>
#include <forkpool/runtime/unique_fd.hpp>

namespace forkpool::detail {

using forkpool::ChannelClosed;

// Most descriptors one message may carry (the kernel's SCM_MAX_FD is 253).
inline constexpr std::size_t kMaxMessageFds = 250;
// Largest payload sent inline; larger ones go through a sealed memfd. Inline costs two copies;
// a fresh memfd costs a page fault per 4 KiB on each side and an munmap (on these VMs ~20 µs a
// fault, 0.7 ms an munmap of 64 KiB), so inline wins up to the most a socket's send buffer takes
// in one datagram (Channel::inline_limit(); bench/ipc_bench measures both).
inline constexpr std::size_t kInlinePayloadMax = std::size_t{256} * 1024;
// Largest payload a receiver accepts at all.
inline constexpr std::uint64_t kMaxPayload = std::uint64_t{1} << 40;

struct FrameHeader {
  std::uint32_t magic;
  std::uint16_t kind;
  std::uint16_t fd_count;  // descriptors attached, the payload memfd included
  std::uint32_t flags;
  std::uint32_t reserved;
  std::uint64_t payload_size;
  std::uint64_t request_id;
};
static_assert(sizeof(FrameHeader) == 32);

inline constexpr std::uint32_t kFrameMagic = 0x4c504b46;  // "FKPL"
inline constexpr std::uint32_t kPayloadInMemfd = 1;

// The bytes of a received payload: a copy (held inside when small, so that a small result
// costs no allocation) or a read-only mapping of the sender's sealed memfd.
class Payload {
 public:
  Payload() = default;
  explicit Payload(std::span<const std::byte> bytes) : copied_(bytes) {}
  explicit Payload(const std::vector<std::byte>& bytes) : Payload(std::span<const std::byte>(bytes)) {}
  explicit Payload(Mapping mapping, std::size_t size) : mapped_(std::move(mapping)), mapped_size_(size) {}
  std::span<const std::byte> bytes() const noexcept {
    return mapped_.data() ? std::span<const std::byte>(mapped_.data(), mapped_size_) : copied_.bytes();
  }

 private:
  InlineBytes<112> copied_;  // a few plain results fit; freed buffers go back to the spares
  Mapping mapped_;
  std::size_t mapped_size_ = 0;
};

struct Message {
  std::uint16_t kind = 0;
  std::uint64_t request_id = 0;
  Payload payload;
  std::vector<UniqueFd> fds;  // the payload memfd, if any, is not among them

  Reader reader() { return Reader(payload.bytes(), fds); }
};

// A frame ready for sendmsg(); owns everything the kernel reads until the send completes, so
// it must not move once built.
class OutgoingFrame {
 public:
  // Payloads above `inline_max` bytes (at most kInlinePayloadMax) travel in a sealed memfd;
  // bench/ipc_bench lowers it to measure the crossover.
  OutgoingFrame(std::uint16_t kind, std::uint64_t request_id, std::span<const std::byte> payload,
                std::span<const int> fds, std::size_t inline_max = kInlinePayloadMax);
  OutgoingFrame(const OutgoingFrame&) = delete;
  OutgoingFrame& operator=(const OutgoingFrame&) = delete;

  const msghdr* message() const noexcept { return &msg_; }
  std::size_t size() const noexcept { return sizeof(FrameHeader) + iov_[1].iov_len; }

 private:
  FrameHeader header_{};
  UniqueFd payload_memfd_;
  std::array<iovec, 2> iov_{};
  std::vector<std::byte> control_;
  msghdr msg_{};
};

// Receives frames: owns the buffers recvmsg() fills and turns what arrived into a Message,
// validating everything. Descriptors are owned from the moment they arrive, so every error
// path closes them.
class FrameReceiver {
 public:
  FrameReceiver();
  FrameReceiver(const FrameReceiver&) = delete;
  FrameReceiver& operator=(const FrameReceiver&) = delete;

  // The msghdr for the next recvmsg() (use MSG_CMSG_CLOEXEC).
  msghdr* prepare();
  // Turns recvmsg()'s result (bytes, or -errno) into a Message. Throws ChannelClosed when the
  // peer is gone, ProtocolError when what arrived is malformed.
  Message finish(long result);

 private:
  ByteBuffer buffer_;  // uninitialised: only what datagrams fill is ever paged in
  std::vector<std::byte> control_;
  iovec iov_{};
  msghdr msg_{};
};

}  // namespace forkpool::detail
