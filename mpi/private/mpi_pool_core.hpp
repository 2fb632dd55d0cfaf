#pragma once
// MpiPoolCore: mpi::Pool's core on rank 0. A PoolCore (pool/internal/pool_core.hpp) whose jobs go
// to the node with free workers: rank 0's own node runs them on an ordinary local pool; another
// node's rank runs them on its own local pool (node_server.hpp) and sends the results back. Each
// node holds at most two jobs per worker; the rest wait here, so a node that finishes early gets
// more. Jobs that carry descriptors (other than tensors) stay on rank 0's node.

#include <cstdint>
#include <deque>
#include <memory>
#include <unordered_map>
#include <vector>

#include <forkpool/ipc/codec.hpp>
#include <forkpool/mpi/private/protocol.hpp>
#include <forkpool/pool/internal/pool_core.hpp>
#include <forkpool/runtime/internal/one_shot.hpp>

namespace forkpool::mpi::detail {

using forkpool::detail::Job;
using forkpool::detail::JobSink;

class MpiPoolCore final : public forkpool::detail::PoolCore, public std::enable_shared_from_this<MpiPoolCore> {
 public:
  // Starts the local pool now and asks every other node for its own. Throws as Pool's constructor
  // does, std::invalid_argument for an initializer with state (it cannot cross machines).
  static std::shared_ptr<MpiPoolCore> create(PoolOptions options);
  explicit MpiPoolCore(PoolOptions options);
  ~MpiPoolCore() override;

  void submit(std::shared_ptr<Job> job) override;
  void stream_opened() override;
  void stream_closed() override;
  void submit_for_stream(std::shared_ptr<Job> job) override;
  void cancel(const JobSink* sink) override;
  void close() override;
  void terminate() override;
  Task<void> join() override;
  bool terminated() const noexcept override { return terminated_; }
  int processes() const noexcept override;
  std::vector<pid_t> worker_pids() const override;
  void shut_down() override;

  // Hub: a node's reply for this pool, after its kind and pool id.
  void receive(Kind kind, int source, Reader& r);
  // Hub: whether a node still owes this pool a reply.
  bool awaits_nodes() const noexcept;
  // A local job's sink: the job has no more results to give.
  void local_job_finished(const JobSink* wrapper);

 private:
  struct Node {
    int rank = 0;         // 0: this node, run by the local pool
    int processes = 0;    // its workers (for another node, a guess until it says)
    int in_flight = 0;    // jobs it holds
    bool opened = false;  // it said whether its pool started
    bool usable = true;   // false once its pool failed to start
    bool joined = false;
  };
  struct RemoteJob {
    std::shared_ptr<Job> job;
    std::size_t node;
    std::uint64_t remaining;  // elements whose results have not come
  };

  void start_nodes();
  void enqueue(std::shared_ptr<Job> job);
  void dispatch();
  std::size_t pick_node(const Job& job) const;
  void send_remote(std::size_t node, const std::shared_ptr<Job>& job);
  void finish_remote(std::uint64_t id);
  void on_done(int source, Reader& r);
  void on_failed(Reader& r);
  void on_opened(int source, Reader& r);
  void check_drained();
  Node& node_of_rank(int rank);
  void send_to_nodes(Kind kind);

  PoolOptions options_;
  std::uint64_t id_ = 0;
  std::shared_ptr<forkpool::detail::PoolCore> local_;
  std::vector<Node> nodes_;  // [0]: this node
  std::deque<std::shared_ptr<Job>> pending_;
  std::unordered_map<const JobSink*, const JobSink*> local_jobs_;  // wrapper -> the job's own sink
  std::unordered_map<std::uint64_t, RemoteJob> remote_jobs_;
  std::uint64_t next_job_ = 1;
  int streams_ = 0;
  int awaiting_opened_ = 0;
  int awaiting_joined_ = 0;
  bool closed_ = false;
  bool local_closed_ = false;
  bool terminated_ = false;
  std::shared_ptr<forkpool::detail::OneShot> drained_;  // set when nothing is pending or with a node (join waits)
  std::shared_ptr<forkpool::detail::OneShot> joined_;   // set when every other node said joined
};

}  // namespace forkpool::mpi::detail
