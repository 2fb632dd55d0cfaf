#pragma once
// PoolWorker: the parent's side of its conversation with one worker process. It says hello,
// sends jobs in order (objects to load and new slabs introduced first, through the link's ring
// or socket), reads the replies and hands each result to its job's sink, and notices the
// worker's death. It does not know the queue, nor what becomes of a job whose worker died:
// it tells its WorkerEvents, and the pool core (pool_core.cpp) decides.
//
// Everything here runs on the pool's thread, except the release line, which any thread may use.

#include <sys/types.h>

#include <array>
#include <chrono>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <optional>
#include <set>
#include <stop_token>
#include <unordered_map>
#include <utility>
#include <vector>

#include <forkpool/ipc/internal/channel.hpp>
#include <forkpool/ipc/private/link.hpp>
#include <forkpool/ipc/internal/mapping.hpp>
#include <forkpool/pool/internal/job.hpp>
#include <forkpool/worker/private/launcher.hpp>
#include <forkpool/shm/private/peer_memory.hpp>
#include <forkpool/worker/internal/protocol.hpp>
#include <forkpool/runtime/private/loaded_objects.hpp>
#include <forkpool/runtime/internal/one_shot.hpp>
#include <forkpool/runtime/private/process.hpp>
#include <forkpool/runtime/scope.hpp>

namespace forkpool::detail {

class PoolWorker;

// What a PoolWorker tells the pool core. Called on the pool's thread.
class WorkerEvents {
 public:
  // A job left the worker: its sink has its result or its error (`served`: the worker ran it
  // and answered; false: it could not be sent, or the reply was malformed). The worker may
  // take another.
  virtual void job_finished(PoolWorker& worker, bool served) = 0;
  // Around a drain of the worker's replies: what the core sends meanwhile leaves at the release,
  // so that a burst of replies costs one publication per worker (PoolCore::hold_sends).
  virtual void hold_sends() = 0;
  virtual void release_sends() = 0;
  // The worker is reaped and everything it sent is read. Its jobs still in flight are in
  // `worker.in_flight()`, for the core to fail or run again.
  virtual void worker_gone(const std::shared_ptr<PoolWorker>& worker) = 0;

 protected:
  ~WorkerEvents() = default;
};

// The task functions' objects, shared by a pool's workers: a function in an object the parent
// loaded after forking a worker (a plugin dlopen()ed later) is not at that address there, so the
// worker is told to load the object first.
class CodeObjects {
 public:
  // The objects `task` names that `worker` has not loaded. Throws Error for code in no object.
  std::vector<const LoadedObject*> to_introduce(const PoolWorker& worker, std::span<const std::byte> task);

 private:
  std::unordered_map<std::uint64_t, std::optional<LoadedObject>> by_address_;
};

// Jobs sent to a worker and not answered, oldest first (ids rise in sending order). Answers come
// oldest first as a rule: answering the oldest moves nothing (a deep window holds up to 1024 jobs), and a
// worker given one job at a time allocates nothing.
class JobsInFlight {
 public:
  using Entry = std::pair<std::uint64_t, std::shared_ptr<Job>>;
  using iterator = std::vector<Entry>::iterator;
  using const_iterator = std::vector<Entry>::const_iterator;

  iterator begin() noexcept { return entries_.begin() + static_cast<std::ptrdiff_t>(head_); }
  iterator end() noexcept { return entries_.end(); }
  const_iterator begin() const noexcept { return entries_.begin() + static_cast<std::ptrdiff_t>(head_); }
  const_iterator end() const noexcept { return entries_.end(); }
  std::size_t size() const noexcept { return entries_.size() - head_; }
  bool empty() const noexcept { return entries_.size() == head_; }
  Entry& front() noexcept { return entries_[head_]; }
  const Entry& front() const noexcept { return entries_[head_]; }
  Entry& back() noexcept { return entries_.back(); }
  void emplace_back(std::uint64_t id, std::shared_ptr<Job> job) { entries_.emplace_back(id, std::move(job)); }
  void erase(iterator it) {
    if (it != begin()) {
      entries_.erase(it);
    } else if (++head_ == entries_.size()) {
      clear();
    } else {
      it->second.reset();
      // The answered front is moved out once it is half the list: a move per answer at most.
      if (head_ >= kCompactFrom && 2 * head_ >= entries_.size()) {
        entries_.erase(entries_.begin(), begin());
        head_ = 0;
      }
    }
  }
  void clear() noexcept {
    entries_.clear();
    head_ = 0;
  }

