#include <forkpool/pool/internal/pool_core.hpp>

#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <deque>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <stop_token>
#include <string>
#include <thread>
#include <tuple>
#include <type_traits>

#include <forkpool/pool/private/launcher.hpp>
#include <forkpool/pool/private/pool_worker.hpp>
#include <forkpool/pool/internal/task_message.hpp>
#include <forkpool/pool/worker_info.hpp>
#include <forkpool/runtime/error.hpp>
#include <forkpool/runtime/internal/io.hpp>
#include <forkpool/runtime/private/loop_internals.hpp>
#include <forkpool/runtime/internal/one_shot.hpp>
#include <forkpool/runtime/private/process.hpp>
#include <forkpool/runtime/private/spawned_worker.hpp>
#include <forkpool/runtime/scope.hpp>
#include <forkpool/shm/private/name_tracker.hpp>
#include <forkpool/shm/sharing.hpp>

namespace forkpool::detail {
namespace {

// Jobs a worker holds at once: the one it runs and the next, so it never waits for the parent.
// While its jobs are short (under kShortJob on average over its window) the window doubles up
// to kMaxJobsPerWorker, so that a burst of small tasks travels in batches (one publication and
// at most one wake-up for many); long jobs bring it back. A job behind a short one waits little,
// and results that are long to make (large tensors) stay two per worker, their memory in cache.
constexpr std::size_t kJobsPerWorker = 2;
constexpr std::size_t kMaxJobsPerWorker = 16;
constexpr auto kShortJob = std::chrono::microseconds(50);
// A job still running this long is stuck, whatever its worker's window says (issue 58.4): the
// jobs queued behind it go to a worker that runs dry, and none are sent to it while another may
// take them. The scheduler's reaction time to a stuck job: twenty short ones.
constexpr auto kStuckJob = 20 * kShortJob;
// A window back at two says the worker's jobs are long (or not yet measured).
bool jobs_are_long(const WorkerSchedule& schedule) noexcept { return schedule.window == kJobsPerWorker; }
// Submitted from plain code, as many as this go to each worker at once (PoolCoreImpl::window_of):
// the first while its jobs are short, which finish in moments anyway and cost less in smaller
// batches (a working set that stays in cache); the second while they are long (or not yet
// measured), so that seconds of work run while the program computes. Judged by whole drains
// (close_drain): a round of long jobs given from plain code is read hundreds at once at its
// waits, and must not look short to the next.
constexpr std::size_t kDeepJobsPerWorker = 64;
constexpr std::size_t kDeepLongJobsPerWorker = 1024;
// A worker is sent no more once its jobs hold half the claim words (PoolWorker::has_claim_words_left):
// a full window alone never comes to that.
static_assert(kDeepJobsPerWorker < RunningSlot::kClaims / 2 && kDeepLongJobsPerWorker < RunningSlot::kClaims / 2);
// Workers in a row whose initializer threw before the pool gives up and fails its work with the
// InitializerError (Python's pool would start new ones for ever).
constexpr int kMaxInitializerFailures = 3;
// A job whose worker dies before taking it up goes again at no cost, on the worker's word (its
// RunningSlot), which a task can forge: for the job it runs, which is its oldest in flight (a
// worker takes its jobs in order, and every earlier one has answered). Past this many such
// deaths that oldest job is charged as if it ran. The jobs behind it always go again for free:
// a worker holds up to a deep window of them, and each of its deaths would charge them all.
constexpr int kMaxFreeRequeues = 16;

// When a job starts, for its task_timeout deadline: a time never before the true one, so that no
// task is stopped early, read cheaply, since it is read on every round trip. The coarse clock is
// the kernel's time at its last tick, without reading the clock source (3 ns, where a
// steady_clock read costs 21 on these VMs); it counts the same monotonic time and lags by under
// a tick, which is added. A deadline may then fall up to a tick late (1-4 ms).
Clock::time_point no_earlier_than_now() noexcept {
  static const std::chrono::nanoseconds tick = [] {
    timespec resolution{};
    clock_getres(CLOCK_MONOTONIC_COARSE, &resolution);
    return std::chrono::seconds(resolution.tv_sec) + std::chrono::nanoseconds(resolution.tv_nsec);
  }();
  static_assert(std::is_same_v<Clock, std::chrono::steady_clock>);  // CLOCK_MONOTONIC, as the coarse one
  timespec coarse{};
  clock_gettime(CLOCK_MONOTONIC_COARSE, &coarse);
  return Clock::time_point(std::chrono::seconds(coarse.tv_sec) + std::chrono::nanoseconds(coarse.tv_nsec) + tick);
}

// The drain of replies being read is over: its jobs took, together, from the mark to it.
void close_drain(WorkerSchedule& schedule) noexcept {
  if (schedule.finished_in_drain == 0) return;
  schedule.drained_long = schedule.drain_time - schedule.drain_mark >= kShortJob * schedule.finished_in_drain;
  schedule.drain_mark = schedule.drain_time;
  schedule.finished_in_drain = 0;
}

int default_processes() {
  long cpus = sysconf(_SC_NPROCESSORS_ONLN);
  return cpus > 0 ? static_cast<int>(cpus) : 1;
}

std::unique_ptr<Launcher> make_launcher(const PoolOptions& options, const std::string& process_name) {
  WorkerSpec spec{options.maxtasksperchild, options.initializer, process_name};
  switch (options.start_method) {
    case StartMethod::fork: return make_fork_launcher(std::move(spec));
    case StartMethod::forkserver: return make_fork_server_launcher(std::move(spec));
    case StartMethod::spawn: return make_spawn_launcher(std::move(spec));
  }
  throw std::invalid_argument("forkpool: unknown start method");
}

}  // namespace

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
  void hold_sends() override { ++sends_held_; }
  void release_sends() override {
    if (--sends_held_ > 0) return;
    for (auto& w : workers_) close_drain(w->schedule);  // the drain is over
    held_time_.reset();
    flush_workers();
  }
  void worker_gone(const std::shared_ptr<PoolWorker>& worker) override;
  void loop_left() noexcept override;
  void loop_ending() noexcept override;

