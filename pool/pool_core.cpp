#include <forkpool/pool/internal/pool_core.hpp>

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstring>
#include <deque>
#include <map>
#include <set>
#include <unordered_map>
#include <optional>
#include <stdexcept>
#include <stop_token>
#include <string>

#include <forkpool/ipc/internal/channel.hpp>
#include <forkpool/ipc/internal/link.hpp>
#include <forkpool/ipc/internal/mapping.hpp>
#include <forkpool/ipc/internal/memfd.hpp>
#include <forkpool/pool/internal/launcher.hpp>
#include <forkpool/pool/worker_info.hpp>
#include <forkpool/shm/sharing.hpp>
#include <forkpool/pool/internal/peer_memory.hpp>
#include <forkpool/pool/internal/task_message.hpp>
#include <forkpool/runtime/internal/process.hpp>
#include <forkpool/runtime/error.hpp>
#include <forkpool/runtime/internal/one_shot.hpp>
#include <forkpool/runtime/internal/io.hpp>
#include <forkpool/runtime/internal/spawned_worker.hpp>
#include <forkpool/runtime/internal/loaded_objects.hpp>
#include <forkpool/runtime/internal/loop_internals.hpp>
#include <forkpool/runtime/scope.hpp>
#include <forkpool/shm/internal/name_tracker.hpp>

namespace forkpool::detail {
namespace {

// Jobs a worker holds at once: the one it runs and the next, so it never waits for the parent.
constexpr std::size_t kJobsPerWorker = 2;
// A cancel mark must outlive every job the worker may still take up (RunningSlot).
static_assert(RunningSlot::kCancelMarks >= 2 * kJobsPerWorker);
// Workers in a row whose initializer threw before the pool gives up and fails its work with the
// InitializerError (Python's pool would start new ones for ever).
constexpr int kMaxInitializerFailures = 3;
// A job whose worker dies before taking it up goes again at no cost, on the worker's word (its
// RunningSlot), which a task can forge. Past this many such deaths it is charged as if it ran.
constexpr int kMaxFreeRequeues = 16;

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

// Tells the worker at the other end of `line` which of its blocks were let go here and which
// of our slabs are gone. Never blocks: what the socket cannot take now goes with a later call.
// Safe on any thread.
void send_release(PeerMemory& memory, Channel& line) {
  PeerMemory::Release release = memory.take_release();
  if (release.empty()) return;
  try {
    if (line.try_send(kReleaseMessage, 0, release.encode().bytes())) return;
  } catch (const ChannelClosed&) {
    return;  // the worker is exiting: it unmaps everything
  } catch (const std::exception&) {
    // kept for later
  }
  memory.restore(std::move(release));
}

}  // namespace

class PoolCoreImpl final : public PoolCore, public std::enable_shared_from_this<PoolCoreImpl> {
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
  void close() override;
  void terminate() override;
  Task<void> join() override;
  int processes() const noexcept override { return processes_; }
  bool terminated() const noexcept override { return terminated_; }
  std::vector<pid_t> worker_pids() const override;
  UniqueFd worker_pidfd(pid_t pid) const override;
  void shut_down() override;

 private:
  struct Worker;
  struct WorkerStart;
  void launch_workers(int count);
  void serve_started(WorkerStart& start);
  int free_worker_id(const std::vector<int>& starting);
  void replenish();
  void dispatch();
  std::shared_ptr<Worker> pick_worker();
  void retire_if_idle(Worker& worker);
  void on_worker_gone(const std::shared_ptr<Worker>& worker);
  void fail_queue(const std::exception_ptr& error);
  void handle_reply(Worker& worker, Message& message);
  void reject(Worker& worker, std::exception_ptr error);
  void cancel(const JobSink* sink) override;
  void stop_running_job(Worker& worker, std::uint64_t id, std::exception_ptr reason);
  Task<void> enforce_task_timeout();
  std::vector<const LoadedObject*> objects_to_introduce(const Worker& worker, const ByteBuffer& payload);
  Task<void> serve(std::shared_ptr<Worker> worker);
  Task<void> watch(std::shared_ptr<Worker> worker);
  Task<void> send_outbox(std::shared_ptr<Worker> worker);
  Task<void> send(std::shared_ptr<Worker> worker, std::shared_ptr<Job> job, std::uint64_t id);
  bool send_at_once(Worker& worker, Job& job, std::uint64_t id);
  Task<void> relay_wakes(std::shared_ptr<Worker> worker);
  static void send_release_now(Worker& worker);
  std::uint64_t worker_spin_polls() const override;

