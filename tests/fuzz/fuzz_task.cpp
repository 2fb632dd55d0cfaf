// libFuzzer target: a task message as a worker reads it (read_task: the trailer, the range of
// elements, the table of blocks) and then decodes its elements the way a call of `int f(int)` and of
// `std::size_t f(std::string)` would, skipping those before the range. Decoding must succeed or
// throw ProtocolError; never crash, never read outside the message.

#include <atomic>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include <forkpool/ipc/internal/frame.hpp>
#include <forkpool/shm/private/peer_memory.hpp>
#include <forkpool/worker/internal/protocol.hpp>

namespace fp = forkpool;

namespace {

int twice(int x) { return 2 * x; }
std::size_t length(std::string s) { return s.size(); }

template <class F, class Element>
void run_as(F f, const fp::detail::TaskCall& call, fp::Reader arguments) {
  std::atomic<std::uint64_t> running{0};
  fp::Writer out;
  fp::detail::Call<F, Element, false>::invoke(fp::detail::function_bits(f), call.range, arguments, out, running);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  fp::detail::Message message;
  message.kind = fp::detail::kTaskMessage;
  message.request_id = 1;
  message.payload = fp::detail::Payload(std::vector<std::byte>(reinterpret_cast<const std::byte*>(data + 1),
                                                               reinterpret_cast<const std::byte*>(data + size)));
  auto memory = std::make_shared<fp::detail::PeerMemory>();
  try {
    fp::detail::TaskCall call = fp::detail::read_task(message, *memory);
    fp::Reader arguments(call.elements, message.fds, &call.blocks);
    // The addresses in the message are not called: a worker trusts its parent's, and this
    // target is about the bytes.
    if (data[0] % 2 == 0) {
      run_as<int (*)(int), int>(&twice, call, arguments);
    } else {
      run_as<std::size_t (*)(std::string), std::string>(&length, call, arguments);
    }
  } catch (const fp::ProtocolError&) {}
  return 0;
}
