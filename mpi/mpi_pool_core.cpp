#include <forkpool/mpi/private/mpi_pool_core.hpp>

#include <algorithm>
#include <cstdio>
#include <stdexcept>

#include <forkpool/mpi/private/hub.hpp>
#include <forkpool/mpi/private/world.hpp>
#include <forkpool/shm/internal/block_table.hpp>
#include <forkpool/runtime/error.hpp>

namespace forkpool::mpi::detail {
namespace {

using forkpool::detail::ElementRange;
using forkpool::detail::IncomingBlocks;

// Passes a local job's results to its own sink and tells the core when the job has no more to
// give, so that its node can be given another.
class LocalSink final : public JobSink, public std::enable_shared_from_this<LocalSink> {
 public:
  LocalSink(std::shared_ptr<JobSink> target, std::weak_ptr<MpiPoolCore> core, std::uint64_t elements)
      : target_(std::move(target)), core_(std::move(core)), remaining_(elements) {}

  // The node is told first: a coroutine the results resume may submit at once, and should find
  // the worker free.
  void chunk_done(std::size_t chunk, const ElementRange& range, Reader& results) override {
    auto self = shared_from_this();
    remaining_ -= std::min(remaining_, range.size());
    if (remaining_ == 0) finish();
    target_->chunk_done(chunk, range, results);
  }
  void chunk_failed(std::size_t chunk, std::exception_ptr error) override {
    target_->chunk_failed(chunk, std::move(error));
    finish();
  }
  bool abandoned() const override { return target_->abandoned(); }
  const JobSink* target() const noexcept { return target_.get(); }

 private:
  void finish() {
    if (finished_) return;
    finished_ = true;
    if (auto core = core_.lock()) core->local_job_finished(this);
  }

