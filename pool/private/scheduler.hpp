#pragma once
// Scheduler: which worker each job goes to, how many jobs a worker holds at once, and which jobs
// move from a worker held up in a long one to a worker running dry. It owns each worker's
// schedule (by worker id), reads the workers and returns decisions; the pool core carries them
// out (sends, withdrawals, timers) and is never called back.
//
// The policy, in short (docs/pool.md, "Scheduling"):
// - A worker holds kJobsPerWorker jobs at once, the one it runs and the next, so that it never
//   waits for the parent. While its jobs are short (under kShortJob on average) its window
//   doubles up to kMaxJobsPerWorker, so that a burst of small tasks travels in batches; long
//   jobs bring it back.
// - Submitted from plain code (the loop not driven: the program may compute for a while), a
//   worker is given a deep window (kDeepJobsPerWorker, or kDeepLongJobsPerWorker while its jobs
//   are long), so that all of that runs meanwhile.
// - A job running kStuckJob or longer is stuck: the jobs queued behind it move to a worker that
//   runs dry, and none are sent to it while another may take them.
//
// Everything here runs on the pool's thread.

#include <chrono>
#include <cstddef>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include <forkpool/pool/internal/job.hpp>
#include <forkpool/pool/private/pool_worker.hpp>
#include <forkpool/runtime/internal/deadline.hpp>

namespace forkpool::detail {

inline constexpr std::size_t kJobsPerWorker = 2;
inline constexpr std::size_t kMaxJobsPerWorker = 16;
inline constexpr auto kShortJob = std::chrono::microseconds(50);
// The scheduler's reaction time to a stuck job: twenty short ones (issue 58.4).
inline constexpr auto kStuckJob = 20 * kShortJob;
// Judged by whole drains of replies: a round of long jobs given from plain code is read hundreds
// at once at its waits, and must not look short to the next.
inline constexpr std::size_t kDeepJobsPerWorker = 64;
inline constexpr std::size_t kDeepLongJobsPerWorker = 1024;

class Scheduler {
 public:
  using Workers = std::span<const std::shared_ptr<PoolWorker>>;

  // `jobs_may_move`: whether jobs may go from one worker to another (not when a worker's jobs
  // are its own, a Process's or a rank's, or counted to retire it: maxtasksperchild).
  explicit Scheduler(bool jobs_may_move) : jobs_may_move_(jobs_may_move) {}

  // A worker starts under its id: its schedule starts afresh (a replacement takes the id of the
  // worker it replaces).
  void worker_started(const PoolWorker& worker);

  // Replies are read (and jobs submitted) in bursts: between hold() and the matching release(),
  // the scheduler's time stands still at its first reading (one clock read per burst; a job's
  // length is judged on average over many), and what is sent leaves at the release.
  void hold() noexcept { ++holds_; }
  // True when it was the last hold: the caller publishes what was sent meanwhile.
  bool release(Workers workers) noexcept;
  bool held() const noexcept { return holds_ > 0; }

  // Jobs the pool wants in flight to keep every worker busy (what streams prefetch).
  std::size_t jobs_wanted(Workers workers, int processes) const noexcept;
  // Jobs `worker` may hold now. `driving`: the loop is driven (else plain code submits).
  std::size_t window_of(const PoolWorker& worker, bool driving) const noexcept {
    const Schedule& s = schedule(worker);
    if (jobs_may_move_ && !driving) return s.drained_long ? kDeepLongJobsPerWorker : kDeepJobsPerWorker;
    return s.window;
  }
  // The worker to send `job` to now: its pinned one, else the least busy with room, a stuck one
  // last. Null when none may take it.
  PoolWorker* pick(Workers workers, const Job& job, bool driving);
  // Whether some worker could take a batch of kMaxJobsPerWorker jobs more.
  bool has_room_for_a_batch(Workers workers, bool driving) const noexcept;

  // `worker` was sent a job; `was_idle`: it held none before.
  void sent(const PoolWorker& worker, bool was_idle);
  // `worker` answered a job; `takes_up_next`: it holds another, which it starts now.
  void finished(const PoolWorker& worker, bool takes_up_next);

