#include <forkpool/pool/private/pool_core_impl.hpp>

#include <unistd.h>

#include <algorithm>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>

#include <forkpool/pool/private/job_fate.hpp>
#include <forkpool/pool/internal/task_encoding.hpp>
#include <forkpool/worker/worker_info.hpp>
#include <forkpool/runtime/error.hpp>
#include <forkpool/runtime/internal/io.hpp>
#include <forkpool/runtime/private/process.hpp>
#include <forkpool/runtime/private/spawned_worker.hpp>
#include <forkpool/shm/private/name_tracker.hpp>
#include <forkpool/shm/sharing.hpp>

namespace forkpool::detail {
namespace {

// Workers in a row whose initializer threw before the pool gives up and fails its work with the
// InitializerError (Python's pool would start new ones for ever).
constexpr int kMaxInitializerFailures = 3;

int default_processes() {
  long cpus = sysconf(_SC_NPROCESSORS_ONLN);
  return cpus > 0 ? static_cast<int>(cpus) : 1;
}

}  // namespace

PoolCore::PoolCore() : owner_thread_(std::this_thread::get_id()), owner_pid_(current_pid()) {}

bool PoolCore::in_owner_process() const noexcept { return current_pid() == owner_pid_; }

bool PoolCore::on_owner_thread() const noexcept { return std::this_thread::get_id() == owner_thread_; }

void PoolCore::check_owner(const char* who) const {
  if (!in_owner_process())
    throw std::logic_error(std::string("forkpool: ") + who +
                           " called in a forked child: a Pool belongs to the process that made it");
  if (!on_owner_thread())
    throw std::logic_error(std::string("forkpool: ") + who +
                           " called from another thread: a Pool belongs to the thread that made it; hand "
                           "the call to that thread with Loop::post (docs/embedding.md)");
}

std::shared_ptr<PoolCore> PoolCore::create(PoolOptions options, std::string process_name, bool jobs_die_with_worker) {
  auto core = std::make_shared<PoolCoreImpl>(std::move(options), std::move(process_name), jobs_die_with_worker);
  try {
    core->start_workers();
  } catch (...) {
    core->shut_down();  // the workers started so far are killed and reaped, their descriptors closed
    throw;
  }
  return core;
}

PoolCoreImpl::PoolCoreImpl(PoolOptions options, std::string process_name, bool jobs_die_with_worker)
    : options_(std::move(options)),
      process_name_(std::move(process_name)),
      jobs_die_with_worker_(jobs_die_with_worker || !process_name_.empty()),
      processes_(options_.processes > 0 ? options_.processes : default_processes()),
      scheduler_(jobs_may_move()) {
  if (options_.processes < 0) throw std::invalid_argument("forkpool: PoolOptions::processes must be >= 0");
  if (options_.maxtasksperchild < 0)
    throw std::invalid_argument("forkpool: PoolOptions::maxtasksperchild must be >= 0");
  if (options_.max_retries < 0) throw std::invalid_argument("forkpool: PoolOptions::max_retries must be >= 0");
  if (options_.task_timeout < std::chrono::nanoseconds::zero())
    throw std::invalid_argument("forkpool: PoolOptions::task_timeout must be >= 0");
  // (Its wire form says "adaptive" with -1: a negative one would be taken for the empty one.)
  if (options_.spin && *options_.spin < std::chrono::nanoseconds::zero())
    throw std::invalid_argument("forkpool: PoolOptions::spin must be >= 0 (or empty: adaptive)");
}

void PoolCoreImpl::start_workers() {
  serve_if_spawned_worker();  // a spawned worker's program making a pool before init() serves instead
  try {
    start_name_tracker();  // one per process tree: the workers must inherit ours
  } catch (const std::system_error&) {
    // Only file_system tensors need it; making one reports why it cannot be started.
  }
  launcher_ = make_launcher(options_.start_method, {options_.maxtasksperchild, options_.initializer, process_name_});
  seed_base_ = pool_seed_base(options_.seed);
  launch_workers(processes_);
  if (options_.task_timeout > std::chrono::nanoseconds::zero()) background_.start(enforce_task_timeout());
  LoopInternals::add_leave_listener(loop_, shared_from_this());
}

// The lowest id no live worker holds, nor one being started (`starting`): a replacement takes
// the id of the worker it replaces.
int PoolCoreImpl::free_worker_id(const std::vector<int>& starting) {
  for (int id = 0;; ++id) {
    bool held = std::any_of(workers_.begin(), workers_.end(), [&](const auto& w) { return w->index() == id; }) ||
                std::find(starting.begin(), starting.end(), id) != starting.end();
    if (held) continue;
    if (static_cast<std::size_t>(id) >= generations_.size()) generations_.resize(id + 1, 0);
    return id;
  }
}

// Starts `count` workers whose start-ups overlap (a spawned worker's is a run of the program up
// to forkpool::init()). Those that start are served even when others fail; then the first
// failure is thrown.
void PoolCoreImpl::launch_workers(int count) {
  std::vector<PoolWorker::Start> starts;
  std::vector<std::shared_ptr<PoolWorker>> workers;
  std::vector<std::uint64_t> seeds;
  std::vector<Launcher::Launch> launches(count);
  std::vector<int> ids;
  for (int i = 0; i < count; ++i) {
    starts.push_back(PoolWorker::Start::make());
    int id = free_worker_id(ids);
    ids.push_back(id);
    workers.push_back(std::make_shared<PoolWorker>(id, starts.back()));
    seeds.push_back(worker_seed(seed_base_, id, generations_[id]++));
    launches[i] = {id, std::move(starts.back().theirs), {}, nullptr};
  }
  launcher_->start_all(launches);
  std::exception_ptr first_failure;
  for (int i = 0; i < count; ++i) {
    try {
      if (launches[i].error) std::rethrow_exception(launches[i].error);
      std::shared_ptr<PoolWorker>& worker = workers[i];
      worker->set_process(std::move(launches[i].process));
      scheduler_.worker_started(*worker);
      workers_.push_back(worker);
      // The sharing strategy of now: a worker from a fork server started earlier has that one's.
      HelloMessage hello{worker->index(), processes_, seeds[i], get_sharing_strategy(), options_.spin, current_pid()};
      worker->begin(shared_from_this(), *launcher_, code_objects_, background_, starts[i], encode_hello(hello).bytes(),
                    options_.spin);
    } catch (...) {
      if (!first_failure) first_failure = std::current_exception();
    }
  }
  if (first_failure) std::rethrow_exception(first_failure);
}

std::uint64_t PoolCoreImpl::worker_spin_polls() const {
  std::uint64_t polls = 0;
  for (auto& w : workers_) polls += w->spin_polls();
  return polls;
}

void PoolCoreImpl::submit(std::shared_ptr<Job> job) {
  if (closed_) throw PoolClosed();
  submit_for_stream(std::move(job));
}

void PoolCoreImpl::submit_for_stream(std::shared_ptr<Job> job) {
  if (terminated_) throw PoolTerminated();
  if (broken_) std::rethrow_exception(broken_);
  queue_.push_back(std::move(job));
  replenish();
  dispatch();
}

void PoolCoreImpl::stream_closed() {
  --open_streams_;
  if (closed_)
    for (auto& w : workers_) retire_if_idle(*w);
}

void PoolCoreImpl::replenish() {
  if (!terminated_ && !broken_ && static_cast<int>(workers_.size()) < processes_ && (!closed_ || !queue_.empty())) {
    try {
      launch_workers(processes_ - static_cast<int>(workers_.size()));
    } catch (const std::exception& e) {
      // No worker can be started now (descriptors or processes exhausted): with none left, the
      // queued work fails with the reason instead of waiting for ever; a later submit tries again.
      if (workers_.empty())
        fail_queue(std::make_exception_ptr(Error(std::string("forkpool: cannot start a worker: ") + e.what())));
      return;
    }
  }
}

std::size_t PoolCoreImpl::jobs_wanted() const noexcept { return scheduler_.jobs_wanted(workers_, processes_); }

void PoolCoreImpl::flush_workers() noexcept {
  for (auto& w : workers_) w->flush();
}

void PoolCoreImpl::dispatch() {
  if (terminated_) return;
  take_back_abandoned();
  do send_queued();
  while (queue_.empty() && take_back_for_idle());
  if (closed_)
    for (auto& w : workers_) retire_if_idle(*w);
  if (!scheduler_.held()) flush_workers();  // held: release_sends() publishes
}

void PoolCoreImpl::send_queued() {
  // From plain code a job waits for ring room nowhere but in the queue, where whichever worker
  // has room takes it: in a worker's outbox nothing would send it until the program calls in.
  bool may_wait_for_room = driving();
  for (auto& w : workers_) w->clear_ring_full();
  while (!queue_.empty()) {
    prefetch_ahead();
    if (queue_.front()->sink->abandoned()) {
      queue_.pop_front();  // its map has failed: nobody wants what it would compute
      continue;
    }
    PoolWorker* worker = scheduler_.pick(workers_, *queue_.front(), driving());  // workers_ holds it
    if (!worker) break;
    std::uint64_t id = ++next_request_id_;
    while (!worker->claim_word_free(id)) id = ++next_request_id_;
    bool was_idle = worker->in_flight().empty();
    // (Off the queue first: a job that fails at once is told, and the queue may change then.)
    std::shared_ptr<Job> job = std::move(queue_.front());
    queue_.pop_front();
    if (!worker->send(id, job, may_wait_for_room)) {  // it takes no more now
      queue_.push_front(std::move(job));
      continue;
    }
    scheduler_.sent(*worker, was_idle);
    if (options_.maxtasksperchild > 0 && worker->jobs_sent() >= options_.maxtasksperchild) worker->retire();
  }
}

// The program goes back to its own code, and may compute for a while: what waits in the queue
// goes to the workers now, as much as they may hold (Scheduler::window_of), since nothing sends it until
// the program calls in again.
void PoolCoreImpl::loop_left() noexcept {
  if (queue_.empty() || terminated_ || !in_owner_process()) return;
  // In batches: a program that gets its results one by one would otherwise send a job or two
  // per get, each published (and its cache line moved) on its own.
  if (!scheduler_.has_room_for_a_batch(workers_, driving())) return;
  try {
    dispatch();
  } catch (...) {
    // What could not be sent stays queued: the next turn of the loop sends it.
  }
}

void PoolCoreImpl::take_back_abandoned() {
  if (!jobs_may_move()) return;
  for (auto& w : workers_)
    while (!w->in_flight().empty() && w->in_flight().back().second->sink->abandoned())
      if (!w->withdraw_newest()) break;  // taken up: it runs, and its result is dropped
}

// A worker running dry while another holds jobs it has not taken up: the scheduler says which
// move. The busy worker skips what was taken back (RunningSlot::withdraw): a job runs once,
// wherever it runs.
bool PoolCoreImpl::take_back_for_idle() {
  Scheduler::Move move = scheduler_.move_for_idle(workers_, driving());
  // A job may run long because its task broke the ring: then its worker is rejected (and killed)
  // now, not when the ring fills, and what it holds goes elsewhere once it is gone.
  for (PoolWorker* worker : move.long_running) worker->check_ring();
  if (move.look_again_at) look_again_at(*move.look_again_at);
  if (move.jobs == 0) return false;        // (before the deque: making one allocates)
  std::deque<std::shared_ptr<Job>> taken;  // oldest first, as they were queued
  for (std::size_t moved = 0; moved < move.jobs; ++moved) {
    std::shared_ptr<Job> job = move.from->withdraw_newest();
    if (!job) break;
    taken.push_front(std::move(job));
  }
  queue_.insert(queue_.begin(), taken.begin(), taken.end());
  return !taken.empty();
}

void PoolCoreImpl::look_again_at(Clock::time_point when) {
  if (terminated_) return;
  // Judged by the scheduler's time, which lags while sends are held: a time already past on the
  // clock is looked at again a moment later, from a turn of the loop (never from inside this
  // call: dispatch() would call back here).
  when = std::max(when, Clock::now() + kShortJob);
  bool waiting = look_again_at_.has_value();
  if (!waiting || when < *look_again_at_) look_again_at_ = when;
  if (!waiting) background_.start(look_again_later());
}

Task<void> PoolCoreImpl::look_again_later() {
  auto self = shared_from_this();
  std::stop_token stop = stop_timers_.get_token();
  do {
    co_await wait_until(*look_again_at_, stop);
  } while (!terminated_ && Clock::now() < *look_again_at_);
  look_again_at_.reset();
  if (terminated_) co_return;
  try {
    dispatch();
  } catch (...) {
    // What could not be sent stays queued: the next turn of the loop sends it.
  }
}

// Jobs wait in the queue long enough to leave the cache (100,000 submitted at once: tens of
// megabytes), and dispatch reads each job, then its sink: two misses in a row per job. Asked for
// a few jobs ahead, they are there by the time they are sent.
void PoolCoreImpl::prefetch_ahead() const noexcept {
  constexpr std::size_t kJobsAhead = 4, kSinksAhead = 2;
  if (queue_.size() > kJobsAhead) {
    const auto* job = reinterpret_cast<const char*>(queue_[kJobsAhead].get());
    for (std::size_t line = 0; line < sizeof(Job); line += 64) __builtin_prefetch(job + line);
  }
  if (queue_.size() > kSinksAhead) __builtin_prefetch(queue_[kSinksAhead]->sink.get());
}

void PoolCoreImpl::retire_if_idle(PoolWorker& worker) {
  if (!closed_ || open_streams_ > 0 || !queue_.empty() || !worker.in_flight().empty()) return;
  worker.close_write();
}

void PoolCoreImpl::job_finished(PoolWorker& worker, bool served) {
  if (served) {
    initializer_failures_ = 0;  // a worker that serves proves the initializer can succeed
    scheduler_.finished(worker, !worker.in_flight().empty());
  }
  dispatch();  // after close(), this also retires the worker once it is idle
}

void PoolCoreImpl::worker_gone(const std::shared_ptr<PoolWorker>& worker) {
  std::erase(workers_, worker);
  if (worker->initializer_error() && ++initializer_failures_ >= kMaxInitializerFailures)
    broken_ = worker->initializer_error();

  Death death(*worker);
  FateRules rules{terminated_, jobs_die_with_worker_, options_.max_retries};
  std::vector<std::pair<std::shared_ptr<Job>, std::exception_ptr>> failed;
  std::deque<std::shared_ptr<Job>> requeued;  // to the front of the queue, in order
  for (auto& [id, job] : worker->in_flight()) {
    Verdict verdict = fate_of(death, id, *job, rules);
    switch (verdict.fate) {
      case Fate::fail: failed.emplace_back(job, std::move(verdict.error)); break;
      case Fate::drop: break;
      case Fate::requeue: requeued.push_back(job); break;
      case Fate::retry:
        ++job->attempts;
        requeued.push_back(job);
        break;
      case Fate::split: {
        std::uint64_t running =
            std::clamp<std::uint64_t>(worker->slot().element.load(), job->range.first, job->range.end - 1);
        if (running > job->range.first) requeued.push_back(job_part(job, job->range.first, running));
        auto culprit = job_part(job, running, running + 1);
        culprit->attempts = job->attempts + 1;
        requeued.push_back(std::move(culprit));
        if (running + 1 < job->range.end) requeued.push_back(job_part(job, running + 1, job->range.end));
        break;
      }
    }
  }
  worker->in_flight().clear();
  // Jobs pinned to it and not sent yet are lost with it too: its replacement starts afresh.
  std::erase_if(queue_, [&](const std::shared_ptr<Job>& job) {
    if (job->pinned_worker != worker->index()) return false;
    failed.emplace_back(job, lost_with(*worker));
    return true;
  });
  queue_.insert(queue_.begin(), requeued.begin(), requeued.end());
  if (broken_ && workers_.empty()) fail_queue(broken_);

  replenish();
  dispatch();
  bool last = workers_.empty() && closed_;
  for (auto& [job, error] : failed) job->sink->chunk_failed(job->chunk, error);
  if (last) all_exited_.set();
}

void PoolCoreImpl::cancel(const JobSink* sink) {
  if (terminated_) return;
  for (auto& w : workers_) {
    std::vector<std::uint64_t> ids;
    for (auto& [id, job] : w->in_flight())
      if (job->sink.get() == sink) ids.push_back(id);
    for (std::uint64_t id : ids) {
      if (w->withdraw(id)) continue;                                    // not taken up: it never runs
      if (w->slot().request_id.load() == id) w->stop_job(id, nullptr);  // else it has finished
    }
  }
  dispatch();  // drops its queued jobs, and sends others to the workers withdrawing made room in
}

// One timer for every task_timeout: it wakes at the earliest deadline of a running job. A job
// that starts later has a later deadline than now + timeout, so sleeping that long misses none.
Task<void> PoolCoreImpl::enforce_task_timeout() {
  auto self = shared_from_this();
  std::stop_token stop = stop_timers_.get_token();
  const auto timeout = options_.task_timeout;
  while (!terminated_) {
    Clock::time_point now = Clock::now();
    Clock::time_point wake = saturating_add(now, timeout);
    for (auto& w : workers_) {
      if (w->in_flight().empty() || w->stopped_job() || w->exited()) continue;
      Clock::time_point deadline = saturating_add(scheduler_.running_since(*w), timeout);
      if (deadline > now) {
        wake = std::min(wake, deadline);
        continue;
      }
      std::uint64_t running = w->in_flight().begin()->first;  // its oldest: the one it runs
      w->stop_job(running, std::make_exception_ptr(TimeoutError(
                               "forkpool: the task ran longer than task_timeout (" +
                               std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(timeout).count()) +
                               " ms); worker " + std::to_string(w->pid()) + " was killed")));
    }
    co_await wait_until(wake, stop);
  }
}