  PoolOptions options_;
  std::string process_name_;  // non-empty: the workers are Processes
  bool jobs_die_with_worker_;  // PoolCore::create
  int processes_;
  std::unique_ptr<Launcher> launcher_;
  std::vector<std::shared_ptr<Worker>> workers_;
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
  std::unordered_map<std::uint64_t, std::optional<LoadedObject>> object_by_address_;  // of task functions
  Scope background_;  // each worker's serve(), watch() and send_outbox()
};

struct PoolCoreImpl::Worker {
  int index = 0;
  SpawnedWorker process;
  std::optional<Channel> channel;
  std::unique_ptr<ParentLink> link;  // its messages: the rings, and the socket for descriptors
  std::stop_source wake_stop;        // ends the link's watch_wakes() once the worker is gone
  std::map<std::uint64_t, std::shared_ptr<Job>> in_flight;  // by request id
  std::shared_ptr<PeerMemory> memory = std::make_shared<PeerMemory>();  // the slabs and blocks we share
  std::shared_ptr<Channel> release_line;  // its socket again, for releases sent from any thread
  // Jobs to send, in order: a job may rely on a slab an earlier one introduced, and two sends in
  // flight at once could overtake each other when the socket is full.
  std::deque<std::pair<std::uint64_t, std::shared_ptr<Job>>> outbox;
  bool sending = false;
  int assigned = 0;
  bool retiring = false;        // takes no more jobs (maxtasksperchild reached)
  bool write_closed = false;    // told to exit once idle
  std::exception_ptr failure;   // it broke the protocol: why its running job fails
  std::exception_ptr initializer_error;  // its initializer threw
  bool ready = false;           // its initializer succeeded (kReadyMessage): no error can be the initializer's
  std::uint64_t last_replied = 0;  // the highest request id it answered
  Mapping running_slot;         // RunningSlot: which job it has taken up
  Clock::time_point running_since;  // when its oldest job in flight started (task_timeout)
  std::uint64_t stopped_job = 0;    // killed by us to stop this job (cancel, task_timeout)
  std::exception_ptr stop_reason;   // why, when the job is still wanted (TimeoutError)
  std::set<std::uintptr_t> objects_sent;  // objects it was told to load (objects_to_introduce)
  ExitStatus status;
  OneShot exited;

