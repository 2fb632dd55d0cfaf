#include <forkpool/pool/private/scheduler.hpp>

#include <algorithm>

#include <forkpool/pool/private/pool_worker.hpp>

namespace forkpool::detail {

// A worker is sent no more once its jobs hold half the claim words (PoolWorker::has_claim_words_left):
// a full window alone never comes to that.
static_assert(kDeepJobsPerWorker < RunningSlot::kClaims / 2 && kDeepLongJobsPerWorker < RunningSlot::kClaims / 2);

void Scheduler::worker_started(const PoolWorker& worker) {
  auto id = static_cast<std::size_t>(worker.index());
  if (id >= schedules_.size()) schedules_.resize(id + 1);
  schedules_[id] = Schedule{};
}

bool Scheduler::release(Workers workers) noexcept {
  if (--holds_ > 0) return false;
  for (const auto& w : workers) close_drain(schedule(*w));  // the drain is over
  held_time_.reset();
  return true;
}

void Scheduler::close_drain(Schedule& schedule) noexcept {
  if (schedule.finished_in_drain == 0) return;
  schedule.drained_long = schedule.drain_time - schedule.drain_mark >= kShortJob * schedule.finished_in_drain;
  schedule.drain_mark = schedule.drain_time;
  schedule.finished_in_drain = 0;
}

std::size_t Scheduler::jobs_wanted(Workers workers, int processes) const noexcept {
  std::size_t wanted = 0;
  for (const auto& w : workers) wanted += schedule(*w).window;
  return std::max(wanted, kJobsPerWorker * static_cast<std::size_t>(processes));
}

bool Scheduler::has_room_for_a_batch(Workers workers, bool driving) const noexcept {
  return std::any_of(workers.begin(), workers.end(), [&](const auto& w) {
    return may_take(*w) && w->in_flight().size() + kMaxJobsPerWorker <= window_of(*w, driving);
  });
}

PoolWorker* Scheduler::pick(Workers workers, const Job& job, bool driving) {
  decision_time_.reset();
  PoolWorker* best = nullptr;
  std::optional<bool> best_stuck;  // worked out once two workers are compared
  for (const auto& w : workers) {
    if (!may_take(*w)) continue;
    // A pinned job's stream bounds what it sends (its prefetch), not the worker's window.
    if (job.pinned_worker >= 0) {
      if (w->index() == job.pinned_worker) return w.get();
      continue;
    }
    if (w->in_flight().size() >= window_of(*w, driving) || !w->has_claim_words_left()) continue;
    if (!best) {
      best = w.get();
      continue;
    }
    if (!best_stuck) best_stuck = runs_stuck_job(*best);
    // Least busy, but a worker stuck in a job last: what it is sent waits behind that job.
    bool stuck = runs_stuck_job(*w);
    if (stuck < *best_stuck || (stuck == *best_stuck && w->in_flight().size() < best->in_flight().size())) {
      best = w.get();
      best_stuck = stuck;
    }
  }
  return best;
}

void Scheduler::sent(const PoolWorker& worker, bool was_idle) {
  if (!was_idle) return;
  // It starts this one at once. (Its deadline needs the true time, where now() may be a drain's
  // old one. Not the coarse clock: it lags by more than its tick, 6 ms seen here, and a job sent
  // a moment ago would look stuck, and be moved back and forth.)
  Schedule& s = schedule(worker);
  Clock::time_point time = now();
  close_drain(s);        // what it finished before, on its own
  s.window_mark = time;  // time idle says nothing of its jobs' length
  s.drain_mark = time;
  s.finished_since_mark = 0;
  s.running_since = true_time(time);
}

void Scheduler::finished(const PoolWorker& worker, bool takes_up_next) {
  Schedule& s = schedule(worker);
  s.has_served = true;
  Clock::time_point time = now();
  if (time != s.drain_time) {  // the first result of a new drain: the last one is over
    close_drain(s);
    s.drain_time = time;
  }
  ++s.finished_in_drain;
  if (holds_ == 0) close_drain(s);  // read on its own: a drain of one
  // Jobs are judged on average since the mark, not one by one: results read in one drain of the
  // ring all finish "now", and all but the first would look as if they took no time.
  ++s.finished_since_mark;
  bool long_jobs = time - s.window_mark >= kShortJob * s.finished_since_mark;
  if (long_jobs || s.finished_since_mark >= s.window) {
    s.window = long_jobs ? kJobsPerWorker : std::min(2 * s.window, kMaxJobsPerWorker);
    s.window_mark = time;
    s.finished_since_mark = 0;
  }
  if (takes_up_next) s.running_since = true_time(time);
}

// A worker left with one job or none, while another has two or more it has not taken up behind
// the one it runs (a long job holding up short ones, or a deep send from plain code): half the
// difference moves, as much as the idle one may take, newest first.
Scheduler::Move Scheduler::move_for_idle(Workers workers, bool driving) {
  Move move;
  long_running_.clear();
  decision_time_.reset();
  if (!jobs_may_move_ || workers.size() < 2) return move;
  PoolWorker* idle = nullptr;
  PoolWorker* busiest = nullptr;
  std::optional<Clock::time_point> turns_stuck;  // of the first job that may turn out stuck
  for (const auto& w : workers) {
    std::size_t held = w->in_flight().size();
    // (One that may not be sent more, for want of claim words, would hand them back at once.)
    if (may_take(*w) && held < kJobsPerWorker && w->has_claim_words_left() &&
        (!idle || held < idle->in_flight().size()))
      idle = w.get();
    const Schedule& s = schedule(*w);
    bool long_running = runs_long(*w);
    if (long_running) long_running_.push_back(w.get());
    bool stuck = long_running && s.has_served;  // runs_stuck_job
    // Short jobs (a window grown past two) drain fast where they are: moving them would cost more
    // than it saves, unless a worker holds more than its window (a deep send from plain code),
    // or the job it runs turned out long (stuck).
    bool worth_moving = jobs_are_long(s) || held > s.window || stuck;
    // Jobs wait at a worker whose job may yet turn out stuck (a stopped worker's last job too,
    // with no other reply coming to make us look): look again when it would be.
    if (!long_running && held > 0) {
      Clock::time_point when = s.running_since + kStuckJob;
      turns_stuck = turns_stuck ? std::min(*turns_stuck, when) : when;
    }
    if (worth_moving && !w->exited() && !w->stopped_job() && (!busiest || held > busiest->in_flight().size()))
      busiest = w.get();
  }
  move.long_running = long_running_;
  if (idle && busiest && idle != busiest) {
    std::size_t gap = busiest->in_flight().size() - idle->in_flight().size();
    // Behind a stuck job, even its one job in flight moves, if the worker has not taken it up (a
    // stopped worker): it would wait there, however long that one runs.
    if (gap >= (runs_stuck_job(*busiest) ? 1 : 2)) {
      move.from = busiest;
      move.jobs = std::min(std::max<std::size_t>(gap / 2, 1), window_of(*idle, driving) - idle->in_flight().size());
      return move;
    }
  }
  // Nothing moves now, but a job may turn out stuck (also the one job the busiest holds more than
  // the idle one): look again then.
  if (idle) move.look_again_at = turns_stuck;
  return move;
}

}  // namespace forkpool::detail
