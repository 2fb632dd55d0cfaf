#pragma once
// Point-to-point MPI messages between ranks, for the loop's thread only (MPI_THREAD_FUNNELED).
//
// A message is one control message (a codec-encoded payload, tag kControlTag) followed by the
// bytes of the blocks it names, each on kDataTag in pieces under 1 GiB (MPI counts are ints).
// MPI keeps messages between two ranks on one tag in order, so the receiver of a control message
// takes its blocks next from the same source.
//
// Nothing here blocks while waiting for a peer: sends are started and completed by progress(),
// and try_receive() only probes. A received message's blocks are taken at once with
// receive_blocks(): the sender sent them right after the control message.

#include <mpi.h>

#include <cstddef>
#include <deque>
#include <memory>
#include <optional>
#include <vector>

#include <forkpool/ipc/codec.hpp>
#include <forkpool/shm/internal/storage.hpp>

namespace forkpool::mpi::detail {

inline constexpr int kControlTag = 7301;
inline constexpr int kDataTag = 7302;

struct Received {
  int source = 0;
  forkpool::ByteBuffer payload;
};

class Transport {
 public:
  Transport() = default;
  Transport(const Transport&) = delete;
  Transport& operator=(const Transport&) = delete;

  // Starts sending `payload` to rank `destination`, then the bytes of each of `blocks`. Each is
  // kept alive until MPI is done with it.
  void send(int destination, forkpool::ByteBuffer payload,
            const std::vector<std::shared_ptr<forkpool::detail::Storage>>& blocks = {});
  // Completes the sends MPI has finished; true when any did.
  bool progress();
  bool sending() const noexcept { return !in_flight_.empty(); }
  // Waits (spinning in MPI) until every send is done: for shutdown only.
  void flush();

  // The next control message that has arrived, if one has.
  std::optional<Received> try_receive();
  // Receives, from `source`, the bytes of the blocks its last control message named into
  // `blocks` (already sized as that message said).
  void receive_blocks(int source, const std::vector<std::shared_ptr<forkpool::detail::Storage>>& blocks);

 private:
  struct InFlight {
    MPI_Request request;
    forkpool::ByteBuffer payload;                      // a control message's bytes
    std::shared_ptr<forkpool::detail::Storage> block;  // or a block's
  };
  std::deque<InFlight> in_flight_;
};

}  // namespace forkpool::mpi::detail
