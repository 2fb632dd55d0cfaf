#pragma once
// A job: one encoded chunk of calls on its way to a worker, and who waits for its results.

#include <cstddef>
#include <exception>
#include <memory>

#include <forkpool/ipc/codec.hpp>
#include <forkpool/pool/internal/message_loan.hpp>

namespace forkpool::detail {

// Who waits for the chunks of one call (a map, an apply_async, a stream). Called on the pool's
// thread, inside the loop's turn that received the reply.
class JobSink : public std::enable_shared_from_this<JobSink> {
 public:
  virtual ~JobSink() = default;
  // Decodes chunk `chunk`'s results. May throw ProtocolError: the chunk then fails with it.
  virtual void chunk_done(std::size_t chunk, Reader& results) = 0;
  virtual void chunk_failed(std::size_t chunk, std::exception_ptr error) = 0;
};

struct Job {
  std::shared_ptr<JobSink> sink;
  std::size_t chunk = 0;
  ByteBuffer payload;        // a task message (task_message.hpp)
  MessageLoan loan;          // storages the arguments lend: held until the result is decoded
  Attachments attachments;   // descriptors the arguments carry otherwise
  int attempts = 0;          // runs lost with a dying worker so far
};

}  // namespace forkpool::detail