 private:
  // What becomes of a job that was in flight on a worker that is gone.
  enum class Fate {
    fail,     // its sink gets `error`
    drop,     // nobody wants it any more (its map failed)
    requeue,  // it never started, or was lost only because we stopped another job: again, free
    retry,    // it ran: again, charged one attempt
    split,    // its chunk ran partly: the part before the running element and the part
              // after it go again free, the running element alone is charged
  };
  struct Verdict {
    Fate fate;
    std::exception_ptr error;  // Fate::fail
  };
  struct Death;
  Verdict fate_of(const Death& death, std::uint64_t id, Job& job) const;

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
  std::size_t window_of(const PoolWorker& worker) const noexcept;
  bool may_take(const PoolWorker& worker) const noexcept;
  // Whether the job `worker` runs has run kStuckJob or longer (also when what it held behind
  // that job was taken back: it has not read its ring since). `now` is schedule_time(), read
  // when first needed: a round trip, where no worker holds work, reads no clock.
  bool runs_stuck_job(PoolWorker& worker, std::optional<Clock::time_point>& now) {
    return worker.schedule.has_served && runs_long(worker, now);
  }
  // The same for any worker, also one that has not answered yet (that may be still starting).
  bool runs_long(PoolWorker& worker, std::optional<Clock::time_point>& now) {
    if (!worker.has_unsettled_work()) return false;
    if (!now) now = schedule_time();
    return *now - worker.schedule.running_since >= kStuckJob;
  }
  // take_back_for_idle() runs again at `when` (a running job turns stuck then), unless sooner.
  void look_again_at(Clock::time_point when);
  Task<void> look_again_later();
  std::optional<Clock::time_point> look_again_at_;  // set while look_again_later() waits
  void prefetch_ahead() const noexcept;
  void flush_workers() noexcept;
  // The live worker to send `job` to now (one of workers_): its pinned one, else the least busy
  // with room; null when none may take it.
  PoolWorker* pick_worker(const Job& job);
  void retire_if_idle(PoolWorker& worker);
  void fail_queue(const std::exception_ptr& error);
  void stop_running_job(PoolWorker& worker, std::uint64_t id, std::exception_ptr reason);
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
  std::unique_ptr<Launcher> launcher_;
  std::vector<std::shared_ptr<PoolWorker>> workers_;
  std::deque<std::shared_ptr<Job>> queue_;
  std::uint64_t next_request_id_ = 0;
  std::vector<std::uint64_t> generations_;  // by worker id: how many workers have held it
  std::uint64_t seed_base_ = 0;
  bool closed_ = false;
  bool terminated_ = false;
  int open_streams_ = 0;  // streams that may still submit, also after close()
  int sends_held_ = 0;    // hold_sends() without its release_sends() yet
  // The time as the scheduler sees it: while sends are held (a drain of replies, a window of
  // submits), the time it was first asked for then. Replies read in one drain all finish at once:
  // one clock read per drain, not per reply (a job's length is judged on average over many).
  std::optional<Clock::time_point> held_time_;
  Clock::time_point schedule_time() {
    if (sends_held_ == 0) return Clock::now();
    if (!held_time_) held_time_ = Clock::now();
    return *held_time_;
  }
  int initializer_failures_ = 0;  // consecutive workers whose initializer threw
  std::exception_ptr broken_;     // why no worker can be started any more (the initializer)
  OneShot all_exited_;
  std::stop_source stop_timers_;  // ends enforce_task_timeout() on terminate()
  CodeObjects code_objects_;      // where the task functions live, for the workers to load
  Scope background_;              // each worker's conversation, and the task_timeout timer
};

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
      processes_(options_.processes > 0 ? options_.processes : default_processes()) {
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
  launcher_ = make_launcher(options_, process_name_);
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
      worker->schedule.window = kJobsPerWorker;
      workers_.push_back(worker);
      // The sharing strategy of now: a worker from a fork server started earlier has that one's.
      std::int64_t spin = options_.spin ? options_.spin->count() : -1;
      Writer hello = encode(std::tuple<int, int, std::uint64_t, SharingStrategy, std::int64_t, std::int32_t>(
          worker->index(), processes_, seeds[i], get_sharing_strategy(), spin, static_cast<std::int32_t>(getpid())));
      worker->begin(shared_from_this(), *launcher_, code_objects_, background_, starts[i], hello.bytes(),
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

std::size_t PoolCoreImpl::jobs_wanted() const noexcept {
  std::size_t wanted = 0;
  for (const auto& w : workers_) wanted += w->schedule.window;
  return std::max(wanted, kJobsPerWorker * static_cast<std::size_t>(processes_));
}

bool PoolCoreImpl::may_take(const PoolWorker& worker) const noexcept {
  return !worker.schedule.retiring && !worker.write_closed() && !worker.failure() && !worker.exited();
}

// Submitted from plain code (the loop not driven: the program may compute for a while before it
// waits), a worker is given as many jobs as it may hold, so that all of it runs meanwhile, as
// Python's pool keeps working in its threads. take_back_for_idle() evens out what that sent.
std::size_t PoolCoreImpl::window_of(const PoolWorker& worker) const noexcept {
  if (jobs_may_move() && !LoopInternals::driving(loop_))
    return worker.schedule.drained_long ? kDeepLongJobsPerWorker : kDeepJobsPerWorker;
  return worker.schedule.window;
}

PoolWorker* PoolCoreImpl::pick_worker(const Job& job) {
  PoolWorker* best = nullptr;
  std::optional<bool> best_stuck;  // worked out once two workers are compared
  std::optional<Clock::time_point> now;
  for (auto& w : workers_) {
    if (!may_take(*w)) continue;
    // A pinned job's stream bounds what it sends (its prefetch), not the worker's window.
    if (job.pinned_worker >= 0) {
      if (w->index() == job.pinned_worker) return w.get();
      continue;
    }
    if (w->in_flight().size() >= window_of(*w) || !w->has_claim_words_left()) continue;
    if (!best) {
      best = w.get();
      continue;
    }
    if (!best_stuck) best_stuck = runs_stuck_job(*best, now);
    // Least busy, but a worker stuck in a job last: what it is sent waits behind that job.
    bool stuck = runs_stuck_job(*w, now);
    if (stuck < *best_stuck || (stuck == *best_stuck && w->in_flight().size() < best->in_flight().size())) {
      best = w.get();
      best_stuck = stuck;
    }
  }
  return best;
}

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
  if (sends_held_ == 0) flush_workers();  // held: release_sends() publishes
}

void PoolCoreImpl::send_queued() {
  while (!queue_.empty()) {
    prefetch_ahead();
    if (queue_.front()->sink->abandoned()) {
      queue_.pop_front();  // its map has failed: nobody wants what it would compute
      continue;
    }
    PoolWorker* worker = pick_worker(*queue_.front());  // workers_ holds it
    if (!worker) break;
    std::shared_ptr<Job> job = std::move(queue_.front());
    queue_.pop_front();
    WorkerSchedule& schedule = worker->schedule;
    if (worker->in_flight().empty()) {
      // It starts this one at once. (Its deadline needs the time now, where schedule_time's may
      // be a drain's old one: no_earlier_than_now.)
      Clock::time_point now = schedule_time();
      close_drain(schedule);       // what it finished before, on its own
      schedule.window_mark = now;  // time idle says nothing of its jobs' length
      schedule.drain_mark = now;
      schedule.finished_since_mark = 0;
      schedule.running_since = no_earlier_than_now();
    }
    if (options_.maxtasksperchild > 0 && ++schedule.assigned >= options_.maxtasksperchild) schedule.retiring = true;
    std::uint64_t id = ++next_request_id_;
    while (!worker->claim_word_free(id)) id = ++next_request_id_;
    worker->send(id, std::move(job));
  }
}

// The program goes back to its own code, and may compute for a while: what waits in the queue
// goes to the workers now, as much as they may hold (window_of), since nothing sends it until
// the program calls in again.
void PoolCoreImpl::loop_left() noexcept {
  if (queue_.empty() || terminated_ || !in_owner_process()) return;
  // In batches: a program that gets its results one by one would otherwise send a job or two
  // per get, each published (and its cache line moved) on its own.
  auto low = [&](const auto& w) { return may_take(*w) && w->in_flight().size() + kMaxJobsPerWorker <= window_of(*w); };
  if (std::none_of(workers_.begin(), workers_.end(), low)) return;
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

// A worker left with one job or none, while another has two or more it has not taken up behind
// the one it runs (a long job holding up short ones, or a deep send from plain code): half the
// difference moves, as much as the idle one may take, newest first. The busy worker skips what
// was taken back (RunningSlot::withdraw): a job runs once, wherever it runs.
bool PoolCoreImpl::take_back_for_idle() {
  if (!jobs_may_move() || workers_.size() < 2) return false;
  PoolWorker* idle = nullptr;
  PoolWorker* busiest = nullptr;
  std::optional<Clock::time_point> now;          // read when first needed (runs_stuck_job)
  std::optional<Clock::time_point> turns_stuck;  // of the first job behind which others wait
  for (auto& w : workers_) {
    std::size_t held = w->in_flight().size();
    // (One that may not be sent more, for want of claim words, would hand them back at once.)
    if (may_take(*w) && held < kJobsPerWorker && w->has_claim_words_left() &&
        (!idle || held < idle->in_flight().size()))
      idle = w.get();
    // A job may run long because its task broke the ring: then its worker is rejected (and
    // killed) now, not when the ring fills, and what it holds goes elsewhere once it is gone.
    if (runs_long(*w, now)) w->check_ring();
    bool stuck = runs_stuck_job(*w, now);
    // Short jobs (a window grown past two) drain fast where they are: moving them would cost more
    // than it saves, unless a worker holds more than its window (a deep send from plain code),
    // or the job it runs turned out long (stuck: running kStuckJob or more).
    bool worth_moving = jobs_are_long(w->schedule) || held > w->schedule.window || stuck;
    if (!worth_moving && held >= kJobsPerWorker) {
      Clock::time_point when = w->schedule.running_since + kStuckJob;
      turns_stuck = turns_stuck ? std::min(*turns_stuck, when) : when;
    }
    if (worth_moving && !w->exited() && !w->schedule.stopped_job && (!busiest || held > busiest->in_flight().size()))
      busiest = w.get();
  }
  // Nothing to move now, but jobs wait behind one that may turn out stuck: look again then.
  if (idle && (!busiest || busiest == idle) && turns_stuck) look_again_at(*turns_stuck);
  if (!idle || !busiest || idle == busiest) return false;
  std::size_t gap = busiest->in_flight().size() - idle->in_flight().size();
  // Behind a stuck job, even its one job in flight moves, if the worker has not taken it up (a
  // stopped worker): it would wait there, however long that one runs.
  bool stuck = runs_stuck_job(*busiest, now);
  if (gap < (stuck ? 1 : 2)) return false;
  std::size_t moves = std::min(std::max<std::size_t>(gap / 2, 1), window_of(*idle) - idle->in_flight().size());
  std::deque<std::shared_ptr<Job>> taken;  // oldest first, as they were queued
  for (; moves > 0; --moves) {
    std::shared_ptr<Job> job = busiest->withdraw_newest();
    if (!job) break;
    taken.push_front(std::move(job));
  }
  queue_.insert(queue_.begin(), taken.begin(), taken.end());
  return !taken.empty();
}

void PoolCoreImpl::look_again_at(Clock::time_point when) {
  if (terminated_) return;
  // Judged by schedule_time(), which lags while sends are held: a time already past on the
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
    WorkerSchedule& schedule = worker.schedule;
    schedule.has_served = true;
    Clock::time_point now = schedule_time();
    if (now != schedule.drain_time) {  // the first result of a new drain: the last one is over
      close_drain(schedule);
      schedule.drain_time = now;
    }
    ++schedule.finished_in_drain;
    if (sends_held_ == 0) close_drain(schedule);  // read on its own: a drain of one
    // Jobs are judged on average since the mark, not one by one: results read in one drain of
    // the ring all finish "now", and all but the first would look as if they took no time.
    ++schedule.finished_since_mark;
    bool long_jobs = now - schedule.window_mark >= kShortJob * schedule.finished_since_mark;
    if (long_jobs || schedule.finished_since_mark >= schedule.window) {
      schedule.window = long_jobs ? kJobsPerWorker : std::min(2 * schedule.window, kMaxJobsPerWorker);
      schedule.window_mark = now;
      schedule.finished_since_mark = 0;
    }
    // It has taken up the next.
    if (!worker.in_flight().empty()) schedule.running_since = no_earlier_than_now();
  }
  dispatch();  // after close(), this also retires the worker once it is idle
}

// What a worker's death tells about its jobs in flight.
struct PoolCoreImpl::Death {
  const PoolWorker& worker;
  std::uint64_t last_taken;  // by the worker's word (RunningSlot): the jobs after it never started
  // A worker takes its jobs in order: one that answered a later job than it claims to have
  // taken up lied (a task wrote the slot), and the job it ran does not go again for free.
  bool slot_forged;
  std::uint64_t oldest_in_flight;  // the one it ran, if it ran any (kMaxFreeRequeues)
};

namespace {
// The error of a job that died with `worker`.
std::exception_ptr lost_with(const PoolWorker& worker) {
  return std::make_exception_ptr(WorkerLost(worker.pid(), worker.status().exit_code, worker.status().signal));
}
}  // namespace

// The fate of job `id` (in flight on `death.worker`), in order of precedence.
PoolCoreImpl::Verdict PoolCoreImpl::fate_of(const Death& death, std::uint64_t id, Job& job) const {
  const PoolWorker& worker = death.worker;
  const WorkerSchedule& schedule = worker.schedule;
  auto lost = [&] { return lost_with(worker); };
  if (terminated_) return {Fate::fail, std::make_exception_ptr(PoolTerminated())};
  // A Process (or a rank) is its worker: its end is the task's, whether it took the task up or not.
  if (jobs_die_with_worker_) return {Fate::fail, lost()};
  if (id == schedule.stopped_job && schedule.stop_reason)
    return {Fate::fail, schedule.stop_reason};  // task_timeout: not retried
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
  if (schedule.stopped_job) return {Fate::requeue, nullptr};  // lost only because we stopped another job there
  if (worker.failure()) return {Fate::fail, worker.failure()};
  if (job.attempts >= options_.max_retries) return {Fate::fail, lost()};
  if (id == death.last_taken && job.range.size() > 1) return {Fate::split, nullptr};
  return {Fate::retry, nullptr};
}

void PoolCoreImpl::worker_gone(const std::shared_ptr<PoolWorker>& worker) {
  std::erase(workers_, worker);
  if (worker->initializer_error() && ++initializer_failures_ >= kMaxInitializerFailures)
    broken_ = worker->initializer_error();

  RunningSlot& slot = worker->slot();
  Death death{*worker, slot.request_id.load(), false, 0};
  death.slot_forged = death.last_taken < worker->last_replied();
  if (!worker->in_flight().empty()) death.oldest_in_flight = worker->in_flight().begin()->first;
  std::vector<std::pair<std::shared_ptr<Job>, std::exception_ptr>> failed;
  std::deque<std::shared_ptr<Job>> requeued;  // to the front of the queue, in order
  for (auto& [id, job] : worker->in_flight()) {
    Verdict verdict = fate_of(death, id, *job);
    switch (verdict.fate) {
      case Fate::fail: failed.emplace_back(job, std::move(verdict.error)); break;
      case Fate::drop: break;
      case Fate::requeue: requeued.push_back(job); break;
      case Fate::retry:
        ++job->attempts;
        requeued.push_back(job);
        break;
      case Fate::split: {
        std::uint64_t running = std::clamp<std::uint64_t>(slot.element.load(), job->range.first, job->range.end - 1);
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
      if (w->withdraw(id)) continue;                                             // not taken up: it never runs
      if (w->slot().request_id.load() == id) stop_running_job(*w, id, nullptr);  // else it has finished
    }
  }
  dispatch();  // drops its queued jobs, and sends others to the workers withdrawing made room in
}

void PoolCoreImpl::stop_running_job(PoolWorker& worker, std::uint64_t id, std::exception_ptr reason) {
  if (worker.schedule.stopped_job || worker.exited()) return;
  worker.schedule.stopped_job = id;
  worker.schedule.stop_reason = std::move(reason);
  worker.kill();
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
      if (w->in_flight().empty() || w->schedule.stopped_job || w->exited()) continue;
      Clock::time_point deadline = saturating_add(w->schedule.running_since, timeout);
      if (deadline > now) {
        wake = std::min(wake, deadline);
        continue;
      }
      std::uint64_t running = w->in_flight().begin()->first;  // its oldest: the one it runs
      stop_running_job(*w, running,
                       std::make_exception_ptr(TimeoutError(
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
