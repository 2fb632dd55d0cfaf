#pragma once
// PoolCore: the untyped heart of a Pool. It owns the workers and a queue of jobs, hands each
// finished chunk to the JobSink that asked for it, notices a worker's death at once, fails or
// retries that worker's jobs and replaces it. Pool (pool.hpp) is its typed front.

#include <sys/types.h>

#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include <forkpool/pool/internal/job.hpp>
#include <forkpool/pool/pool_options.hpp>
#include <forkpool/runtime/async_result.hpp>
#include <forkpool/runtime/task.hpp>

namespace forkpool::detail {

class PoolCore : public Canceller {
 public:
  // Starts the workers (and, for forkserver, the fork server). Nothing is left behind if it throws.
  // `process_name` non-empty: the workers are Processes (WorkerSpec::process_name).
  // `jobs_die_with_worker` (spawn's ranks; always for Processes): a job whose worker dies fails
  // with WorkerLost, even one the worker had not taken up, and never runs again.
  static std::shared_ptr<PoolCore> create(PoolOptions options, std::string process_name = {},
                                          bool jobs_die_with_worker = false);
  virtual ~PoolCore() = default;

  // Queues a job. Throws PoolClosed after close() or terminate().
  virtual void submit(std::shared_ptr<Job> job) = 0;
  // A stream made before close() goes on feeding its input after it (as Python's imap does):
  // opened when it is made (PoolClosed after close() or terminate(), as submit), closed when
  // its input ends or it is dropped; workers are not retired while one is open. Its later jobs
  // go through submit_for_stream(), which throws PoolTerminated after terminate().
  virtual void stream_opened() = 0;
  virtual void stream_closed() = 0;
  virtual void submit_for_stream(std::shared_ptr<Job> job) = 0;
  // Stops the work of `sink` (whose result is already failed): its running jobs' workers are
  // killed and replaced, the other work they had runs elsewhere at no cost; queued jobs drop.
  virtual void cancel(const JobSink* sink) = 0;
  // Jobs sent between hold_sends() and the matching release_sends() leave together at the
  // release: one publication per worker and at most one wake-up for a batch. Calls nest. (A
  // stream submitting its window; the replies of one drain of a worker's ring.)
  virtual void hold_sends() {}
  virtual void release_sends() {}
  virtual void close() = 0;
  virtual void terminate() = 0;
  virtual Task<void> join() = 0;  // std::logic_error unless close() or terminate() came first
  virtual bool terminated() const noexcept = 0;
  virtual int processes() const noexcept = 0;
  // How many jobs the workers take at once now: two each, more while their jobs are short (a
  // stream keeps this many chunks running unless told otherwise).
  virtual std::size_t jobs_wanted() const noexcept { return 2 * static_cast<std::size_t>(processes()); }
  virtual std::vector<pid_t> worker_pids() const = 0;
  // How often the live workers polled their rings while spinning (tests: spin = 0 never does).
  virtual std::uint64_t worker_spin_polls() const { return 0; }
  // A descriptor of its own for the live worker `pid`'s pidfd (invalid when there is none).
  virtual UniqueFd worker_pidfd(pid_t) const { return {}; }
  // For ~Pool: terminate(), and have the workers reaped before the loop's run() returns (now,
  // when the loop is not being driven). On another thread than the pool's: posted to the pool's
  // thread, not waited for.
  virtual void shut_down() = 0;

  // A Pool belongs to the thread (and process) that made it: std::logic_error naming the rule
  // and `who` otherwise.
  void check_owner(const char* who) const;
  // Canceller: an AsyncResult's cancel() (work is its JobSink).
  void check_cancel() const final { check_owner("AsyncResult::cancel"); }
  void cancel_work(const void* work) final { cancel(static_cast<const JobSink*>(work)); }
  // False in a forked child of the process that made the pool.
  bool in_owner_process() const noexcept;
  // Whether the calling thread is the one that made the pool.
  bool on_owner_thread() const noexcept;

 protected:
  PoolCore();

 private:
  std::thread::id owner_thread_;
  pid_t owner_pid_;
};

// For a shut_down() on another thread than the pool's: runs `shutdown` on the thread that made
// `local` (a core PoolCore::create made) at its loop's next turn, not waited for; dropped if that
// thread's loop has ended (its workers ended with it). Any thread. mpi::Pool's core hands its
// whole shutdown over with it: the nodes are told on the pool's thread (MPI_THREAD_FUNNELED).
void post_shut_down_to_owner(PoolCore& local, std::function<void()> shutdown) noexcept;

}  // namespace forkpool::detail
