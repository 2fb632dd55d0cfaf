#pragma once
// DataLoader: torch's DataLoader on forkpool. Worker processes each make whole batches (get()
// for every index of the batch, then the collate), which reach the consumer as shared memory.
//
//   struct Images {
//     std::size_t size() const { return 50000; }
//     Tensor get(std::size_t index) const;          // one sample: any encodable value
//   };
//   DataLoader loader(Images{}, {.batch_size = 64, .shuffle = true, .num_workers = 2});
//   for (int epoch = 0; epoch < 10; ++epoch)
//     for (Tensor& batch : loader) train(batch);     // plain code: one epoch per loop
//   // in a coroutine: Stream<Tensor> s = loader.epoch(); while (auto b = co_await s.next()) ...
//
// An iterable dataset (torch's IterableDataset) is a range instead: each worker calls its begin()
// and reads its own shard, told which by worker_info(); batches come from the workers in turn.
//
//   struct Lines {                                   // every num_workers-th line, from id on
//     auto begin() const;  auto end() const;         // a range of samples
//   };
//
// The dataset reaches the workers as torch's does on Linux: they are forked from the calling
// process when an epoch starts (once, with persistent_workers), and find it there. A DataLoader
// belongs to the thread that made it, as a Pool does, and must outlive its epochs' streams.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <ranges>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <forkpool/data/internal/epochs.hpp>
#include <forkpool/data/internal/loader_state.hpp>
#include <forkpool/pool/internal/pool_internals.hpp>
#include <forkpool/pool/pool.hpp>
#include <forkpool/pool/stream.hpp>
#include <forkpool/worker/worker_info.hpp>
#include <forkpool/runtime/error.hpp>
#include <forkpool/runtime/internal/progress_line.hpp>
#include <forkpool/runtime/internal/shared_handle.hpp>
#include <forkpool/shm/tensor.hpp>
#include <forkpool/shm/tensor_codec.hpp>

namespace forkpool {

// torch's names and meanings; fields stay in this order (designated initializers).
struct DataLoaderOptions {
  std::size_t batch_size = 1;
  bool shuffle = false;                   // a new permutation per epoch, reproducible from seed
  bool drop_last = false;                 // drop the last batch when it is short
  int num_workers = 2;                    // 0: batches made in the calling process
  int prefetch_factor = 2;                // batches in flight per worker
  bool persistent_workers = false;        // the same workers for every epoch (else forked per epoch)
  std::chrono::nanoseconds timeout = {};  // 0: none; a batch taking longer fails with TimeoutError
  bool in_order = true;                   // false: batches as they finish
  std::uint64_t seed = 0;                 // 0: random (with world_size > 1: a fixed one every rank shares)
  int rank = 0, world_size = 1;           // the distributed sampler: this rank's share of each epoch
  // Beyond torch's list:
  std::function<void(int)> worker_init = {};  // in each worker before its first batch, given its id
  std::string progress = {};                  // not empty: blocking iteration draws a progress line so labelled
};

template <class Dataset, class Batch = detail::DefaultBatch<detail::SampleOf<Dataset>>>
class DataLoader {
 public:
  using Sample = detail::SampleOf<Dataset>;
  // A collate runs in the worker, on the samples of one batch in index order.
  using Collate = Batch (*)(std::vector<Sample>);

  // Throws std::invalid_argument for options out of range.
  explicit DataLoader(Dataset dataset,
                      DataLoaderOptions options = {}) requires std::is_same_v<Batch, detail::DefaultBatch<Sample>>
      : DataLoader(std::move(dataset), std::move(options), &detail::default_collate<Sample>) {}
  DataLoader(Dataset dataset, DataLoaderOptions options, Collate collate)
      : shared_(std::make_shared<Shared>(
            Shared{std::move(dataset), collate, options.worker_init, options.batch_size, options.drop_last})),
        options_(std::move(options)) {
    detail::check_loader_options(options_, kIterable);
    seed_ = detail::loader_seed(options_);
  }

  // Batches per epoch (of this rank's share). An iterable dataset's count is known only at its end.
  std::size_t size() const requires detail::MapStyleDataset<Dataset> {
    return detail::batches_per_epoch(shared_->dataset.size(), options_);
  }
  Dataset& dataset() { return shared_->dataset; }

