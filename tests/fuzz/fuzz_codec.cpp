// libFuzzer target: every built-in codec decoding arbitrary bytes (queues and sync objects with
// real descriptors of every kind attached). The first byte picks the
// type; the rest is the message. Decoding must succeed or throw ProtocolError, never crash,
// never allocate more than the input could describe.

#include <fcntl.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <unordered_map>
#include <variant>
#include <vector>

#include <forkpool/ipc/codec.hpp>
#include <forkpool/ipc/private/memfd.hpp>
#include <forkpool/pool/internal/index_batch.hpp>
#include <forkpool/shm/private/peer_memory.hpp>
#include <forkpool/sync/pipe.hpp>
#include <forkpool/sync/queue.hpp>
#include <forkpool/sync/semaphore.hpp>
#include <forkpool/sync/shared_value.hpp>
#include <forkpool/sync/sync.hpp>
#include <forkpool/shm/named_memory.hpp>
#include <forkpool/shm/tensor_codec.hpp>

namespace fp = forkpool;

namespace {

template <class T>
void try_decode(std::span<const std::byte> bytes) {
  try {
    T value = fp::decode<T>(bytes);
    fp::Writer again = fp::encode(value);  // what decodes must encode
    (void)again;
  } catch (const fp::ProtocolError&) {}
}

// A parent that maps one slab of a worker (made here by a second PeerMemory standing for the
// worker), and a message from that worker: its table of blocks and a tensor naming one of them.
struct Conversation {
  std::shared_ptr<fp::detail::PeerMemory> worker = std::make_shared<fp::detail::PeerMemory>();
  std::shared_ptr<fp::detail::PeerMemory> parent = std::make_shared<fp::detail::PeerMemory>();
  fp::Tensor batch = fp::Tensor::empty({64}, fp::DType::f32);
  Conversation() {
    fp::detail::OutgoingBlocks blocks;
    blocks.block_index(batch.storage());
    auto introduction = worker->lend(blocks);
    std::vector<fp::UniqueFd> fds;
    fds.emplace_back(dup(introduction->fds.at(0)));
    parent->accept_introduction(introduction->payload.bytes(), fds);
  }
};

void try_decode_reply(std::span<const std::byte> bytes) {
  static Conversation* conversation = new Conversation();
  try {
    fp::detail::TabledPayload payload = fp::detail::split_block_table(bytes);
    fp::detail::IncomingBlocks blocks = conversation->parent->accept_blocks(payload.table);
    fp::Reader reader(payload.body, {}, &blocks);
    fp::Tensor tensor = reader.read<fp::Tensor>();
    reader.expect_end();
    // Every byte the view reaches is inside the mapping: touch the last one.
    auto extent = fp::detail::view_extent(tensor.shape(), tensor.strides(), fp::element_size(tensor.dtype()));
    if (tensor.storage() && extent && *extent > 0)
      (void)static_cast<volatile std::byte*>(tensor.raw_data())[*extent - 1];
  } catch (const fp::ProtocolError&) {}
  conversation->parent->take_release();  // what was let go would go back to the worker
}

// Releases and introductions (without descriptors) from a peer that was lent nothing.
void try_peer_message(std::span<const std::byte> bytes, bool release) {
  auto memory = std::make_shared<fp::detail::PeerMemory>();
  try {
    if (release)
      memory->accept_release(bytes);
    else
      memory->accept_introduction(bytes, {});
  } catch (const fp::ProtocolError&) {}
}

// Queues, pipes, events, locks, semaphores, conditions, barriers and shared values received with
// a descriptor of every kind attached (a sealed
// page, an unsealed memfd, a socket, a pipe, an eventfd): the wrong kind is a ProtocolError.
struct Descriptors {
  std::vector<int> fds;
  Descriptors() {
    fds.push_back(fp::create_memfd("fuzz-page", 4096).release());
    fp::seal_size(fds.back());
    fds.push_back(fp::create_memfd("fuzz-unsealed", 4096).release());
    int pair[2];
    socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, pair);
    fds.insert(fds.end(), {pair[0], pair[1]});
    pipe2(pair, O_CLOEXEC);
    fds.insert(fds.end(), {pair[0], pair[1]});
    fds.push_back(eventfd(0, EFD_CLOEXEC));
  }
};

