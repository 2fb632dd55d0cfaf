// libFuzzer target: a Queue item as a getter reads it (decode_queue_item: the table of blocks,
// the descriptor indices, then the body), read as an int and a string, or as a Tensor. Three
// descriptors come with every item, as a putter could attach them: a sealed memfd (a slab), a
// datagram socket (the owner's release socket) and a pipe (neither). The item must be read or
// refused with ProtocolError; never a crash, never a read outside the message or the slab.

#include <fcntl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdint>
#include <string>
#include <vector>

#include <forkpool/ipc/internal/frame.hpp>
#include <forkpool/ipc/private/memfd.hpp>
#include <forkpool/runtime/error.hpp>
#include <forkpool/shm/tensor.hpp>
#include <forkpool/shm/tensor_codec.hpp>
#include <forkpool/sync/queue.hpp>

namespace fp = forkpool;
namespace fd = forkpool::detail;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 2) return 0;
  fd::Message message;
  message.payload = fd::Payload(std::vector<std::byte>(reinterpret_cast<const std::byte*>(data + 2),
                                                       reinterpret_cast<const std::byte*>(data + size)));
  std::vector<std::byte> zeros(4096 * (data[1] % 16 + 1));
  message.fds.push_back(fp::sealed_memfd_with("fuzz-slab", zeros));
  int sockets[2];
  if (socketpair(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0, sockets) < 0) return 0;
  message.fds.emplace_back(sockets[0]);
  fp::UniqueFd peer(sockets[1]);
  int pipe_ends[2];
  if (pipe2(pipe_ends, O_CLOEXEC) < 0) return 0;
  message.fds.emplace_back(pipe_ends[0]);
  fp::UniqueFd write_end(pipe_ends[1]);
  try {
    fd::decode_queue_item(message, [&](fp::Reader& in) {
      if (data[0] % 2 == 0) {
        in.read<int>();
        in.read<std::string>();
      } else {
        fp::Tensor tensor = in.read<fp::Tensor>();
        if (tensor.nbytes() > 0) {
          volatile char first = *static_cast<const char*>(tensor.raw_data());  // mapped, and ours to read
          (void)first;
        }
      }
      in.expect_end();
    });
  } catch (const fp::ProtocolError&) {}
  return 0;
}
