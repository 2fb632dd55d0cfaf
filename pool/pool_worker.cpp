#include <forkpool/pool/private/pool_worker.hpp>

#include <sys/mman.h>

#include <algorithm>
#include <utility>
#include <csignal>
#include <string>
#include <thread>

#include <forkpool/ipc/private/memfd.hpp>
#include <forkpool/worker/private/launcher.hpp>
#include <forkpool/runtime/error.hpp>
#include <forkpool/runtime/internal/io.hpp>

namespace forkpool::detail {
namespace {

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

std::vector<const LoadedObject*> CodeObjects::to_introduce(const PoolWorker& worker, std::span<const std::byte> task) {
  std::vector<const LoadedObject*> objects;
  for (std::uint64_t address : task_code_addresses(task)) {
    if (address == 0) continue;  // a captureless lambda: rebuilt from its type
    auto cached = by_address_.find(address);
    if (cached == by_address_.end()) cached = by_address_.emplace(address, object_at(address)).first;
    const std::optional<LoadedObject>& object = cached->second;
    if (!object)
      throw Error("forkpool: the task's function at " + std::to_string(address) +
                  " is in no loaded object (code made at run time cannot be sent to a worker)");
    if (worker.knows_object(object->base)) continue;
    if (std::find(objects.begin(), objects.end(), &*object) == objects.end()) objects.push_back(&*object);
  }
  return objects;
}

PoolWorker::Start PoolWorker::Start::make() {
  Start start;
  auto [ours, theirs] = Channel::make_pair();
  start.ours = std::move(ours);
  start.theirs = theirs.release();
  start.slot = create_memfd("forkpool-running-slot", kRunningSlotBytes);
  seal_size(start.slot.get());
  start.link = LinkResources::create();
  start.rings = map_link_rings(start.link.rings.get());
  return start;
}

PoolWorker::PoolWorker(int index, Start& start)
    : index_(index),
      channel_(UniqueFd()),
      running_slot_(Mapping::map(start.slot.get(), kRunningSlotBytes, PROT_READ | PROT_WRITE)) {
  running_slot_.keep_from_forks();  // mapped before its siblings are forked: theirs to forge otherwise
}

void PoolWorker::begin(std::shared_ptr<WorkerEvents> events, Launcher& launcher, CodeObjects& objects,
                       Scope& background, Start& start, std::span<const std::byte> hello,
                       std::optional<std::chrono::nanoseconds> spin) {
  events_ = std::move(events);
  launcher_ = &launcher;
  objects_ = &objects;
  background_ = &background;
  channel_ = std::move(start.ours);
  int hello_fds[] = {start.slot.get(), start.link.rings.get(), start.link.worker_wake.get(),
                     start.link.parent_wake.get()};
  link_ = std::make_unique<ParentLink>(channel_, std::move(start.rings), std::move(start.link.parent_wake),
                                       std::move(start.link.worker_wake), spin);
  std::shared_ptr<PoolWorker> self = shared_from_this();
  background.start(watch(self));  // from here on its death is noticed, whatever fails below
  background.start(relay_wakes(self));
  try {
    channel_.send(kHelloMessage, 0, hello, hello_fds);  // an empty socket: no wait
    // A block let go here, on any thread, goes home to the worker at once. The line owns its
    // own descriptor, so it stays valid however the release races with the worker's end.
    release_line_ = std::make_shared<Channel>(duplicate_fd(channel_.fd()));
  } catch (...) {
    write_closed_ = true;  // never picked for a job
    kill();
    background.start(serve(self));  // reads to end-of-file, then lets the worker go
    throw;
  }
  // On the pool's thread a release takes the ring, in order with the next task (which may want
  // the block back); elsewhere the socket, at once.
  // (The memory may outlive this worker: the callback holds nothing of it.)
  memory_->on_release_due([line = release_line_, weak = weak_from_this(), thread = std::this_thread::get_id(),
                           pid = current_pid()](PeerMemory& memory) {
    if (std::this_thread::get_id() == thread && current_pid() == pid)
      if (std::shared_ptr<PoolWorker> alive = weak.lock()) return alive->send_release_now();
    send_release(memory, *line);
  });
  background.start(serve(self));
}

bool PoolWorker::send(std::uint64_t id, std::shared_ptr<Job> job, bool may_wait_for_room) {
  if (!may_wait_for_room && (sending_ || link_->ring_lacks_room_for(job->payload))) {
    ring_full_ = true;
    return false;
  }
  in_flight_.emplace_back(id, job);
  ++jobs_sent_;
  link_->set_expecting(true);
  if (!sending_ && send_at_once(*job, id)) return true;
  outbox_.emplace_back(id, std::move(job));
  if (!sending_) background_->start(send_outbox(shared_from_this()));
  return true;
}

std::shared_ptr<Job> PoolWorker::withdraw(std::uint64_t id) {
  auto it = find_in_flight(id);
  if (it == in_flight_.end() || exited() || !slot().withdraw(id)) return nullptr;
  oldest_withdrawn_ = withdrawn_.empty() ? id : std::min(oldest_withdrawn_, id);
  withdrawn_.push_back(id);
  std::shared_ptr<Job> job = std::move(it->second);
  in_flight_.erase(it);
  link_->set_expecting(!in_flight_.empty());
  return job;
}

std::shared_ptr<Job> PoolWorker::withdraw_newest() {
  if (in_flight_.empty() || in_flight_.back().second->pinned_worker >= 0) return nullptr;
  return withdraw(in_flight_.back().first);
}

bool PoolWorker::claim_word_free(std::uint64_t id) const noexcept {
  auto same_word = [id](std::uint64_t other) {
    return RunningSlot::claim_index(other) == RunningSlot::claim_index(id);
  };
  // The usual case at a glance: ids rise, so those within the last kClaims use other words (the
  // oldest in flight is the first: they are sent in rising order).
  auto recent = [id](std::uint64_t oldest) { return id - oldest < RunningSlot::kClaims; };
  if ((withdrawn_.empty() || recent(oldest_withdrawn_)) && (in_flight_.empty() || recent(in_flight_.front().first)))
    return true;
  return std::none_of(withdrawn_.begin(), withdrawn_.end(), same_word) &&
         std::none_of(in_flight_.begin(), in_flight_.end(), [&](const auto& entry) { return same_word(entry.first); });
}

void PoolWorker::forget_passed_withdrawn() noexcept {
  if (withdrawn_.empty()) return;
  // Passed: the worker stores the id of each task message before it exchanges that task's claim
  // word, so one it stored a later id for has been settled (an equal one may not be yet).
  std::uint64_t read = slot().request_id.load(std::memory_order_acquire);
  if (oldest_withdrawn_ >= read) return;  // none passed (most calls: no scan)
  std::erase_if(withdrawn_, [read](std::uint64_t id) { return id < read; });
  if (!withdrawn_.empty()) oldest_withdrawn_ = *std::min_element(withdrawn_.begin(), withdrawn_.end());
}

bool PoolWorker::has_claim_words_left() noexcept {
  if (withdrawn_.empty()) return true;  // in flight: a window, far below
  forget_passed_withdrawn();
  return in_flight_.size() + withdrawn_.size() < RunningSlot::kClaims / 2;
}

bool PoolWorker::has_unsettled_work() noexcept {
  if (!in_flight_.empty()) return true;
  forget_passed_withdrawn();
  if (withdrawn_.empty()) return false;
  // The one it stored the id of last it has reached (only its claim word may not be exchanged
  // yet): an idle worker whose newest job was taken back is not held up.
  std::uint64_t read = slot().request_id.load(std::memory_order_acquire);
  return std::any_of(withdrawn_.begin(), withdrawn_.end(), [read](std::uint64_t id) { return id > read; });
}

void PoolWorker::check_ring() noexcept {
  if (failure_ || exited()) return;
  try {
    link_->check_worker_position();
  } catch (...) {
    reject(std::current_exception());
  }
}

PoolWorker::InFlight::iterator PoolWorker::find_in_flight(std::uint64_t id) {
  return std::find_if(in_flight_.begin(), in_flight_.end(), [id](const auto& entry) { return entry.first == id; });
}

void PoolWorker::flush() noexcept { link_->flush(); }

void PoolWorker::close_write() {
  if (write_closed_) return;
  write_closed_ = true;
  channel_.shutdown_write();  // the worker sees end-of-file and exits
}

void PoolWorker::kill() { send_signal(process_.pidfd.get(), SIGKILL); }

void PoolWorker::stop_job(std::uint64_t id, std::exception_ptr reason) {
  if (stopped_job_ || exited()) return;
  stopped_job_ = id;
  stop_reason_ = std::move(reason);
  kill();
}

void PoolWorker::reject(std::exception_ptr error) {
  if (failure_) return;
  failure_ = std::move(error);
  kill();
}

Task<void> PoolWorker::relay_wakes(std::shared_ptr<PoolWorker>) { co_await link_->watch_wakes(wake_stop_.get_token()); }

// On the pool's thread: through the ring when it has room, else the socket.
void PoolWorker::send_release_now(ParentLink::Publish publish) {
  PeerMemory::Release release = memory_->take_release();
  if (release.empty()) return;
  if (link_->try_send_now(kReleaseMessage, 0, release.encode().bytes(), publish)) return;
  memory_->restore(std::move(release));
  send_release(*memory_, *release_line_);
}

Task<void> PoolWorker::send_outbox(std::shared_ptr<PoolWorker>) {
  sending_ = true;
  while (!outbox_.empty()) {
    auto [id, job] = std::move(outbox_.front());
    outbox_.pop_front();
    if (job->sink->abandoned()) {
      if (auto it = find_in_flight(id); it != in_flight_.end()) in_flight_.erase(it);
      continue;
    }
    co_await send_one(std::move(job), id);
  }
  sending_ = false;
}

Task<void> PoolWorker::send_one(std::shared_ptr<Job> job, std::uint64_t id) {
  send_release_now();
  // The worker keeps slabs mapped: only those new to it are introduced, with their descriptors.
  std::optional<PeerMemory::Introduction> introduction = memory_->lend(job->root().blocks);
  std::exception_ptr send_error;
  try {
    for (const LoadedObject* object : objects_->to_introduce(*this, job->payload)) {
      co_await link_->async_send(kLoadObjectMessage, 0, encode_object(*object).bytes());
      objects_sent_.insert(object->base);  // only once it went out: a failed send says it again
    }
    if (introduction) {
      co_await link_->async_send(kSlabMessage, 0, introduction->payload.bytes(), introduction->fds);
      introduction.reset();  // the worker knows those slabs now, whatever becomes of the task
    }
    co_await link_->async_send(kTaskMessage, id, job->payload, job->root().attachments.fds());
  } catch (const ChannelClosed&) {
    // The worker died: its death fails or retries this job.
  } catch (const ProtocolError&) {
    reject(std::current_exception());  // it broke its ring: its death fails this job
  } catch (...) {
    send_error = std::current_exception();
  }
  if (!send_error) co_return;
  // The job could not be sent (a descriptor limit, say): it fails alone, the worker carries on,
  // without the blocks it was to be lent.
  memory_->unlend(job->root().blocks, introduction);
  auto it = find_in_flight(id);
  if (it == in_flight_.end()) co_return;
  in_flight_.erase(it);
  link_->set_expecting(!in_flight_.empty());
  job->sink->chunk_failed(job->chunk, send_error);
  if (events_) events_->job_finished(*this, false);
}

// The common case without a coroutine: a task that needs nothing introduced first (no new
// slab, no object to load, no descriptor) goes into the ring now. False: send_one() does it all.
bool PoolWorker::send_at_once(Job& job, std::uint64_t id) {
  if (!job.root().attachments.fds().empty()) return false;
  try {
    std::array<std::uint64_t, 2> code = task_code_addresses(job.payload);
    if (code != known_code_) {
      if (!objects_->to_introduce(*this, job.payload).empty()) return false;
      known_code_ = code;
    }
  } catch (const Error&) {
    return false;  // send_one() fails the job with it
  }
  send_release_now(ParentLink::Publish::at_flush);
  std::optional<PeerMemory::Introduction> introduction = memory_->lend(job.root().blocks);
  // (A ring the worker broke reads as no room: the breach is reported where its position is read.)
  if (!introduction && link_->try_send_now(kTaskMessage, id, job.payload, ParentLink::Publish::at_flush)) return true;
  memory_->unlend(job.root().blocks, introduction);  // send_one() lends them again
  return false;
}

Task<void> PoolWorker::serve(std::shared_ptr<PoolWorker> self) {
  std::shared_ptr<WorkerEvents> events = events_;  // the core outlives every coroutine that uses it
  // Sends are held while replies are read, and released before waiting for more.
  struct HeldSends {
    WorkerEvents& events;
    bool held = false;
    void hold() {
      if (!std::exchange(held, true)) events.hold_sends();
    }
    void release() {
      if (std::exchange(held, false)) events.release_sends();
    }
    ~HeldSends() { release(); }
  } sends{*events};
  for (;;) {
    std::optional<Message> message;
    try {
      message = link_->try_receive();
    } catch (const ChannelClosed&) {
      break;  // the worker is gone and everything it sent is read
    } catch (...) {
      // A broken ring or frame: nothing more is read from it until the worker is gone.
      reject(std::current_exception());
      continue;
    }
    if (!message) {
      sends.release();
      co_await link_->arrival();
      continue;
    }
    sends.hold();
    if (!failure_) handle_reply(*message);
  }
  sends.release();
  co_await exited_;
  wake_stop_.request_stop();
  memory_->peer_gone();
  events_.reset();  // they hold the workers: no cycle once this one is gone
  events->worker_gone(self);
}

Task<void> PoolWorker::watch(std::shared_ptr<PoolWorker>) {
  std::shared_ptr<WorkerEvents> events = events_;
  co_await wait_process_exit(process_.pidfd.get());
  try {
    status_ = launcher_->reap(process_);
  } catch (const std::exception&) {
    status_ = {};  // the fork server is gone: the status is unknown
  }
  // Whatever the worker sent before dying is still read; then the reader sees end-of-file even
  // if a grandchild kept the worker's end of the socket open.
  channel_.shutdown_read();
  link_->peer_gone();
  exited_.set();
}

void PoolWorker::handle_reply(Message& message) {
  if (message.request_id == 0 && (message.kind == kErrorMessage || message.kind == kReadyMessage)) {
    // Only before its first task can a worker speak of its initializer; later, only a task can
    // have sent this, and it must not steer the pool (count as the initializer failing).
    if (ready_ || initializer_error_) {
      reject(std::make_exception_ptr(
          ProtocolError("forkpool: worker " + std::to_string(pid()) +
                        " spoke of its initializer after it had succeeded (a task wrote to the pool's socket)")));
      return;
    }
    if (message.kind == kReadyMessage) {
      ready_ = true;
      return;
    }
    try {
      initializer_error_ = decode_exception<InitializerError>(message.payload.bytes(), pid());
    } catch (...) {
      reject(std::current_exception());
    }
    return;  // the worker exits; the core decides what follows when it is gone
  }
  if (message.kind == kSlabMessage || message.kind == kReleaseMessage) {
    try {
      if (message.kind == kSlabMessage)
        memory_->accept_introduction(message.payload.bytes(), message.fds);
      else
        memory_->accept_release(message.payload.bytes());
    } catch (...) {
      reject(std::current_exception());
    }
    return;
  }
  auto it = find_in_flight(message.request_id);
  if (it == in_flight_.end()) {
    reject(std::make_exception_ptr(ProtocolError("forkpool: worker " + std::to_string(pid()) +
                                                 " answered unknown request " + std::to_string(message.request_id))));
    return;
  }
  std::shared_ptr<Job> job = std::move(it->second);
  in_flight_.erase(it);
  link_->set_expecting(!in_flight_.empty());
  last_replied_ = std::max(last_replied_, message.request_id);
  bool served = deliver(*job, message);
  job.reset();                                      // may let go of blocks
  send_release_now(ParentLink::Publish::at_flush);  // with any the socket could not take earlier
  events_->job_finished(*this, served);
}

// Hands a reply to its job's sink: the results, or the task's error. False when the reply was
// not one (the sink then has the ProtocolError).
bool PoolWorker::deliver(Job& job, Message& message) {
  try {
    if (message.kind == kResultMessage) {
      ResultLayout result = parse_result(message.payload.bytes());
      // The results' blocks first: the release may let go of a block of ours they return.
      IncomingBlocks blocks = memory_->accept_blocks(result.results.table);
      memory_->accept_release(result.release);
      Reader results(result.results.body, message.fds, &blocks);
      job.sink->chunk_done(job.chunk, job.range, results);
      return true;
    } else if (message.kind == kErrorMessage) {
      job.sink->chunk_failed(job.chunk, decode_exception<RemoteError>(message.payload.bytes(), pid()));
      return true;
    } else {
      throw ProtocolError("forkpool: worker " + std::to_string(pid()) + " sent a message of unknown kind " +
                          std::to_string(message.kind));
    }
  } catch (const ProtocolError&) {
    job.sink->chunk_failed(job.chunk, std::current_exception());
    reject(std::current_exception());
  } catch (...) {
    job.sink->chunk_failed(job.chunk, std::current_exception());  // a result the sink could not take
  }
  return false;
}

}  // namespace forkpool::detail
