#pragma once
// The kinds of a DataLoader's epoch (data/dataloader.hpp), each a stream of batches over a
// LoaderState: a map-style dataset's on the workers (IndexedEpoch), an iterable dataset's shards
// on the workers (ShardedEpoch), and either in the calling process (InProcessEpoch).

#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <forkpool/data/internal/loader_state.hpp>
#include <forkpool/pool/internal/core_stream.hpp>
#include <forkpool/pool/internal/index_batch.hpp>
#include <forkpool/pool/internal/pool_sinks.hpp>
#include <forkpool/pool/internal/stream_state.hpp>
#include <forkpool/runtime/error.hpp>

namespace forkpool::detail {

// A map-style epoch on the workers: batch i is the stream's chunk i. A batch whose worker was
// lost (or stopped by the timeout) says which batch it was, where the pool says "the task".
using Batches = std::vector<IndexBatch>;  // owned by the stream (not owning_view: clang 14 rejects it here)
template <class State>
class IndexedEpoch final : public RangeStream<decltype(&State::load), IndexBatch, false, Batches> {
  using Batch = typename State::BatchType;

 public:
  using RangeStream<decltype(&State::load), IndexBatch, false, Batches>::RangeStream;
  void chunk_failed(std::size_t chunk, std::exception_ptr error) override {
    StreamState<Batch>::chunk_failed(
        chunk, naming_batch(std::move(error), "batch " + std::to_string(chunk) + " of the epoch"));
  }
};

// num_workers 0: each batch made when the consumer asks for it, errors as a worker's. An
// iterable dataset is read whole (worker_info() is empty here, as in torch).
template <class State>
class InProcessEpoch final : public StreamState<typename State::BatchType> {
  using Batch = typename State::BatchType;

 public:
  InProcessEpoch(std::shared_ptr<State> shared, std::vector<IndexBatch> batches, std::uint64_t epoch)
      : StreamState<Batch>(/*ordered=*/true, /*window=*/1),
        shared_(std::move(shared)),
        batches_(std::move(batches)),
        epoch_(epoch) {
    if constexpr (!State::kIterable) this->set_known_total(batches_.size());
  }

 private:
  bool submit_chunk(std::size_t index) override {
    std::optional<Batch> batch;
    std::exception_ptr error;
    try {
      if constexpr (State::kIterable) {
        batch = shared_->next_of_shard(epoch_, index);
      } else if (index < batches_.size()) {
        batch = shared_->make_batch(batches_[index]);
      }
      if (!batch) return false;
    } catch (...) {
      error = as_remote_error();
    }
    this->record_chunk_size(index, 1);
    if (error) {
      this->chunk_failed(index, std::move(error));
    } else {
      this->deliver(index, std::move(*batch));
    }
    return true;
  }
  std::shared_ptr<State> shared_;
  std::vector<IndexBatch> batches_;
  std::uint64_t epoch_;
};

// An iterable dataset's epoch on the workers: batch requests go to each worker's own shard in
// turn (pinned to it: the worker holds the shard's iterator), at most `window` unconsumed.
template <class State>
class ShardedEpoch final : public CoreStream<typename State::BatchType> {
  using Batch = typename State::BatchType;

 public:
  ShardedEpoch(std::shared_ptr<PoolCore> core, int workers, std::uint64_t epoch, std::size_t window, bool ordered)
      : CoreStream<Batch>(std::move(core), ordered, window, /*bound_unconsumed=*/true),
        shards_(static_cast<std::size_t>(workers)),
        epoch_(epoch) {}

  void chunk_done(std::size_t chunk, const ElementRange& range, Reader& results) override {
    std::optional<Batch> batch;
    read_results<std::optional<Batch>>(results, range, 1,
                                       [&](std::size_t, std::optional<Batch>&& b) { batch = std::move(b); });
    if (batch) return this->deliver(chunk, std::move(*batch));
    shard_of(chunk).ended = true;
    this->skip(chunk);
  }
  // A lost worker's batch is named by its shard ("batch 2 of shard 1": shard W is read by the
  // worker whose worker_info().id is W), where the pool says "the task".
  void chunk_failed(std::size_t chunk, std::exception_ptr error) override {
    Shard& shard = shard_of(chunk);
    if (lost_its_worker(error)) {
      // Its other requests fail with it: the consumer hears of the loss once.
      if (std::exchange(shard.lost, true)) return this->skip(chunk);
      shard.ended = true;
      const Sent& sent = sent_.at(chunk);
      error = naming_batch(std::move(error),
                           "batch " + std::to_string(sent.batch) + " of shard " + std::to_string(sent.worker));
    }
    StreamState<Batch>::chunk_failed(chunk, std::move(error));
  }

 private:
  struct Shard {
    std::uint64_t requested = 0;  // batches of it asked for
    bool ended = false;
    bool lost = false;
  };
  struct Sent {
    int worker;
    std::uint64_t batch;  // of its shard
  };
  Shard& shard_of(std::size_t chunk) { return shards_[static_cast<std::size_t>(sent_.at(chunk).worker)]; }

  bool submit_chunk(std::size_t index) override {
    if (this->core().terminated()) throw PoolTerminated();
    for (std::size_t tried = 0; tried < shards_.size(); ++tried) {
      auto worker = static_cast<int>(turn_++ % shards_.size());
      Shard& shard = shards_[static_cast<std::size_t>(worker)];
      if (shard.ended) continue;
      typename State::ShardRequest request{epoch_, shard.requested++};
      const typename State::ShardRequest* at = &request;
      auto job = make_job<decltype(&State::load_from_shard), typename State::ShardRequest, false>(
          &State::load_from_shard, at, &request + 1, 1, this->shared_from_this(), index);
      job->pinned_worker = worker;
      this->record_chunk_size(index, 1);
      sent_.push_back({worker, request.second});
      this->core().submit_for_stream(std::move(job));
      return true;
    }
    this->end_input();  // every shard has ended
    return false;
  }

  std::vector<Shard> shards_;
  std::vector<Sent> sent_;  // chunk i's request (chunks are numbered from 0 in submission order)
  std::size_t turn_ = 0;
  std::uint64_t epoch_;
};

}  // namespace forkpool::detail