  std::shared_ptr<JobSink> target_;
  std::weak_ptr<MpiPoolCore> core_;
  std::uint64_t remaining_;
  bool finished_ = false;
};

PoolOptions local_options(PoolOptions options) {
  // Workers must come from the fork server init() started before MPI_Init: this process has
  // MPI's threads now, and a fork of it would copy their locks.
  options.start_method = StartMethod::forkserver;
  return options;
}

}  // namespace

std::shared_ptr<MpiPoolCore> MpiPoolCore::create(PoolOptions options) {
  auto core = std::make_shared<MpiPoolCore>(std::move(options));
  core->start_nodes();
  return core;
}

MpiPoolCore::MpiPoolCore(PoolOptions options) : options_(std::move(options)) {
  World& w = world("mpi::Pool");
  if (!w.node_ranks.empty() && options_.initializer && !options_.initializer.plain())
    throw std::invalid_argument(
        "forkpool::mpi::Pool: an initializer with state cannot cross to another machine: use a plain function");
  local_ = forkpool::detail::PoolCore::create(local_options(options_));
  nodes_.push_back({0, local_->processes(), 0, true, true, true});
  for (int rank : w.node_ranks) nodes_.push_back({rank, local_->processes(), 0, false, true, false});
}

MpiPoolCore::~MpiPoolCore() {
  if (id_ != 0) Hub::instance().remove(id_);
}

void MpiPoolCore::start_nodes() {
  if (nodes_.size() == 1) return;
  id_ = Hub::instance().add(this);
  auto initializer = reinterpret_cast<std::uintptr_t>(options_.initializer.plain());
  PoolSettings settings{options_.processes,   options_.maxtasksperchild,
                        options_.max_retries, static_cast<std::int64_t>(options_.task_timeout.count()),
                        options_.seed,        initializer};
  for (std::size_t i = 1; i < nodes_.size(); ++i) {
    Writer w;
    w.write(Kind::open);
    w.write(id_);
    w.write(settings);
    ++awaiting_opened_;
    Hub::instance().send(nodes_[i].rank, std::move(w.buffer()));
  }
}

void MpiPoolCore::submit(std::shared_ptr<Job> job) {
  if (closed_) throw PoolClosed();
  enqueue(std::move(job));
}

void MpiPoolCore::submit_for_stream(std::shared_ptr<Job> job) {
  if (terminated_) throw PoolTerminated();
  enqueue(std::move(job));
}

void MpiPoolCore::stream_opened() {
  if (closed_) throw PoolClosed();
  ++streams_;
  local_->stream_opened();
}

void MpiPoolCore::stream_closed() {
  --streams_;
  local_->stream_closed();
  dispatch();
}

void MpiPoolCore::enqueue(std::shared_ptr<Job> job) {
  pending_.push_back(std::move(job));
  dispatch();
}

std::size_t MpiPoolCore::pick_node(const Job& job) const {
  // The least loaded node with room, by jobs held per worker; this node on a tie (no MPI hop).
  std::size_t best = nodes_.size();
  double best_load = 0;
  std::size_t candidates = job.attachments.fds().empty() ? nodes_.size() : 1;
  for (std::size_t i = 0; i < candidates; ++i) {
    const Node& node = nodes_[i];
    if (!node.usable || node.processes <= 0 || node.in_flight >= 2 * node.processes) continue;
    double load = static_cast<double>(node.in_flight) / node.processes;
    if (best == nodes_.size() || load < best_load) {
      best = i;
      best_load = load;
    }
  }
  return best;
}

void MpiPoolCore::dispatch() {
  while (!pending_.empty() && !terminated_) {
    if (pending_.front()->sink->abandoned()) {
      pending_.pop_front();
      continue;
    }
    std::size_t node = pick_node(*pending_.front());
    if (node == nodes_.size()) break;
    auto job = std::move(pending_.front());
    pending_.pop_front();
    ++nodes_[node].in_flight;
    if (node == 0) {
      auto wrapper = std::make_shared<LocalSink>(job->sink, weak_from_this(), job->range.size());
      local_jobs_[wrapper.get()] = job->sink.get();
      job->sink = std::move(wrapper);
      local_->submit_for_stream(std::move(job));
    } else {
      send_remote(node, job);
    }
  }
  if (closed_ && pending_.empty() && streams_ == 0 && !local_closed_) {
    local_closed_ = true;
    local_->close();
  }
  check_drained();
}

void MpiPoolCore::send_remote(std::size_t node, const std::shared_ptr<Job>& job) {
  std::uint64_t id = next_job_++;
  Writer w;
  w.write(Kind::job);
  w.write(id_);
  w.write(id);
  w.write_size(job->payload.size());
  w.write_bytes(job->payload.data(), job->payload.size());
  auto blocks = job->blocks.storages();
  remote_jobs_[id] = {job, node, job->range.size()};
  try {
    Hub::instance().send(nodes_[node].rank, std::move(w.buffer()), blocks);
  } catch (...) {
    finish_remote(id);
    job->sink->chunk_failed(job->chunk, std::current_exception());
  }
}

void MpiPoolCore::finish_remote(std::uint64_t id) {
  auto it = remote_jobs_.find(id);
  if (it == remote_jobs_.end()) return;
  --nodes_[it->second.node].in_flight;
  remote_jobs_.erase(it);
}

void MpiPoolCore::local_job_finished(const JobSink* wrapper) {
  local_jobs_.erase(wrapper);
  --nodes_[0].in_flight;
  dispatch();
}

void MpiPoolCore::receive(Kind kind, int source, Reader& r) {
  switch (kind) {
    case Kind::opened: on_opened(source, r); break;
    case Kind::done: on_done(source, r); break;
    case Kind::failed: on_failed(r); break;
    case Kind::joined:
      node_of_rank(source).joined = true;
      if (--awaiting_joined_ == 0 && joined_) joined_->set();
      break;
    default: throw ProtocolError("forkpool::mpi: rank 0 was sent a message meant for a node");
  }
  dispatch();
}

MpiPoolCore::Node& MpiPoolCore::node_of_rank(int rank) {
  for (Node& node : nodes_)
    if (node.rank == rank && rank != 0) return node;
  throw ProtocolError("forkpool::mpi: a reply from a rank that runs no node");
}

void MpiPoolCore::on_opened(int source, Reader& r) {
  Node& node = node_of_rank(source);
  auto processes = r.read<std::int32_t>();
  auto error = r.read<std::string>();
  node.opened = true;
  --awaiting_opened_;
  if (!error.empty()) {
    node.usable = false;
    std::fprintf(stderr, "forkpool::mpi: rank %d could not start its pool (%s); its node is left out\n", source,
                 error.c_str());
    return;
  }
  node.processes = processes;
}

void MpiPoolCore::on_done(int source, Reader& r) {
  auto id = r.read<std::uint64_t>();
  auto first = r.read<std::uint64_t>();
  auto end = r.read<std::uint64_t>();
  IncomingBlocks blocks(receive_result_blocks(r, source));
  auto it = remote_jobs_.find(id);
  if (it == remote_jobs_.end()) return;  // cancelled or terminated since
  auto job = it->second.job;
  std::size_t size = r.read_count(1, "result bytes");
  Reader results(r.read_span(size), {}, &blocks);
  try {
    if (first > end || end > job->range.count)
      throw ProtocolError("forkpool::mpi: a result for elements outside its chunk");
    // The node is freed first, as for a local job.
    it->second.remaining -= std::min(it->second.remaining, end - first);
    if (it->second.remaining == 0) finish_remote(id);
    job->sink->chunk_done(job->chunk, ElementRange{job->range.count, first, end}, results);
  } catch (const Error&) {
    finish_remote(id);
    job->sink->chunk_failed(job->chunk, std::current_exception());
  }
}

void MpiPoolCore::on_failed(Reader& r) {
  auto id = r.read<std::uint64_t>();
  ErrorRecord record = read_error(r);
  auto it = remote_jobs_.find(id);
  if (it == remote_jobs_.end()) return;
  auto job = it->second.job;
  finish_remote(id);
  job->sink->chunk_failed(job->chunk, rebuild_error(record));
}

void MpiPoolCore::cancel(const JobSink* sink) {
  std::erase_if(pending_, [sink](const auto& job) { return job->sink.get() == sink; });
  std::vector<const JobSink*> wrappers;
  for (auto [wrapper, target] : local_jobs_)
    if (target == sink) wrappers.push_back(wrapper);
  for (const JobSink* wrapper : wrappers) local_->cancel(wrapper);
  std::vector<std::uint64_t> remote;
  for (const auto& [id, job] : remote_jobs_)
    if (job.job->sink.get() == sink) remote.push_back(id);
  for (std::uint64_t id : remote) {
    Writer w;
    w.write(Kind::cancel);
    w.write(id_);
    w.write(id);
    Hub::instance().send(nodes_[remote_jobs_[id].node].rank, std::move(w.buffer()));
    finish_remote(id);
  }
  dispatch();
}

void MpiPoolCore::close() {
  closed_ = true;
  dispatch();
}

void MpiPoolCore::send_to_nodes(Kind kind) {
  for (std::size_t i = 1; i < nodes_.size(); ++i) {
    Writer w;
    w.write(kind);
    w.write(id_);
    Hub::instance().send(nodes_[i].rank, std::move(w.buffer()));
  }
}

void MpiPoolCore::terminate() {
  if (terminated_) return;
  terminated_ = closed_ = local_closed_ = true;
  local_->terminate();
  auto pending = std::exchange(pending_, {});
  auto remote = std::exchange(remote_jobs_, {});
  for (Node& node : nodes_) node.in_flight = 0;
  if (nodes_.size() > 1) {
    send_to_nodes(Kind::terminate);
    awaiting_joined_ += static_cast<int>(nodes_.size() - 1);
  }
  auto error = std::make_exception_ptr(PoolTerminated());
  for (auto& job : pending) job->sink->chunk_failed(job->chunk, error);
  for (auto& [id, job] : remote) job.job->sink->chunk_failed(job.job->chunk, error);
  check_drained();
}

void MpiPoolCore::check_drained() {
  if (drained_ && pending_.empty() && remote_jobs_.empty() && streams_ == 0) drained_->set();
}

bool MpiPoolCore::awaits_nodes() const noexcept {
  return !remote_jobs_.empty() || awaiting_opened_ > 0 || awaiting_joined_ > 0;
}

Task<void> MpiPoolCore::join() {
  if (!closed_) throw std::logic_error("forkpool: Pool::join() before close() or terminate()");
  auto self = shared_from_this();  // the pool may be dropped while join() runs
  if (!drained_) drained_ = std::make_shared<forkpool::detail::OneShot>();
  auto drained = drained_;
  check_drained();
  co_await *drained;
  if (!terminated_ && !joined_ && nodes_.size() > 1) {
    send_to_nodes(Kind::close);
    awaiting_joined_ += static_cast<int>(nodes_.size() - 1);
  }
  if (!joined_) joined_ = std::make_shared<forkpool::detail::OneShot>();
  auto joined = joined_;
  if (awaiting_joined_ == 0) joined->set();
  co_await local_->join();
  co_await *joined;
}

int MpiPoolCore::processes() const noexcept {
  int total = 0;
  for (const Node& node : nodes_)
    if (node.usable) total += node.processes;
  return total;
}

std::vector<pid_t> MpiPoolCore::worker_pids() const { return local_->worker_pids(); }

void MpiPoolCore::shut_down() {
  if (!on_owner_thread()) {
    // ~Pool on another thread: telling the nodes, failing the pending work and stopping the
    // local workers are the pool's thread's (its MPI calls and its coroutines).
    forkpool::detail::post_shut_down_to_owner(*local_, [self = shared_from_this()] { self->shut_down(); });
    return;
  }
  terminate();
  local_->shut_down();
}

}  // namespace forkpool::mpi::detail