 private:
  static constexpr std::size_t kCompactFrom = 16;
  std::vector<Entry> entries_;
  std::size_t head_ = 0;  // entries before it are answered
};

class PoolWorker : public std::enable_shared_from_this<PoolWorker> {
 public:
  // What the parent makes for a worker before it starts: its socket, its running slot, its
  // link's rings and eventfds.
  struct Start {
    Channel ours{UniqueFd()};
    UniqueFd theirs;
    UniqueFd slot;
    LinkResources link;
    Mapping rings;
    static Start make();
  };

  PoolWorker(int index, Start& start);

  // Says hello (`hello`, the worker's identity) and starts serving it in `background`. From here
  // on its death is noticed, also when this throws (the worker is then killed).
  void begin(std::shared_ptr<WorkerEvents> events, Launcher& launcher, CodeObjects& objects, Scope& background,
             Start& start, std::span<const std::byte> hello, std::optional<std::chrono::nanoseconds> spin);

  // Sends `job` as request `id`, after the jobs sent before it. A job that cannot be sent fails
  // alone (job_finished with served false). It may wait in the ring until flush(): the core
  // sends a batch, then flushes once.
  // Unless `may_wait_for_room`: then a job the ring has no room for now (or that would queue
  // behind a send that waits) is not taken: false, and the worker counts as full (ring_full)
  // until clear_ring_full(). For sends from plain code, where nothing would resume a wait until
  // the program calls in again: the job waits in the pool's queue, for any worker.
  bool send(std::uint64_t id, std::shared_ptr<Job> job, bool may_wait_for_room = true);
  bool ring_full() const noexcept { return ring_full_; }
  void clear_ring_full() noexcept { ring_full_ = false; }
  // Takes back job `id` if the worker has not taken it up (RunningSlot: the worker then skips
  // it without a reply), to run elsewhere or not at all. Null when it is not in flight here or
  // already taken up.
  std::shared_ptr<Job> withdraw(std::uint64_t id);
  // The same for its newest job (a job pinned to it stays).
  std::shared_ptr<Job> withdraw_newest();
  // Whether request `id` may be sent to it: no job of its that is unsettled (in flight, or
  // withdrawn and not yet passed by the worker) shares its claim word.
  bool claim_word_free(std::uint64_t id) const noexcept;
  // Whether it may be sent a job more: at most half the claim words are unsettled, so a free one
  // is found at once. (Only a worker held up in a task, with many jobs withdrawn from behind it,
  // comes near.)
  bool has_claim_words_left() noexcept;
  // Whether it has jobs in flight, or withdrawn ones it has not passed yet (it has not read the
  // ring since: busy in a job, or stopped).
  bool has_unsettled_work() noexcept;
  // Checks the worker's position in the ring to it, which is otherwise read only when the ring
  // fills (issue 58.9): a worker that broke it is rejected, and what it holds goes elsewhere.
  void check_ring() noexcept;
  // Publishes what send() left in the ring, waking the worker if it sleeps.
  void flush() noexcept;
  // Tells the worker to exit once it has read what it was sent.
  void close_write();
  // Kills the worker; its death is reported as any other.
  void kill();
  // The worker broke the protocol: it is killed, the job it ran fails with `error`, and nothing
  // it sends afterwards is read.
  void reject(std::exception_ptr error);

  int index() const noexcept { return index_; }
  pid_t pid() const noexcept { return process_.pid; }
  const StartedWorker& process() const noexcept { return process_; }
  void set_process(StartedWorker process) { process_ = std::move(process); }
  bool exited() const noexcept { return exited_.is_set(); }
  bool write_closed() const noexcept { return write_closed_; }
  const std::exception_ptr& failure() const noexcept { return failure_; }
  const std::exception_ptr& initializer_error() const noexcept { return initializer_error_; }
  const ExitStatus& status() const noexcept { return status_; }
  using InFlight = JobsInFlight;
  InFlight& in_flight() noexcept { return in_flight_; }
  const InFlight& in_flight() const noexcept { return in_flight_; }
  std::uint64_t last_replied() const noexcept { return last_replied_; }
  RunningSlot& slot() const noexcept { return *reinterpret_cast<RunningSlot*>(running_slot_.data()); }
  std::uint64_t spin_polls() const noexcept { return link_->worker_spin_polls(); }
  bool knows_object(std::uintptr_t base) const {
    return process_.objects->contains(base) || objects_sent_.contains(base);
  }

