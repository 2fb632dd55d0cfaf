#pragma once
// What becomes of the jobs a worker held when it died: a pure judgement of what its death tells
// (its running slot, its replies, why it died) against the pool's rules. The pool core
// (worker_gone) carries the verdicts out.

#include <cstdint>
#include <exception>

#include <forkpool/pool/internal/job.hpp>

namespace forkpool::detail {

class PoolWorker;

// A job whose worker dies before taking it up goes again at no cost, on the worker's word (its
// RunningSlot), which a task can forge: for the job it runs, which is its oldest in flight (a
// worker takes its jobs in order, and every earlier one has answered). Past this many such
// deaths that oldest job is charged as if it ran. The jobs behind it always go again for free:
// a worker holds up to a deep window of them, and each of its deaths would charge them all.
inline constexpr int kMaxFreeRequeues = 16;

enum class Fate {
  fail,     // its sink gets `error`
  drop,     // nobody wants it any more (its map failed)
  requeue,  // it never started, or was lost only because we stopped another job: again, free
  retry,    // it ran: again, charged one attempt
  split,    // its chunk ran partly: the part before the running element and the part after it
            // go again free, the running element alone is charged
};

struct Verdict {
  Fate fate;
  std::exception_ptr error;  // Fate::fail
};

// What a worker's death tells about its jobs in flight (read once it is gone).
struct Death {
  explicit Death(const PoolWorker& worker);
  const PoolWorker& worker;
  std::uint64_t last_taken;  // by the worker's word (RunningSlot): the jobs after it never started
  // A worker takes its jobs in order: one that answered a later job than it claims to have
  // taken up lied (a task wrote the slot), and the job it ran does not go again for free.
  bool slot_forged;
  std::uint64_t oldest_in_flight = 0;  // the one it ran, if it ran any (kMaxFreeRequeues)
};

// The pool's side of the judgement.
struct FateRules {
  bool terminated;            // everything in flight fails with PoolTerminated
  bool jobs_die_with_worker;  // a Process's or a rank's: its end is the task's
  int max_retries;            // PoolOptions::max_retries
};

// The fate of job `id`, in flight on `death.worker` (counts a free requeue on `job`).
Verdict fate_of(const Death& death, std::uint64_t id, Job& job, const FateRules& rules);

// The error of a job that died with `worker`.
std::exception_ptr lost_with(const PoolWorker& worker);

}  // namespace forkpool::detail
