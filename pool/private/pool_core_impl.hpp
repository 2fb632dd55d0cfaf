#pragma once
// PoolCoreImpl: the pool core behind every Pool, Process and rank (internal/pool_core.hpp says
// what it promises). It owns the workers and the queue: starts and replaces workers, sends
// queued jobs where the Scheduler says, judges the jobs of a worker that died (job_fate.hpp),
// stops jobs (cancel, task_timeout), and closes, terminates and joins. Only pool_core.cpp and
// tests include this.
//
// Everything here runs on the pool's thread, except shut_down(), which posts itself there.

#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <stop_token>
#include <string>
#include <vector>

#include <forkpool/pool/internal/pool_core.hpp>
#include <forkpool/worker/private/launcher.hpp>
#include <forkpool/pool/private/pool_worker.hpp>
#include <forkpool/pool/private/scheduler.hpp>
#include <forkpool/runtime/internal/one_shot.hpp>
#include <forkpool/runtime/private/loop_internals.hpp>
#include <forkpool/runtime/scope.hpp>

namespace forkpool::detail {

class PoolCoreImpl final : public PoolCore,
                           public WorkerEvents,
                           public LeaveListener,
                           public std::enable_shared_from_this<PoolCoreImpl> {
 public:
  PoolCoreImpl(PoolOptions options, std::string process_name, bool jobs_die_with_worker);
  void start_workers();

  void submit(std::shared_ptr<Job> job) override;
  void stream_opened() override {
    if (closed_) throw PoolClosed();
    ++open_streams_;
  }
  void stream_closed() override;
  void submit_for_stream(std::shared_ptr<Job> job) override;
  void cancel(const JobSink* sink) override;
  void close() override;
  void terminate() override;
  Task<void> join() override;
  int processes() const noexcept override { return processes_; }
  std::size_t jobs_wanted() const noexcept override;
  bool terminated() const noexcept override { return terminated_; }
  std::vector<pid_t> worker_pids() const override;
  UniqueFd worker_pidfd(pid_t pid) const override;
  std::uint64_t worker_spin_polls() const override;
  void shut_down() override;

  void job_finished(PoolWorker& worker, bool served) override;
  void hold_sends() override { scheduler_.hold(); }
  void release_sends() override {
    if (scheduler_.release(workers_)) flush_workers();
  }
  void worker_gone(const std::shared_ptr<PoolWorker>& worker) override;
  void loop_left() noexcept override;
  void loop_ending() noexcept override;

 private:
  void launch_workers(int count);
  int free_worker_id(const std::vector<int>& starting);
  void replenish();
  // Sends queued jobs to workers with room, and publishes them unless sends are held.
  void dispatch();
  void send_queued();
  // When the queue is empty and a worker is about to run dry while another holds jobs it has not
  // taken up: moves the other's newest to the queue, for the one running dry. False: none moved.
  bool take_back_for_idle();
  // Takes back what workers were sent and have not taken up for work nobody wants any more (a
  // map that failed), newest first: it is dropped as queued jobs are.
  void take_back_abandoned();
  // Whether jobs may move between this pool's workers: not when a worker's jobs are its own (a
  // Process's, a rank's) or counted to retire it (maxtasksperchild).
  bool jobs_may_move() const noexcept { return !jobs_die_with_worker_ && options_.maxtasksperchild == 0; }
  // take_back_for_idle() runs again at `when` (a running job turns stuck then), unless sooner.
  void look_again_at(Clock::time_point when);
  Task<void> look_again_later();
  std::optional<Clock::time_point> look_again_at_;  // set while look_again_later() waits
  void prefetch_ahead() const noexcept;
  void flush_workers() noexcept;
  void retire_if_idle(PoolWorker& worker);
  void fail_queue(const std::exception_ptr& error);
  Task<void> enforce_task_timeout();

  Loop& loop_ = Loop::current();  // its thread's: a pool belongs to the thread that made it
  // Whether loop_ has ended (its thread exited): then nothing may be posted to it. Guarded by
  // loop_mutex_, which a shut_down on another thread takes too.
  std::mutex loop_mutex_;
  bool loop_ended_ = false;
  // Runs `shutdown` at the next turn of loop_, unless loop_ has ended (post_shut_down_to_owner).
  void post_to_own_loop(std::function<void()> shutdown) noexcept;
  friend void post_shut_down_to_owner(PoolCore& local, std::function<void()> shutdown) noexcept;
  // run() and ~Loop wait for the workers' reaping before they return.
  void finish_reaping_before_return();
  PoolOptions options_;
  std::string process_name_;   // non-empty: the workers are Processes
  bool jobs_die_with_worker_;  // PoolCore::create
  int processes_;
  Scheduler scheduler_;
  bool driving() const noexcept { return LoopInternals::driving(loop_); }
  std::unique_ptr<Launcher> launcher_;
  std::vector<std::shared_ptr<PoolWorker>> workers_;
  std::deque<std::shared_ptr<Job>> queue_;
  std::uint64_t next_request_id_ = 0;
  std::vector<std::uint64_t> generations_;  // by worker id: how many workers have held it
  std::uint64_t seed_base_ = 0;
  bool closed_ = false;
  bool terminated_ = false;
  int open_streams_ = 0;          // streams that may still submit, also after close()
  int initializer_failures_ = 0;  // consecutive workers whose initializer threw
  std::exception_ptr broken_;     // why no worker can be started any more (the initializer)
  OneShot all_exited_;
  std::stop_source stop_timers_;  // ends enforce_task_timeout() on terminate()
  CodeObjects code_objects_;      // where the task functions live, for the workers to load
  Scope background_;              // each worker's conversation, and the task_timeout timer
};

}  // namespace forkpool::detail
