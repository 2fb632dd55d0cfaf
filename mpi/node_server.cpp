#include <forkpool/mpi/private/node_server.hpp>

#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <unordered_map>

#include <forkpool/mpi/private/hub.hpp>
#include <forkpool/mpi/private/polling.hpp>
#include <forkpool/mpi/private/protocol.hpp>
#include <forkpool/mpi/private/world.hpp>
#include <forkpool/shm/internal/block_table.hpp>
#include <forkpool/pool/internal/pool_core.hpp>
#include <forkpool/runtime/error.hpp>
#include <forkpool/runtime/private/loaded_objects.hpp>
#include <forkpool/runtime/loop.hpp>

namespace forkpool::mpi::detail {
namespace {

using forkpool::detail::ElementRange;
using forkpool::detail::Job;
using forkpool::detail::JobSink;
using forkpool::detail::OutgoingBlocks;
using forkpool::detail::PoolCore;

class NodeServer;

// A job from rank 0: its results and failure go back to rank 0 as they come.
class ReplySink final : public JobSink {
 public:
  ReplySink(NodeServer& server, std::uint64_t pool, std::uint64_t job, std::uint64_t elements)
      : server_(server), pool_(pool), job_(job), remaining_(elements) {}
  void chunk_done(std::size_t, const ElementRange& range, Reader& results) override;
  void chunk_failed(std::size_t, std::exception_ptr error) override;
  bool abandoned() const override { return cancelled_; }
  void cancel() { cancelled_ = true; }

 private:
  NodeServer& server_;
  std::uint64_t pool_, job_;
  std::uint64_t remaining_;
  bool cancelled_ = false;
};

class NodeServer {
 public:
  explicit NodeServer(World& world) : world_(world) {
    for (const auto& record : world.rank0_objects) objects_.load(forkpool::detail::object_of(record));
  }

  Task<void> serve() {
    co_await poll_with_backoff([this] { return step(); }, [this] { return !stopping_ || world_.transport.sending(); });
    co_await finishing_.join();
  }

  void send(ByteBuffer payload, const std::vector<std::shared_ptr<forkpool::detail::Storage>>& blocks = {}) {
    world_.transport.send(0, std::move(payload), blocks);
  }
  void forget(std::uint64_t pool, std::uint64_t job) {
    if (auto it = pools_.find(pool); it != pools_.end()) it->second.jobs.erase(job);
  }

 private:
  struct LocalPool {
    std::shared_ptr<PoolCore> core;
    std::unordered_map<std::uint64_t, std::shared_ptr<ReplySink>> jobs;
  };

  bool step() {
    bool any = world_.transport.progress();
    while (auto message = world_.transport.try_receive()) {
      any = true;
      try {
        handle(*message);
      } catch (const ProtocolError& e) {
        std::fprintf(stderr, "forkpool::mpi: rank %d dropped a malformed message: %s\n", world_.rank, e.what());
      }
    }
    return any;
  }

  void handle(const Received& message) {
    Reader r(message.payload);
    auto kind = r.read<Kind>();
    if (kind == Kind::shutdown) {
      for (auto& [id, pool] : pools_) pool.core->shut_down();
      pools_.clear();
      stopping_ = true;
      return;
    }
    auto pool = r.read<std::uint64_t>();
    switch (kind) {
      case Kind::open: open(pool, r.read<PoolSettings>()); break;
      case Kind::job: run_job(pool, r); break;
      case Kind::cancel: cancel(pool, r.read<std::uint64_t>()); break;
      case Kind::close:
      case Kind::terminate: finish(pool, kind == Kind::terminate); break;
      default: throw ProtocolError("forkpool::mpi: a node was sent a message meant for rank 0");
    }
  }

  void open(std::uint64_t pool, const PoolSettings& settings) {
    auto [processes, maxtasksperchild, max_retries, timeout, seed, initializer] = settings;
    PoolOptions options;
    options.processes = processes;
    options.maxtasksperchild = maxtasksperchild;
    options.max_retries = max_retries;
    options.task_timeout = std::chrono::nanoseconds(timeout);
    options.seed = seed;
    options.start_method = StartMethod::forkserver;
    Writer w;
    w.write(Kind::opened);
    w.write(pool);
    try {
      if (initializer != 0) options.initializer = reinterpret_cast<void (*)()>(objects_.translate(initializer));
      auto core = PoolCore::create(std::move(options));
      w.write(static_cast<std::int32_t>(core->processes()));
      w.write(std::string());
      pools_[pool].core = std::move(core);
    } catch (const std::exception& e) {
      w.write(std::int32_t{0});
      w.write(std::string(e.what()));
    }
    send(std::move(w.buffer()));
  }