void PoolCoreImpl::fail_queue(const std::exception_ptr& error) {
  auto jobs = std::exchange(queue_, {});
  for (auto& job : jobs) job->sink->chunk_failed(job->chunk, error);
}

void PoolCoreImpl::close() {
  if (closed_) return;
  closed_ = true;
  for (auto& w : workers_) retire_if_idle(*w);
  if (workers_.empty()) all_exited_.set();
}

void PoolCoreImpl::terminate() {
  if (terminated_) return;
  close();
  terminated_ = true;
  stop_timers_.request_stop();
  fail_queue(std::make_exception_ptr(PoolTerminated()));
  for (auto& w : workers_) w->kill();
}

Task<void> PoolCoreImpl::join() {
  if (!closed_) throw std::logic_error("forkpool: Pool::join() called before close() or terminate()");
  auto self = shared_from_this();
  co_await all_exited_;
}

void PoolCoreImpl::shut_down() {
  if (!on_owner_thread()) return post_to_own_loop([self = shared_from_this()] { self->shut_down(); });
  terminate();
  if (LoopInternals::driving(loop_)) {
    finish_reaping_before_return();  // inside a coroutine or a callback
  } else {
    LoopInternals::DriveGuard guard(loop_, "forkpool::Pool::~Pool");
    LoopInternals::drive_until(loop_, [this] { return background_.active() == 0; });
  }
}

