#include <forkpool/pool/private/job_fate.hpp>

#include <forkpool/pool/private/pool_worker.hpp>
#include <forkpool/runtime/error.hpp>

namespace forkpool::detail {

Death::Death(const PoolWorker& dead)
    : worker(dead), last_taken(dead.slot().request_id.load()), slot_forged(last_taken < dead.last_replied()) {
  if (!dead.in_flight().empty()) oldest_in_flight = dead.in_flight().begin()->first;
}

std::exception_ptr lost_with(const PoolWorker& worker) {
  return std::make_exception_ptr(WorkerLost(worker.pid(), worker.status().exit_code, worker.status().signal));
}

// In order of precedence.
Verdict fate_of(const Death& death, std::uint64_t id, Job& job, const FateRules& rules) {
  const PoolWorker& worker = death.worker;
  auto lost = [&] { return lost_with(worker); };
  if (rules.terminated) return {Fate::fail, std::make_exception_ptr(PoolTerminated())};
  if (rules.jobs_die_with_worker) return {Fate::fail, lost()};  // whether it took the task up or not
  if (id == worker.stopped_job() && worker.stop_reason())
    return {Fate::fail, worker.stop_reason()};  // task_timeout: not retried
  if (job.sink->abandoned()) return {Fate::drop, nullptr};
  if (job.pinned_worker >= 0) return {Fate::fail, lost()};  // what it needs died with the worker
  // A worker takes its jobs in order, one at a time, and every reply it sent was read: only its
  // oldest in flight may have started, whatever its slot says (a task may have zeroed it). Not so
  // for a rejected one, whose replies after the breach are unread: its slot is the only word.
  bool may_be_forged_for = id == death.oldest_in_flight;
  bool behind_the_oldest = !may_be_forged_for && !worker.failure();
  bool never_started = behind_the_oldest || (id > death.last_taken && !death.slot_forged);
  if (never_started && (!may_be_forged_for || job.free_requeues < kMaxFreeRequeues)) {
    if (may_be_forged_for) ++job.free_requeues;
    return {Fate::requeue, nullptr};
  }
  if (worker.stopped_job()) return {Fate::requeue, nullptr};  // lost only because we stopped another job there
  if (worker.failure()) return {Fate::fail, worker.failure()};
  if (job.attempts >= rules.max_retries) return {Fate::fail, lost()};
  if (id == death.last_taken && job.range.size() > 1) return {Fate::split, nullptr};
  return {Fate::retry, nullptr};
}

}  // namespace forkpool::detail