  void run_job(std::uint64_t pool, Reader& r) {
    auto id = r.read<std::uint64_t>();
    std::size_t size = r.read_count(1, "task payload");
    auto payload = r.read_span(size);
    // The blocks follow on the wire whatever becomes of the job: take them in first.
    auto tabled = forkpool::detail::split_block_table(payload);
    std::vector<std::shared_ptr<forkpool::detail::Storage>> storages;
    for (const auto& entry : tabled.table) storages.push_back(new_block(entry.bytes));
    world_.transport.receive_blocks(0, storages);

    auto it = pools_.find(pool);
    auto sink = std::make_shared<ReplySink>(*this, pool, id, 0);
    try {
      if (it == pools_.end())
        throw Error("forkpool::mpi: rank " + std::to_string(world_.rank) +
                    " has no pool for this job (it could not be started)");
      auto job = std::make_shared<Job>();
      job->payload = rebuilt_payload(tabled.body, storages, job->blocks, job->range);
      sink = std::make_shared<ReplySink>(*this, pool, id, job->range.size());
      job->sink = sink;
      it->second.jobs[id] = sink;
      it->second.core->submit(std::move(job));
    } catch (...) {
      sink->chunk_failed(0, std::current_exception());
    }
  }

  // The task message for this rank: rank 0's code addresses translated, and the table naming the
  // blocks received here.
  ByteBuffer rebuilt_payload(std::span<const std::byte> body,
                             const std::vector<std::shared_ptr<forkpool::detail::Storage>>& storages,
                             OutgoingBlocks& blocks, ElementRange& range) {
    forkpool::detail::TaskLayout task = forkpool::detail::parse_task(body);
    auto translated = [&](std::uint64_t address) {
      return address == 0 ? std::uint64_t{0} : std::uint64_t{objects_.translate(address)};
    };
    Writer w;
    forkpool::detail::write_task_head(w, translated(task.invoker), translated(task.function));
    w.write_bytes(task.elements.data(), task.elements.size());
    range = task.range;
    for (const auto& storage : storages) blocks.block_index(storage);
    forkpool::detail::write_task_tail(w, range, blocks);
    return std::move(w.buffer());
  }

  void cancel(std::uint64_t pool, std::uint64_t job) {
    auto it = pools_.find(pool);
    if (it == pools_.end()) return;
    auto found = it->second.jobs.find(job);
    if (found == it->second.jobs.end()) return;
    auto sink = found->second;
    sink->cancel();
    it->second.core->cancel(sink.get());
  }

  // Closes (or terminates) the pool and says joined once its workers are reaped.
  void finish(std::uint64_t pool, bool terminate) {
    std::shared_ptr<PoolCore> core;
    if (auto it = pools_.find(pool); it != pools_.end()) {
      core = it->second.core;
      if (terminate) pools_.erase(it);
    }
    finishing_.start(
        [](NodeServer& server, std::shared_ptr<PoolCore> core, std::uint64_t pool, bool terminate) -> Task<void> {
          if (core) {
            if (terminate)
              core->terminate();
            else
              core->close();
            co_await core->join();
            server.pools_.erase(pool);
          }
          Writer w;
          w.write(Kind::joined);
          w.write(pool);
          server.send(std::move(w.buffer()));
        }(*this, std::move(core), pool, terminate));
  }

  World& world_;
  forkpool::detail::ObjectTranslation objects_;
  std::unordered_map<std::uint64_t, LocalPool> pools_;
  bool stopping_ = false;
  Scope finishing_;
};

void ReplySink::chunk_done(std::size_t, const ElementRange& range, Reader& results) {
  // The blocks the results carry, in the order of their table: they go on with them.
  std::vector<std::shared_ptr<forkpool::detail::Storage>> blocks;
  if (const auto* carried = forkpool::detail::StorageConversation::of(results.context()))
    while (std::shared_ptr<forkpool::detail::Storage> block =
               carried->block_at(static_cast<std::uint32_t>(blocks.size())))
      blocks.push_back(std::move(block));
  std::vector<std::uint64_t> sizes;
  sizes.reserve(blocks.size());
  for (const auto& block : blocks) sizes.push_back(block->size());
  auto bytes = results.read_span(results.remaining());
  Writer w;
  w.write(Kind::done);
  w.write(pool_);
  w.write(job_);
  w.write(range.first);
  w.write(range.end);
  w.write(sizes);
  w.write_size(bytes.size());
  w.write_bytes(bytes.data(), bytes.size());
  server_.send(std::move(w.buffer()), blocks);
  remaining_ -= std::min(remaining_, range.size());
  if (remaining_ == 0) server_.forget(pool_, job_);  // last: this sink may go with it
}

void ReplySink::chunk_failed(std::size_t, std::exception_ptr error) {
  Writer w;
  w.write(Kind::failed);
  w.write(pool_);
  w.write(job_);
  write_error(w, record_error(error));
  server_.send(std::move(w.buffer()));
  server_.forget(pool_, job_);
}

}  // namespace

void serve_node(World& world) {
  NodeServer server(world);
  forkpool::run(server.serve());
}

}  // namespace forkpool::mpi::detail
