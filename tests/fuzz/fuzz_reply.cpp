// libFuzzer target: a worker's reply as the parent reads it (PoolWorker::deliver and handle_reply:
// bytes from a task that may be hostile). The first byte picks the message: a result (parse_result,
// then the results' blocks, the release and the results of a chunk of `int f(int)` or
// `std::string f(int)`), an error (decode_exception), a slab introduction (with one sealed memfd
// attached) or a release. Each must be read or refused with ProtocolError; never a crash, never
// a read outside the message, and the parent's books stay whole for the next reply.

#include <cstdint>
#include <string>
#include <vector>

#include <forkpool/ipc/private/memfd.hpp>
#include <forkpool/worker/internal/protocol.hpp>
#include <forkpool/runtime/error.hpp>
#include <forkpool/shm/private/peer_memory.hpp>

namespace fp = forkpool;
namespace fd = forkpool::detail;

namespace {

template <class R>
void read_chunk(const fd::ResultLayout& result, fd::PeerMemory& memory, std::vector<fp::UniqueFd>& fds,
                std::uint64_t chunk) {
  fd::IncomingBlocks blocks = memory.accept_blocks(result.results.table);
  memory.accept_release(result.release);
  fp::Reader results(result.results.body, fds, &blocks);
  std::vector<R> out(chunk);
  fd::read_results<R>(results, fd::ElementRange{0, chunk}, chunk, [&](std::size_t i, R&& r) { out[i] = std::move(r); });
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 2) return 0;
  std::span<const std::byte> payload(reinterpret_cast<const std::byte*>(data + 2), size - 2);
  static auto memory = std::make_shared<fd::PeerMemory>();  // one conversation, as a worker's
  std::vector<fp::UniqueFd> fds;
  try {
    switch (data[0] % 5) {
      case 0: read_chunk<int>(fd::parse_result(payload), *memory, fds, data[1] % 8 + 1); break;
      case 1: read_chunk<std::string>(fd::parse_result(payload), *memory, fds, data[1] % 8 + 1); break;
      case 2: fd::decode_exception<fp::RemoteError>(payload, 1); break;
      case 3: {
        std::vector<std::byte> zeros(4096 * (data[1] % 4 + 1));
        fds.push_back(fp::sealed_memfd_with("fuzz-slab", zeros));
        memory->accept_introduction(payload, fds);
        break;
      }
      case 4: memory->accept_release(payload); break;
    }
  } catch (const fp::ProtocolError&) {
    // Refused: a real parent drops the worker. This one starts a new conversation, as the
    // parent would with its replacement.
    memory->peer_gone();
    memory = std::make_shared<fd::PeerMemory>();
  }
  return 0;
}
