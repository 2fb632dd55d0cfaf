#include <forkpool/mpi/private/transport.hpp>

#include <algorithm>
#include <climits>
#include <string>

#include <forkpool/runtime/error.hpp>

namespace forkpool::mpi::detail {
namespace {

constexpr std::size_t kPiece = std::size_t{1} << 30;  // under MPI's int count

void check(int rc, const char* what) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  MPI_Error_string(rc, text, &length);
  throw forkpool::Error(std::string("forkpool::mpi: ") + what + ": " +
                        std::string(text, static_cast<std::size_t>(length)));
}

}  // namespace

void Transport::send(int destination, forkpool::ByteBuffer payload,
                     const std::vector<std::shared_ptr<forkpool::detail::Storage>>& blocks) {
  if (payload.size() > static_cast<std::size_t>(INT_MAX))
    throw forkpool::Error(
        "forkpool::mpi: a control message over 2 GiB (its tensors cross as blocks, its other data does not)");
  auto& message = in_flight_.emplace_back(InFlight{MPI_REQUEST_NULL, std::move(payload), nullptr});
  check(MPI_Isend(message.payload.data(), static_cast<int>(message.payload.size()), MPI_BYTE, destination, kControlTag,
                  MPI_COMM_WORLD, &message.request),
        "MPI_Isend");
  for (const auto& block : blocks) {
    for (std::size_t at = 0; at < block->size(); at += kPiece) {
      auto& piece = in_flight_.emplace_back(InFlight{MPI_REQUEST_NULL, {}, block});
      int count = static_cast<int>(std::min(kPiece, block->size() - at));
      check(MPI_Isend(block->data() + at, count, MPI_BYTE, destination, kDataTag, MPI_COMM_WORLD, &piece.request),
            "MPI_Isend");
    }
  }
}

bool Transport::progress() {
  bool any = false;
  // Requests complete in any order; those done are dropped wherever they are.
  for (auto it = in_flight_.begin(); it != in_flight_.end();) {
    int done = 0;
    check(MPI_Test(&it->request, &done, MPI_STATUS_IGNORE), "MPI_Test");
    if (done) {
      it = in_flight_.erase(it);
      any = true;
    } else {
      ++it;
    }
  }
  return any;
}

void Transport::flush() {
  for (auto& message : in_flight_) check(MPI_Wait(&message.request, MPI_STATUS_IGNORE), "MPI_Wait");
  in_flight_.clear();
}

std::optional<Received> Transport::try_receive() {
  int arrived = 0;
  MPI_Status status;
  check(MPI_Iprobe(MPI_ANY_SOURCE, kControlTag, MPI_COMM_WORLD, &arrived, &status), "MPI_Iprobe");
  if (!arrived) return std::nullopt;
  int count = 0;
  check(MPI_Get_count(&status, MPI_BYTE, &count), "MPI_Get_count");
  Received message{status.MPI_SOURCE, forkpool::ByteBuffer(static_cast<std::size_t>(count))};
  check(MPI_Recv(message.payload.data(), count, MPI_BYTE, status.MPI_SOURCE, kControlTag, MPI_COMM_WORLD,
                 MPI_STATUS_IGNORE),
        "MPI_Recv");
  return message;
}

void Transport::receive_blocks(int source, const std::vector<std::shared_ptr<forkpool::detail::Storage>>& blocks) {
  for (const auto& block : blocks) {
    for (std::size_t at = 0; at < block->size(); at += kPiece) {
      int count = static_cast<int>(std::min(kPiece, block->size() - at));
      MPI_Status status;
      check(MPI_Recv(block->data() + at, count, MPI_BYTE, source, kDataTag, MPI_COMM_WORLD, &status), "MPI_Recv");
      int got = 0;
      MPI_Get_count(&status, MPI_BYTE, &got);
      if (got != count)
        throw forkpool::ProtocolError("forkpool::mpi: a block arrived with another size than announced");
    }
  }
}

}  // namespace forkpool::mpi::detail