void PoolCoreImpl::finish_reaping_before_return() {
  auto wait_for_workers = [](std::shared_ptr<PoolCoreImpl> self) -> Task<void> { co_await self->background_.join(); };
  LoopInternals::finish_before_return(loop_, wait_for_workers(shared_from_this()));
}

// ~Pool on another thread: the pool's coroutines and ring are its own thread's, so the shutdown
// is posted there and runs at that loop's next turn. Not waited for: the pool's thread may be
// the one waiting for this one (a join), and would never turn. If its loop has ended, the
// workers ended with it (loop_ending).
void PoolCoreImpl::post_to_own_loop(std::function<void()> shutdown) noexcept {
  std::lock_guard held(loop_mutex_);
  if (loop_ended_) return;
  try {
    loop_.post(std::move(shutdown));
  } catch (...) {
    // (Out of memory.) The workers end with the pool's thread's loop, or with this process.
  }
}

void post_shut_down_to_owner(PoolCore& local, std::function<void()> shutdown) noexcept {
  static_cast<PoolCoreImpl&>(local).post_to_own_loop(std::move(shutdown));
}

// The pool's thread exits with the pool alive (held elsewhere): its workers are stopped and
// reaped now, as ~Pool would, by ~Loop's last turns.
void PoolCoreImpl::loop_ending() noexcept {
  {
    std::lock_guard held(loop_mutex_);
    loop_ended_ = true;
  }
  if (!in_owner_process()) return;
  try {
    terminate();
    finish_reaping_before_return();
  } catch (...) {
    // (Out of memory.) The workers die with this process (PR_SET_PDEATHSIG), as a crash's would.
  }
}

UniqueFd PoolCoreImpl::worker_pidfd(pid_t pid) const {
  for (auto& w : workers_)
    if (w->pid() == pid) return duplicate_fd(w->process().pidfd.get());
  return {};
}

std::vector<pid_t> PoolCoreImpl::worker_pids() const {
  std::vector<pid_t> pids;
  for (auto& w : workers_)
    if (!w->exited()) pids.push_back(w->pid());
  return pids;
}

}  // namespace forkpool::detail
