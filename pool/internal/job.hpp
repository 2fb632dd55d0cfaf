#pragma once
// A job: one encoded chunk of calls on its way to a worker, and who waits for its results.

#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>

#include <forkpool/ipc/codec.hpp>
#include <forkpool/ipc/internal/spare_buffers.hpp>
#include <forkpool/shm/internal/block_table.hpp>
#include <forkpool/worker/internal/protocol.hpp>

namespace forkpool::detail {

// Who waits for the chunks of one call (a map, an apply_async, a stream). Called on the pool's
// thread, inside the loop's turn that received the reply.
class JobSink {
 public:
  virtual ~JobSink() = default;
  // Decodes the results of elements `range` of chunk `chunk` (the whole chunk, unless a worker
  // died running it: then its parts arrive separately). May throw ProtocolError: the chunk then
  // fails with it.
  virtual void chunk_done(std::size_t chunk, const ElementRange& range, Reader& results) = 0;
  virtual void chunk_failed(std::size_t chunk, std::exception_ptr error) = 0;
  // True once nothing more is wanted (a map that failed): its jobs not yet sent are dropped.
  virtual bool abandoned() const { return false; }
};

// A job's encoded task message. Held inside the job when small (most tasks of a few plain
// arguments): a hundred thousand tasks queued then hold no hundred thousand buffers, and the
// buffer each was encoded into goes straight back to the spares for the next one.
using JobPayload = InlineBytes<128>;

struct Job {
  std::shared_ptr<JobSink> sink;
  std::size_t chunk = 0;
  JobPayload payload;       // a task message (worker/internal/protocol.hpp)
  OutgoingBlocks blocks;    // the arguments' tensors: held until the result is decoded
  Attachments attachments;  // descriptors the arguments carry otherwise
  ElementRange range;       // the elements of the chunk this job runs
  // >= 0: only the worker of this id runs it, and it is lost with that worker, never run again
  // (a DataLoader's iterable shard: the worker holds the shard's iterator).
  int pinned_worker = -1;
  int attempts = 0;       // runs lost with a dying worker so far
  int free_requeues = 0;  // times its worker died before (by the worker's word) taking it up
  // A part of a chunk sent again after its worker died (job_part()): the job it came from,
  // whose blocks and attachments it uses.
  std::shared_ptr<Job> whole;

  Job& root() noexcept { return whole ? *whole : *this; }
};

}  // namespace forkpool::detail