  RunningSlot& slot() const noexcept { return *reinterpret_cast<RunningSlot*>(running_slot.data()); }
};

PoolCore::PoolCore() : owner_thread_(std::this_thread::get_id()), owner_pid_(current_pid()) {}

bool PoolCore::in_owner_process() const noexcept { return current_pid() == owner_pid_; }



void PoolCore::check_owner(const char* who) const {
  if (!in_owner_process())
    throw std::logic_error(std::string("forkpool: ") + who + " called in a forked child: a Pool belongs to the process that made it");
  if (std::this_thread::get_id() != owner_thread_)
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
    : options_(std::move(options)), process_name_(std::move(process_name)),
      jobs_die_with_worker_(jobs_die_with_worker || !process_name_.empty()), processes_(options_.processes > 0 ? options_.processes : default_processes()) {
  if (options_.processes < 0) throw std::invalid_argument("forkpool: PoolOptions::processes must be >= 0");
  if (options_.maxtasksperchild < 0) throw std::invalid_argument("forkpool: PoolOptions::maxtasksperchild must be >= 0");
  if (options_.max_retries < 0) throw std::invalid_argument("forkpool: PoolOptions::max_retries must be >= 0");
  if (options_.task_timeout < std::chrono::nanoseconds::zero())
    throw std::invalid_argument("forkpool: PoolOptions::task_timeout must be >= 0");
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
}

// The lowest id no live worker holds, nor one being started (`starting`): a replacement takes
// the id of the worker it replaces.
int PoolCoreImpl::free_worker_id(const std::vector<int>& starting) {
  for (int id = 0;; ++id) {
    bool held = std::any_of(workers_.begin(), workers_.end(), [&](const auto& w) { return w->index == id; }) ||
                std::find(starting.begin(), starting.end(), id) != starting.end();
    if (held) continue;
    if (static_cast<std::size_t>(id) >= generations_.size()) generations_.resize(id + 1, 0);
    return id;
  }
}

// What the parent makes for a worker before it starts, and keeps or hands over after.
struct PoolCoreImpl::WorkerStart {
  std::shared_ptr<Worker> worker = std::make_shared<Worker>();
  Channel ours{UniqueFd()};
  UniqueFd slot;  // where the worker will say which job it runs: its first message carries it
  LinkResources link;
  Mapping rings;
  std::uint64_t seed = 0;
};

// Starts `count` workers whose start-ups overlap (a spawned worker's is a run of the program up
// to forkpool::init()). Those that start are served even when others fail; then the first
// failure is thrown.
void PoolCoreImpl::launch_workers(int count) {
  std::vector<WorkerStart> starts(count);
  std::vector<Launcher::Launch> launches(count);
  std::vector<int> ids;
  for (int i = 0; i < count; ++i) {
    WorkerStart& start = starts[i];
    auto [ours, theirs] = Channel::make_pair();
    start.ours = std::move(ours);
    start.slot = create_memfd("forkpool-running-slot", kRunningSlotBytes);
    seal_size(start.slot.get());
    start.link = LinkResources::create();
    start.rings = map_link_rings(start.link.rings.get());
    start.worker->running_slot = Mapping::map(start.slot.get(), kRunningSlotBytes, PROT_READ | PROT_WRITE);
    start.worker->index = free_worker_id(ids);
    ids.push_back(start.worker->index);
    start.seed = worker_seed(seed_base_, start.worker->index, generations_[start.worker->index]++);
    launches[i] = {start.worker->index, theirs.release(), {}, nullptr};
  }
  launcher_->spawn_all(launches);
  std::exception_ptr first_failure;
  for (int i = 0; i < count; ++i) {
    try {
      if (launches[i].error) std::rethrow_exception(launches[i].error);
      starts[i].worker->process = std::move(launches[i].process);
      serve_started(starts[i]);
    } catch (...) {
      if (!first_failure) first_failure = std::current_exception();
    }
  }
  if (first_failure) std::rethrow_exception(first_failure);
}

void PoolCoreImpl::serve_started(WorkerStart& start) {
  std::shared_ptr<Worker>& worker = start.worker;
  worker->channel.emplace(start.ours.release());
  int hello_fds[] = {start.slot.get(), start.link.rings.get(), start.link.worker_wake.get(), start.link.parent_wake.get()};
  worker->link = std::make_unique<ParentLink>(*worker->channel, std::move(start.rings), std::move(start.link.parent_wake),
                                              std::move(start.link.worker_wake), options_.spin);
  workers_.push_back(worker);
  background_.start(watch(worker));  // from here on its death is noticed, whatever fails below
  background_.start(relay_wakes(worker));
  try {
    // The sharing strategy of now: a worker from a fork server started earlier has that one's.
    std::int64_t spin = options_.spin ? options_.spin->count() : -1;
    Writer hello = encode(std::tuple<int, int, std::uint64_t, SharingStrategy, std::int64_t, std::int32_t>(
        worker->index, processes_, start.seed, get_sharing_strategy(), spin, static_cast<std::int32_t>(getpid())));
    worker->channel->send(kHelloMessage, 0, hello.bytes(), hello_fds);  // an empty socket: no wait
    // A block let go here, on any thread, goes home to the worker at once. The line owns its
    // own descriptor, so it stays valid however the release races with the worker's end.
    worker->release_line = std::make_shared<Channel>(duplicate_fd(worker->channel->fd()));
  } catch (...) {
    worker->write_closed = true;  // never picked for a job
    send_signal(worker->process.pidfd.get(), SIGKILL);
    background_.start(serve(worker));  // reads to end-of-file, then lets the worker go
    throw;
  }
  // On the pool's thread a release takes the ring, in order with the next task (which may want
  // the block back); elsewhere the socket, at once.
  // (The memory may outlive this core: the callback holds nothing of it.)
  worker->memory->on_release_due([line = worker->release_line, weak = std::weak_ptr<Worker>(worker),
                                  thread = std::this_thread::get_id(), pid = current_pid()](PeerMemory& memory) {
    if (std::this_thread::get_id() == thread && current_pid() == pid)
      if (std::shared_ptr<Worker> alive = weak.lock()) return send_release_now(*alive);
    send_release(memory, *line);
  });
  background_.start(serve(worker));
}

Task<void> PoolCoreImpl::relay_wakes(std::shared_ptr<Worker> worker) {
  co_await worker->link->watch_wakes(worker->wake_stop.get_token());
}

// On the pool's thread: through the ring when it has room, else the socket.
void PoolCoreImpl::send_release_now(Worker& worker) {
  PeerMemory::Release release = worker.memory->take_release();
  if (release.empty()) return;
  if (worker.link->try_send_now(kReleaseMessage, 0, release.encode().bytes())) return;
  worker.memory->restore(std::move(release));
  send_release(*worker.memory, *worker.release_line);
}

std::uint64_t PoolCoreImpl::worker_spin_polls() const {
  std::uint64_t polls = 0;
  for (auto& w : workers_) polls += w->link->worker_spin_polls();
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

std::shared_ptr<PoolCoreImpl::Worker> PoolCoreImpl::pick_worker() {
  std::shared_ptr<Worker> best;
  for (auto& w : workers_) {
    if (w->retiring || w->write_closed || w->failure || w->exited.is_set()) continue;
    if (w->in_flight.size() >= kJobsPerWorker) continue;
    if (!best || w->in_flight.size() < best->in_flight.size()) best = w;
  }
  return best;
}

void PoolCoreImpl::dispatch() {
  if (terminated_) return;
  while (!queue_.empty()) {
    if (queue_.front()->sink->abandoned()) {
      queue_.pop_front();  // its map has failed: nobody wants what it would compute
      continue;
    }
    std::shared_ptr<Worker> worker = pick_worker();
    if (!worker) break;
    std::shared_ptr<Job> job = std::move(queue_.front());
    queue_.pop_front();
    std::uint64_t id = ++next_request_id_;
    if (worker->in_flight.empty()) worker->running_since = Clock::now();  // it starts this one at once
    worker->in_flight.emplace(id, job);
    worker->link->set_expecting(true);
    if (options_.maxtasksperchild > 0 && ++worker->assigned >= options_.maxtasksperchild) worker->retiring = true;
    if (!worker->sending && send_at_once(*worker, *job, id)) continue;
    worker->outbox.emplace_back(id, std::move(job));
    if (!worker->sending) background_.start(send_outbox(std::move(worker)));
  }
  if (closed_)
    for (auto& w : workers_) retire_if_idle(*w);
}

void PoolCoreImpl::retire_if_idle(Worker& worker) {
  if (!closed_ || open_streams_ > 0 || !queue_.empty() || !worker.in_flight.empty() || worker.write_closed) return;
  worker.write_closed = true;
  worker.channel->shutdown_write();  // the worker sees end-of-file and exits
}

Task<void> PoolCoreImpl::send_outbox(std::shared_ptr<Worker> worker) {
  worker->sending = true;
  while (!worker->outbox.empty()) {
    auto [id, job] = std::move(worker->outbox.front());
    worker->outbox.pop_front();
    if (job->sink->abandoned()) {
      worker->in_flight.erase(id);
      continue;
    }
    co_await send(worker, std::move(job), id);
  }
  worker->sending = false;
}

Task<void> PoolCoreImpl::send(std::shared_ptr<Worker> worker, std::shared_ptr<Job> job, std::uint64_t id) {
  send_release_now(*worker);
  // The worker keeps slabs mapped: only those new to it are introduced, with their descriptors.
  std::optional<PeerMemory::Introduction> introduction = worker->memory->lend(job->root().blocks);
  std::exception_ptr send_error;
  ParentLink& link = *worker->link;
  try {
    for (const LoadedObject* object : objects_to_introduce(*worker, job->payload)) {
      co_await link.async_send(kLoadObjectMessage, 0, encode_object(*object).bytes());
      worker->objects_sent.insert(object->base);  // only once it went out: a failed send says it again
    }
    if (introduction) {
      co_await link.async_send(kSlabMessage, 0, introduction->payload.bytes(), introduction->fds);
      introduction.reset();  // the worker knows those slabs now, whatever becomes of the task
    }
    co_await link.async_send(kTaskMessage, id, job->payload, job->root().attachments.fds());
  } catch (const ChannelClosed&) {
    // The worker died: its death fails or retries this job.
  } catch (const ProtocolError&) {
    reject(*worker, std::current_exception());  // it broke its ring: its death fails this job
  } catch (...) {
    send_error = std::current_exception();
  }
  if (!send_error) co_return;
  // The job could not be sent (a descriptor limit, say): it fails alone, the worker carries on,
  // without the blocks it was to be lent.
  worker->memory->unlend(job->root().blocks, introduction);
  auto it = worker->in_flight.find(id);
  if (it == worker->in_flight.end()) co_return;
  worker->in_flight.erase(it);
  link.set_expecting(!worker->in_flight.empty());
  job->sink->chunk_failed(job->chunk, send_error);
  dispatch();
}

// The common case without a coroutine: a task that needs nothing introduced first (no new
// slab, no object to load, no descriptor) goes into the ring now. False: send() does it all.
bool PoolCoreImpl::send_at_once(Worker& worker, Job& job, std::uint64_t id) {
  if (!job.root().attachments.fds().empty()) return false;
  try {
    if (!objects_to_introduce(worker, job.payload).empty()) return false;
  } catch (const Error&) {
    return false;  // send() fails the job with it
  }
  send_release_now(worker);
  std::optional<PeerMemory::Introduction> introduction = worker.memory->lend(job.root().blocks);
  if (!introduction && worker.link->try_send_now(kTaskMessage, id, job.payload)) return true;
  worker.memory->unlend(job.root().blocks, introduction);  // send() lends them again
  return false;
}

// A task names its functions by address. A function in an object the parent loaded after
// forking the worker (a plugin dlopen()ed later) is not at that address there: the worker is
// told to load the object first, and translates. Throws Error for code in no object.
std::vector<const LoadedObject*> PoolCoreImpl::objects_to_introduce(const Worker& worker, const ByteBuffer& payload) {
  std::vector<const LoadedObject*> objects;
  for (std::uint64_t address : task_code_addresses(payload)) {
    if (address == 0) continue;  // a captureless lambda: rebuilt from its type
    auto cached = object_by_address_.find(address);
    if (cached == object_by_address_.end()) cached = object_by_address_.emplace(address, object_at(address)).first;
    const std::optional<LoadedObject>& object = cached->second;
    if (!object)
      throw Error("forkpool: the task's function at " + std::to_string(address) +
                  " is in no loaded object (code made at run time cannot be sent to a worker)");
    if (worker.process.objects->contains(object->base) || worker.objects_sent.contains(object->base)) continue;
    if (std::find(objects.begin(), objects.end(), &*object) == objects.end()) objects.push_back(&*object);
  }
  return objects;
}

Task<void> PoolCoreImpl::serve(std::shared_ptr<Worker> worker) {
  auto self = shared_from_this();  // the core outlives every coroutine that uses it
  ParentLink& link = *worker->link;
  for (;;) {
    std::optional<Message> message;
    try {
      message = link.try_receive();
    } catch (const ChannelClosed&) {
      break;  // the worker is gone and everything it sent is read
    } catch (...) {
      // A broken ring or frame: nothing more is read from it until the worker is gone.
      reject(*worker, std::current_exception());
      continue;
    }
    if (!message) {
      co_await link.arrival();
      continue;
    }
    if (!worker->failure) handle_reply(*worker, *message);
  }
  co_await worker->exited;
  on_worker_gone(worker);
}

// One rule for a worker that breaks the protocol: it is killed and replaced, the job it ran
// fails with the error, and nothing it sends afterwards is read.
void PoolCoreImpl::reject(Worker& worker, std::exception_ptr error) {
  if (worker.failure) return;
  worker.failure = std::move(error);
  send_signal(worker.process.pidfd.get(), SIGKILL);
}

void PoolCoreImpl::handle_reply(Worker& worker, Message& message) {
  if (message.request_id == 0 && (message.kind == kErrorMessage || message.kind == kReadyMessage)) {
    // Only before its first task can a worker speak of its initializer; later, only a task can
    // have sent this, and it must not steer the pool (count as the initializer failing).
    if (worker.ready || worker.initializer_error) {
      reject(worker, std::make_exception_ptr(ProtocolError(
                         "forkpool: worker " + std::to_string(worker.process.pid) +
                         " spoke of its initializer after it had succeeded (a task wrote to the pool's socket)")));
      return;
    }
    if (message.kind == kReadyMessage) {
      worker.ready = true;
      return;
    }
    try {
      worker.initializer_error = decode_exception<InitializerError>(message.payload.bytes(), worker.process.pid);
    } catch (...) {
      reject(worker, std::current_exception());
    }
    return;  // the worker exits; on_worker_gone decides what follows
  }
  if (message.kind == kSlabMessage || message.kind == kReleaseMessage) {
    try {
      if (message.kind == kSlabMessage) worker.memory->accept_introduction(message.payload.bytes(), message.fds);
      else worker.memory->accept_release(message.payload.bytes());
    } catch (...) {
      reject(worker, std::current_exception());
    }
    return;
  }
  auto it = worker.in_flight.find(message.request_id);
  if (it == worker.in_flight.end()) {
    reject(worker, std::make_exception_ptr(ProtocolError("forkpool: worker " + std::to_string(worker.process.pid) +
                                                         " answered unknown request " +
                                                         std::to_string(message.request_id))));
    return;
  }
  std::shared_ptr<Job> job = std::move(it->second);
  worker.in_flight.erase(it);
  worker.link->set_expecting(!worker.in_flight.empty());
  worker.last_replied = std::max(worker.last_replied, message.request_id);
  if (!worker.in_flight.empty()) worker.running_since = Clock::now();  // it has taken up the next
  try {
    if (message.kind == kResultMessage) {
      ResultLayout result = parse_result(message.payload.bytes());
      worker.memory->accept_release(result.release);  // the job still holds what it lent
      IncomingBlocks blocks = worker.memory->accept_blocks(result.results.table);
      Reader results(result.results.body, message.fds, &blocks);
      job->sink->chunk_done(job->chunk, job->range, results);
      initializer_failures_ = 0;  // a worker that serves proves the initializer can succeed
    } else if (message.kind == kErrorMessage) {
      job->sink->chunk_failed(job->chunk, decode_exception<RemoteError>(message.payload.bytes(), worker.process.pid));
      initializer_failures_ = 0;
    } else {
      throw ProtocolError("forkpool: worker " + std::to_string(worker.process.pid) + " sent a message of unknown kind " +
                          std::to_string(message.kind));
    }
  } catch (const ProtocolError&) {
    job->sink->chunk_failed(job->chunk, std::current_exception());
    reject(worker, std::current_exception());
  } catch (...) {
    job->sink->chunk_failed(job->chunk, std::current_exception());
  }
  job.reset();  // may let go of blocks
  send_release_now(worker);  // with any the socket could not take earlier
  dispatch();  // after close(), this also retires the worker once it is idle
}

Task<void> PoolCoreImpl::watch(std::shared_ptr<Worker> worker) {
  auto self = shared_from_this();
  co_await wait_process_exit(worker->process.pidfd.get());
  try {
    worker->status = launcher_->reap(worker->process);
  } catch (const std::exception&) {
    worker->status = {};  // the fork server is gone: the status is unknown
  }
  // Whatever the worker sent before dying is still read; then the reader sees end-of-file even
  // if a grandchild kept the worker's end of the socket open.
  worker->channel->shutdown_read();
  worker->link->peer_gone();
  worker->exited.set();
}

void PoolCoreImpl::on_worker_gone(const std::shared_ptr<Worker>& worker) {
  std::erase(workers_, worker);
  worker->wake_stop.request_stop();
  worker->memory->peer_gone();
  if (worker->initializer_error && ++initializer_failures_ >= kMaxInitializerFailures) broken_ = worker->initializer_error;

  // Only jobs the worker took up ran; the others never started and go back to the front of the
  // queue, in order, at no cost to their retries (RunningSlot).
  RunningSlot& slot = worker->slot();
  std::uint64_t last_taken = slot.request_id.load();
  // A worker takes its jobs in order: one that answered a later job than it claims to have taken
  // up lied (a task wrote the slot), and none of its jobs goes again for free.
  bool slot_forged = last_taken < worker->last_replied;
  std::vector<std::pair<std::shared_ptr<Job>, std::exception_ptr>> failed;
  std::deque<std::shared_ptr<Job>> requeued;
  for (auto& [id, job] : worker->in_flight) {
    if (terminated_) {
      failed.emplace_back(job, std::make_exception_ptr(PoolTerminated()));
    } else if (jobs_die_with_worker_) {
      // A Process (or a rank) is its worker: its end is the task's, whether it took the task up or not.
      failed.emplace_back(job, std::make_exception_ptr(WorkerLost(worker->process.pid, worker->status.exit_code,
                                                                  worker->status.signal)));
    } else if (id == worker->stopped_job && worker->stop_reason) {
      failed.emplace_back(job, worker->stop_reason);  // ran past task_timeout: not retried
    } else if ((id > last_taken && !slot_forged && job->free_requeues++ < kMaxFreeRequeues) ||
               job->sink->abandoned() || worker->stopped_job) {
      // Never started, or not wanted any more (dropped at dispatch), or it lost its worker only
      // because we stopped another job there.
      requeued.push_back(job);
    } else if (worker->failure) {
      failed.emplace_back(job, worker->failure);
    } else if (job->attempts < options_.max_retries) {
      if (id == last_taken && job->range.size() > 1) {
        // Only the element that was running is charged; the others go again at no cost.
        std::uint64_t running = std::clamp<std::uint64_t>(slot.element.load(), job->range.first, job->range.end - 1);
        if (running > job->range.first) requeued.push_back(job_part(job, job->range.first, running));
        auto culprit = job_part(job, running, running + 1);
        culprit->attempts = job->attempts + 1;
        requeued.push_back(std::move(culprit));
        if (running + 1 < job->range.end) requeued.push_back(job_part(job, running + 1, job->range.end));
      } else {
        ++job->attempts;
        requeued.push_back(job);
      }
    } else {
      failed.emplace_back(job, std::make_exception_ptr(WorkerLost(worker->process.pid, worker->status.exit_code,
                                                                  worker->status.signal)));
    }
  }
  worker->in_flight.clear();
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
    RunningSlot& slot = w->slot();
    for (auto& [id, job] : w->in_flight) {
      if (job->sink.get() != sink) continue;
      slot.mark_cancelled(id);  // first (see RunningSlot): not yet taken up, it is skipped
      if (slot.request_id.load() == id) stop_running_job(*w, id, nullptr);
    }
  }
  dispatch();  // drops its queued jobs
}

void PoolCoreImpl::stop_running_job(Worker& worker, std::uint64_t id, std::exception_ptr reason) {
  if (worker.stopped_job || worker.exited.is_set()) return;
  worker.stopped_job = id;
  worker.stop_reason = std::move(reason);
  send_signal(worker.process.pidfd.get(), SIGKILL);
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
      if (w->in_flight.empty() || w->stopped_job || w->exited.is_set()) continue;
      Clock::time_point deadline = saturating_add(w->running_since, timeout);
      if (deadline > now) {
        wake = std::min(wake, deadline);
        continue;
      }
      std::uint64_t running = w->in_flight.begin()->first;  // its oldest: the one it runs
      stop_running_job(*w, running,
                       std::make_exception_ptr(TimeoutError(
                           "forkpool: the task ran longer than task_timeout (" +
                           std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(timeout).count()) +
                           " ms); worker " + std::to_string(w->process.pid) + " was killed")));
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
  for (auto& w : workers_) send_signal(w->process.pidfd.get(), SIGKILL);
}

Task<void> PoolCoreImpl::join() {
  if (!closed_) throw std::logic_error("forkpool: Pool::join() called before close() or terminate()");
  auto self = shared_from_this();
  co_await all_exited_;
}

void PoolCoreImpl::shut_down() {
  terminate();
  Loop& loop = Loop::current();
  if (LoopInternals::driving(loop)) {
    // Inside a coroutine: run() waits for the reaping before it returns.
    auto wait_for_workers = [](std::shared_ptr<PoolCoreImpl> self) -> Task<void> { co_await self->background_.join(); };
    LoopInternals::finish_before_return(loop, wait_for_workers(shared_from_this()));
  } else {
    LoopInternals::DriveGuard guard(loop, "forkpool::Pool::~Pool");
    LoopInternals::drive_until(loop, [this] { return background_.active() == 0; });
  }
}

UniqueFd PoolCoreImpl::worker_pidfd(pid_t pid) const {
  for (auto& w : workers_)
    if (w->process.pid == pid) return duplicate_fd(w->process.pidfd.get());
  return {};
}

std::vector<pid_t> PoolCoreImpl::worker_pids() const {
  std::vector<pid_t> pids;
  for (auto& w : workers_)
    if (!w->exited.is_set()) pids.push_back(w->process.pid);
  return pids;
}

}  // namespace forkpool::detail
