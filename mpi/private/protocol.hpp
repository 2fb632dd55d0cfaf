#pragma once
// The protocol between rank 0 and the ranks that run a node's workers. Each message is one
// control message (transport.hpp) starting with its Kind, codec-encoded:
//
//   rank 0 -> node
//     open       [pool][PoolSettings]            make the node's local pool for `pool`
//     job        [pool][job][task payload]       run it; its table's blocks follow as data
//     cancel     [pool][job]
//     close      [pool]                          close the local pool, reply joined when reaped
//     terminate  [pool]                          stop the local pool at once
//     shutdown                                   leave the serve loop (rank 0 is finalizing)
//   node -> rank 0
//     opened     [pool][processes][error]        error empty, or why the pool could not start
//     done       [pool][job][first][end][results][block sizes]   then the blocks as data
//     failed     [pool][job][ErrorRecord]
//     joined     [pool]
//
// A task payload is the one-machine task message (worker/internal/protocol.hpp) with rank 0's
// code addresses: the node translates them through rank 0's object table, sent once at init.

#include <cstdint>
#include <exception>
#include <string>
#include <tuple>

#include <forkpool/ipc/codec.hpp>

namespace forkpool::mpi::detail {

enum class Kind : std::uint8_t {
  open = 1,
  job,
  cancel,
  close,
  terminate,
  shutdown,
  opened,
  done,
  failed,
  joined,
};

// The PoolOptions a node's pool is made with: processes, maxtasksperchild, max_retries,
// task_timeout in ns, seed, the initializer's address in rank 0 (0: none).
using PoolSettings = std::tuple<std::int32_t, std::int32_t, std::int32_t, std::int64_t, std::uint64_t, std::uint64_t>;

// An exception as it crosses: forkpool's own types keep their type and fields.
struct ErrorRecord {
  std::uint8_t type = 0;
  std::string type_name;  // RemoteError, InitializerError: the worker's exception type
  std::string message;
  std::int64_t pid = 0;
  std::int32_t exit_code = 0;
  std::int32_t signal = 0;
};
ErrorRecord record_error(const std::exception_ptr& error);
std::exception_ptr rebuild_error(const ErrorRecord& record);
void write_error(Writer& w, const ErrorRecord& record);
ErrorRecord read_error(Reader& r);

}  // namespace forkpool::mpi::detail

template <>
struct forkpool::enum_bounds<forkpool::mpi::detail::Kind> {
  static constexpr auto min = forkpool::mpi::detail::Kind::open;
  static constexpr auto max = forkpool::mpi::detail::Kind::joined;
};