  // When the oldest job of `worker` started (no earlier than that): its task_timeout counts from it.
  Clock::time_point running_since(const PoolWorker& worker) const { return schedule(worker).running_since; }
  // Whether `worker` holds work whose job has run kStuckJob or longer, also a worker that has not
  // answered yet (that may be still starting).
  bool runs_long(PoolWorker& worker) {
    return worker.has_unsettled_work() && decision_time() - schedule(worker).running_since >= kStuckJob;
  }

  // Jobs to move from one worker to the queue, for a worker running dry: the newest `jobs` of
  // `from` (half the difference, as much as the idle one may take). When none should move now
  // but jobs wait behind one that may turn out stuck, `look_again_at` says when to ask again.
  // `long_running` lists the workers whose job has run long (runs_long), valid until the next
  // call: the core checks their rings (a task that broke one may be why it runs long).
  struct Move {
    PoolWorker* from = nullptr;
    std::size_t jobs = 0;
    std::optional<Clock::time_point> look_again_at;
    std::span<PoolWorker* const> long_running;
  };
  Move move_for_idle(Workers workers, bool driving);

 private:
  struct Schedule {
    Clock::time_point running_since;  // when its oldest job in flight started (no earlier)
    // Whether it has answered a job: until then it may still be starting (forked, its
    // initializer running), and what it holds is never judged stuck.
    bool has_served = false;
    std::size_t window = kJobsPerWorker;  // jobs it may hold at once while the loop is driven
    Clock::time_point window_mark;        // since when finished jobs are counted to judge their length
    std::size_t finished_since_mark = 0;
    // Whether its jobs are long as judged by whole drains of replies, for the deep window; not
    // yet measured: long. The window's judgement, one result at a time, sees all but the first
    // of a drain as instant.
    bool drained_long = true;
    Clock::time_point drain_mark;  // the end of the last drain judged, or when it was last idle
    Clock::time_point drain_time;  // of the drain being read
    std::size_t finished_in_drain = 0;
  };
  // (The small calls of every dispatch are inline: out of line they cost a trivial stream of
  // tasks a few percent.)
  Schedule& schedule(const PoolWorker& worker) { return schedules_[static_cast<std::size_t>(worker.index())]; }
  const Schedule& schedule(const PoolWorker& worker) const {
    return schedules_[static_cast<std::size_t>(worker.index())];
  }
  // A window back at two says the worker's jobs are long (or not yet measured).
  static bool jobs_are_long(const Schedule& schedule) noexcept { return schedule.window == kJobsPerWorker; }
  // The drain of replies being read is over: its jobs took, together, from the mark to it.
  static void close_drain(Schedule& schedule) noexcept;
  bool runs_stuck_job(PoolWorker& worker) { return schedule(worker).has_served && runs_long(worker); }
  // The time as the scheduler sees it: while held, the time it was first asked for then.
  Clock::time_point now() {
    if (holds_ == 0) return Clock::now();
    if (!held_time_) held_time_ = Clock::now();
    return *held_time_;
  }
  // The true time, given what now() said: that, unless sends are held (a drain's old time).
  Clock::time_point true_time(Clock::time_point from_now) const { return holds_ == 0 ? from_now : Clock::now(); }
  bool may_take(const PoolWorker& worker) const noexcept { return worker.accepts_jobs() && !worker.ring_full(); }

  bool jobs_may_move_;
  std::vector<Schedule> schedules_;  // by worker id
  int holds_ = 0;
  std::optional<Clock::time_point> held_time_;
  // The time of one decision (pick, move_for_idle): a clock read when first needed, so that a
  // round trip, where no worker holds work, reads no clock.
  Clock::time_point decision_time() {
    if (holds_ > 0) return now();
    if (!decision_time_) decision_time_ = Clock::now();
    return *decision_time_;
  }
  std::optional<Clock::time_point> decision_time_;
  std::vector<PoolWorker*> long_running_;  // Move::long_running
};

}  // namespace forkpool::detail
