#pragma once
// Rank 0's end of the conversation with the nodes: gives each mpi::Pool an id, sends for them,
// and while any of them awaits a node (or a send is unfinished) polls MPI from the loop and hands
// each reply to the pool it names. Used on init()'s thread only.

#include <cstdint>
#include <memory>
#include <unordered_map>
#include <vector>

#include <forkpool/ipc/codec.hpp>
#include <forkpool/mpi/private/protocol.hpp>
#include <forkpool/runtime/scope.hpp>
#include <forkpool/shm/internal/storage.hpp>

namespace forkpool::mpi::detail {

class MpiPoolCore;

class Hub {
 public:
  static Hub& instance();

  std::uint64_t add(MpiPoolCore* pool);
  void remove(std::uint64_t pool);
  // Sends to `rank` and makes sure replies are polled for.
  void send(int rank, ByteBuffer payload, const std::vector<std::shared_ptr<forkpool::detail::Storage>>& blocks = {});
  // A pool now awaits a node: starts polling if it was not.
  void wake();

 private:
  Hub() = default;
  bool busy() const;
  bool step();
  void route(int source, Reader& r);

  std::unordered_map<std::uint64_t, MpiPoolCore*> pools_;
  std::uint64_t next_id_ = 1;
  bool polling_ = false;
  Scope scope_;
};

// A block of shared memory of `bytes` for data arriving from another node (a slab block, whatever
// the sharing strategy: it crosses on to workers by its slab). ProtocolError for 0 or over 1 TiB.
std::shared_ptr<forkpool::detail::Storage> new_block(std::uint64_t bytes);

// Reads the block sizes of a done message and receives the blocks from `source` into new shared
// memory. Called for every done message, wanted or not: its blocks must be taken off the wire.
std::vector<std::shared_ptr<forkpool::detail::Storage>> receive_result_blocks(Reader& r, int source);

}  // namespace forkpool::mpi::detail
