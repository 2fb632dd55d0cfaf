#pragma once
// PoolCore: the untyped heart of a Pool. It owns the workers, a queue of jobs (encoded chunks of
// calls) and hands each finished chunk to the JobSink that asked for it. It keeps at least one
// job queued at every worker beyond the one it runs, notices a death at once (pidfd on the
// loop), fails or retries that worker's jobs, and replaces it.

#include <sys/types.h>

#include <cstdint>
#include <deque>
#include <exception>
#include <map>
#include <memory>
#include <vector>

#include "ipc/channel.hpp"
#include "ipc/codec.hpp"
#include "runtime/event.hpp"
#include "runtime/launcher.hpp"
#include "runtime/pool_options.hpp"
#include "runtime/task.hpp"
#include "shm/storage_loans.hpp"

namespace forkpool::detail {

// Who waits for the chunks of one call (a map, an apply_async, a stream).
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
  ByteBuffer payload;        // task header + encoded arguments + lent storage ids
  MessageLoan loan;          // storages the arguments lend: held until the result is decoded
  Attachments attachments;   // descriptors the arguments carry otherwise
  int attempts = 0;
};

class PoolCore : public std::enable_shared_from_this<PoolCore> {
 public:
  static std::shared_ptr<PoolCore> create(PoolOptions options);
  ~PoolCore();

  // Queues a job. Throws PoolClosed after close() or terminate().
  void submit(std::shared_ptr<Job> job);

  void close();
  void terminate();
  Task<void> join();  // std::logic_error unless close() or terminate() came first

  int processes() const noexcept { return processes_; }
  std::vector<pid_t> worker_pids() const;

 private:
  struct Worker;
  explicit PoolCore(PoolOptions options);
  void start_workers();
  void spawn_worker();
  void replenish();
  void dispatch();
  std::shared_ptr<Worker> pick_worker();
  void retire_if_idle(Worker& worker);
  void on_worker_gone(const std::shared_ptr<Worker>& worker);
  void fail_queue(const std::exception_ptr& error);
  void handle_reply(Worker& worker, Message& message);
  Task<void> serve(std::shared_ptr<Worker> worker);
  Task<void> watch(std::shared_ptr<Worker> worker);
  Task<void> send_outbox(std::shared_ptr<Worker> worker);
  Task<void> send(std::shared_ptr<Worker> worker, std::shared_ptr<Job> job, std::uint64_t id);

  PoolOptions options_;
  int processes_;
  std::unique_ptr<Launcher> launcher_;
  std::vector<std::shared_ptr<Worker>> workers_;
  std::deque<std::shared_ptr<Job>> queue_;
  std::uint64_t next_request_id_ = 0;
  int next_worker_index_ = 0;
  bool closed_ = false;
  bool terminated_ = false;
  Event all_exited_;
};

}  // namespace forkpool::detail