template <class T>
void try_decode_with_descriptors(std::span<const std::byte> bytes) {
  static Descriptors* attached = new Descriptors();
  std::vector<fp::UniqueFd> fds;
  for (int fd : attached->fds) fds.emplace_back(fcntl(fd, F_DUPFD_CLOEXEC, 0));
  try {
    fp::Reader reader(bytes, fds);
    T value = reader.read<T>();
    reader.expect_end();
  } catch (const fp::ProtocolError&) {}
}

// A queue item (its table of lent blocks, their slabs' and owner's descriptors) with descriptors
// of every kind attached.
void try_queue_item(std::span<const std::byte> bytes) {
  static Descriptors* attached = new Descriptors();
  fp::detail::Message message;
  message.payload = fp::detail::Payload(std::vector<std::byte>(bytes.begin(), bytes.end()));
  for (int fd : attached->fds) message.fds.emplace_back(fcntl(fd, F_DUPFD_CLOEXEC, 0));
  try {
    fp::detail::decode_queue_item(message, [](fp::Reader& in) {
      fp::Tensor t = in.read<fp::Tensor>();
      in.expect_end();
    });
  } catch (const fp::ProtocolError&) {
  } catch (const std::invalid_argument&) {}
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  auto bytes = std::as_bytes(std::span(data + 1, size - 1));
  switch (data[0] % 32) {
    case 0: try_decode<int>(bytes); break;
    case 1: try_decode<bool>(bytes); break;
    case 2: try_decode<std::string>(bytes); break;
    case 3: try_decode<std::vector<double>>(bytes); break;
    case 4: try_decode<std::vector<std::string>>(bytes); break;
    case 5: try_decode<std::array<std::int16_t, 3>>(bytes); break;
    case 6: try_decode<std::pair<int, std::string>>(bytes); break;
    case 7: try_decode<std::tuple<std::uint8_t, std::optional<std::string>, double>>(bytes); break;
    case 8: try_decode<std::variant<int, std::string, std::vector<int>>>(bytes); break;
    case 9: try_decode<std::map<std::string, std::vector<int>>>(bytes); break;
    case 10: try_decode<std::unordered_map<int, std::optional<int>>>(bytes); break;
    case 11: try_decode<fp::DType>(bytes); break;
    case 12: try_decode<std::vector<std::vector<std::pair<int, bool>>>>(bytes); break;
    case 13: try { fp::decode<fp::Tensor>(bytes);  // no descriptors attached: every memfd reference fails cleanly
      } catch (const fp::ProtocolError&) {
      } catch (const std::invalid_argument&) {}
      break;
    case 14: try_decode_reply(bytes); break;
    case 15: try_peer_message(bytes, true); break;
    case 16: try_peer_message(bytes, false); break;
    case 17: try_decode_with_descriptors<fp::Queue<int>>(bytes); break;
    case 18: try_decode_with_descriptors<fp::Event>(bytes); break;
    case 19: try_decode_with_descriptors<fp::Lock>(bytes); break;
    case 20: try_decode_with_descriptors<fp::Barrier>(bytes); break;
    case 21: try_queue_item(bytes); break;
    case 22: try_decode_with_descriptors<fp::RLock>(bytes); break;
    case 23: try_decode_with_descriptors<fp::Semaphore>(bytes); break;
    case 24: try_decode_with_descriptors<fp::BoundedSemaphore>(bytes); break;
    case 25: try_decode_with_descriptors<fp::Condition>(bytes); break;
    case 26: try_decode_with_descriptors<fp::JoinableQueue<int>>(bytes); break;
    case 27: try_decode_with_descriptors<fp::Connection<int>>(bytes); break;
    case 28: try_decode_with_descriptors<fp::Value<double>>(bytes); break;
    case 29: try_decode_with_descriptors<fp::Array<std::int32_t>>(bytes); break;
    case 30: try_decode_with_descriptors<fp::SharedMemory>(bytes); break;
    case 31: try_decode<fp::detail::IndexBatch>(bytes); break;
  }
  return 0;
}