  // Whether it may be sent jobs: alive, not told to exit, not rejected, not retired.
  bool accepts_jobs() const noexcept { return !retired_ && !write_closed_ && !failure_ && !exited(); }
  // It is sent no more jobs (maxtasksperchild reached: it exits by itself after the last).
  void retire() noexcept { retired_ = true; }
  // Jobs send() was given, withdrawn ones included.
  int jobs_sent() const noexcept { return jobs_sent_; }
  // Stops job `id`, which it runs, by killing it (cancel, task_timeout); `reason`, when the job
  // is still wanted, is its error. Nothing when a job was stopped already or it has exited.
  void stop_job(std::uint64_t id, std::exception_ptr reason);
  // The job stop_job() stopped (0: none), and why.
  std::uint64_t stopped_job() const noexcept { return stopped_job_; }
  const std::exception_ptr& stop_reason() const noexcept { return stop_reason_; }

 private:
  void forget_passed_withdrawn() noexcept;
  // Each background coroutine holds `self`: the worker outlives it.
  Task<void> serve(std::shared_ptr<PoolWorker> self);
  Task<void> watch(std::shared_ptr<PoolWorker> self);
  Task<void> relay_wakes(std::shared_ptr<PoolWorker> self);
  Task<void> send_outbox(std::shared_ptr<PoolWorker> self);
  Task<void> send_one(std::shared_ptr<Job> job, std::uint64_t id);
  bool send_at_once(Job& job, std::uint64_t id);
  void handle_reply(Message& message);
  bool deliver(Job& job, Message& message);
  void send_release_now(ParentLink::Publish publish = ParentLink::Publish::now);

  int index_;
  StartedWorker process_;
  Channel channel_;
  std::unique_ptr<ParentLink> link_;  // its messages: the rings, and the socket for descriptors
  std::stop_source wake_stop_;        // ends the link's watch_wakes() once the worker is gone
  std::shared_ptr<PeerMemory> memory_ = std::make_shared<PeerMemory>();  // the slabs and blocks we share
  std::shared_ptr<Channel> release_line_;  // its socket again, for releases sent from any thread
  Mapping running_slot_;                   // RunningSlot: which job it has taken up
  InFlight in_flight_;
  InFlight::iterator find_in_flight(std::uint64_t id);
  // Jobs withdrawn whose messages the worker may not have read yet: their claim words stay taken
  // until it stores a later request id (has_claim_words_left lets go of them).
  std::vector<std::uint64_t> withdrawn_;
  std::uint64_t oldest_withdrawn_ = 0;  // the least of withdrawn_, when it has any
  // Jobs to send, in order: a job may rely on a slab an earlier one introduced, and two sends in
  // flight at once could overtake each other when the socket is full.
  std::deque<std::pair<std::uint64_t, std::shared_ptr<Job>>> outbox_;
  bool sending_ = false;
  bool ring_full_ = false;     // a send that could not wait found no room (send)
  bool write_closed_ = false;  // told to exit once idle
  bool retired_ = false;       // retire()
  int jobs_sent_ = 0;
  std::uint64_t stopped_job_ = 0;  // stop_job()
  std::exception_ptr stop_reason_;
  std::exception_ptr failure_;             // it broke the protocol: why its running job fails
  std::exception_ptr initializer_error_;   // its initializer threw
  bool ready_ = false;                     // its initializer succeeded: no error can be the initializer's
  std::uint64_t last_replied_ = 0;         // the highest request id it answered
  std::set<std::uintptr_t> objects_sent_;  // objects it was told to load
  // The code addresses of a task it was found to know (what it knows only grows): a run of
  // tasks of one function skips the lookups.
  std::array<std::uint64_t, 2> known_code_{};
  ExitStatus status_;
  OneShot exited_;
  // Set by begin(); the events are dropped once the worker is gone (they own the workers).
  std::shared_ptr<WorkerEvents> events_;
  Launcher* launcher_ = nullptr;
  CodeObjects* objects_ = nullptr;
  Scope* background_ = nullptr;
};

}  // namespace forkpool::detail