  // The next epoch, in coroutines: co_await next() gives batches, empty at the end. A sample
  // whose get() threw fails its batch with RemoteError (the thrown type; "sample N: " and its
  // message); the epoch goes on after it. A batch whose worker died (or was stopped by the
  // timeout) fails with WorkerLost (TimeoutError) naming it: "batch N of the epoch". Work starts at the call. Without
  // persistent_workers, a new epoch ends the workers of the one before.
  //
  // An iterable dataset: worker w's batches are the batch_size-sized runs of its shard (the
  // last one short unless drop_last), handed out in turn (worker 0's first, worker 1's first,
  // ...; a worker whose shard ended drops out), as torch's. An error thrown while reading a
  // shard fails that batch ("worker W, batch B of its shard: " and its message) and ends the
  // shard, as an exception ends a Python generator. A worker lost mid-epoch fails one batch
  // with WorkerLost and its shard ends there (its replacement reads it afresh next epoch).
  Stream<Batch> epoch() {
    std::uint64_t epoch = epochs_++;
    std::vector<detail::IndexBatch> batches;
    if constexpr (!kIterable) batches = detail::epoch_batches(shared_->dataset.size(), options_, seed_, epoch);
    if (options_.num_workers == 0) {
      auto state = std::make_shared<InProcessEpoch>(shared_.shared(), std::move(batches), epoch);
      state->start();
      return Stream<Batch>(std::move(state));
    }
    if (!pool_ || !options_.persistent_workers) {
      pool_.reset();  // the last epoch's workers first
      pool_ = std::make_unique<Pool>(pool_options());
    }
    detail::PoolInternals::core(*pool_).check_owner("DataLoader::epoch");
    auto window = static_cast<std::size_t>(options_.num_workers) * static_cast<std::size_t>(options_.prefetch_factor);
    if constexpr (kIterable) {
      auto state = std::make_shared<ShardedEpoch>(detail::PoolInternals::shared_core(*pool_), options_.num_workers,
                                                  epoch, window, options_.in_order);
      state->start();
      return Stream<Batch>(std::move(state));
    } else {
      auto state = std::make_shared<IndexedEpoch>(detail::PoolInternals::shared_core(*pool_), &Shared::load,
                                                  std::move(batches), 1, options_.in_order, window,
                                                  /*bound_unconsumed=*/true);
      state->start();
      return Stream<Batch>(std::move(state));
    }
  }

  // The next epoch, in plain code: for (Batch& batch : loader) ...
  class iterator {
   public:
    using iterator_category = std::input_iterator_tag;
    using value_type = Batch;
    using difference_type = std::ptrdiff_t;
    iterator() = default;
    iterator(typename Stream<Batch>::iterator at, Stream<Batch>* stream, const std::string& label)
        : at_(std::move(at)), stream_(stream) {
      if (!label.empty()) line_ = std::make_shared<detail::ProgressLine>(label);
      draw();
    }
    Batch& operator*() const { return *at_; }
    Batch* operator->() const { return &*at_; }
    iterator& operator++() {
      ++at_;
      draw();
      return *this;
    }
    void operator++(int) { ++*this; }
    bool operator==(std::default_sentinel_t end) const noexcept { return at_ == end; }

   private:
    void draw() {
      if (!line_) return;
      if (at_ == std::default_sentinel) return line_->finish(stream_->progress());
      if (auto now = std::chrono::steady_clock::now(); now >= next_draw_) {
        line_->draw(stream_->progress());
        next_draw_ = now + line_->interval();
      }
    }
    typename Stream<Batch>::iterator at_;
    Stream<Batch>* stream_ = nullptr;
    std::shared_ptr<detail::ProgressLine> line_;
    std::chrono::steady_clock::time_point next_draw_{};
  };
  iterator begin() {
    current_.emplace(epoch());
    return iterator(current_->begin(), &*current_, options_.progress);
  }
  std::default_sentinel_t end() const noexcept { return {}; }

 private:
  using Shared = detail::LoaderState<Dataset, Batch>;
  static constexpr bool kIterable = Shared::kIterable;

  PoolOptions pool_options() const {
    return {.processes = options_.num_workers,
            .initializer =
                [shared = shared_.shared()] {
                  Shared::in_worker = shared.get();
                  if (shared->worker_init) shared->worker_init(worker_info()->id);
                },
            .start_method = StartMethod::fork,
            .task_timeout = options_.timeout,
            .seed = seed_};
  }

  using IndexedEpoch = detail::IndexedEpoch<Shared>;
  using InProcessEpoch = detail::InProcessEpoch<Shared>;
  using ShardedEpoch = detail::ShardedEpoch<Shared>;

  detail::SharedHandle<Shared, "DataLoader"> shared_;
  DataLoaderOptions options_;
  std::uint64_t seed_ = 0;
  std::uint64_t epochs_ = 0;
  std::unique_ptr<Pool> pool_;
  std::optional<Stream<Batch>> current_;  // the epoch a blocking loop iterates
};

template <class Dataset>
DataLoader(Dataset) -> DataLoader<Dataset>;
template <class Dataset>
DataLoader(Dataset, DataLoaderOptions) -> DataLoader<Dataset>;
template <class Dataset, class Batch, class Sample>
DataLoader(Dataset, DataLoaderOptions, Batch (*)(std::vector<Sample>)) -> DataLoader<Dataset, Batch>;

}  // namespace forkpool
