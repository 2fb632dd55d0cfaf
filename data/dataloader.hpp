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

#include <forkpool/pool/internal/core_stream.hpp>
#include <forkpool/pool/internal/index_batch.hpp>
#include <forkpool/pool/internal/stream_state.hpp>
#include <forkpool/data/default_collate.hpp>
#include <forkpool/pool/internal/pool_internals.hpp>
#include <forkpool/pool/pool.hpp>
#include <forkpool/pool/stream.hpp>
#include <forkpool/pool/worker_info.hpp>
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

namespace detail {

// A map-style dataset: size() and get(index), batches of indices from a sampler.
template <class Dataset>
concept MapStyleDataset = requires(Dataset& dataset, std::size_t index) {
  dataset.size();
  dataset.get(index);
};
// An iterable dataset: a range each worker reads its shard of (worker_info() says which).
template <class Dataset>
concept IterableDataset = !MapStyleDataset<Dataset> && std::ranges::input_range<Dataset&>;

template <class Dataset>
struct SampleType {
  using type = std::ranges::range_value_t<Dataset&>;
};
template <MapStyleDataset Dataset>
struct SampleType<Dataset> {
  using type = std::remove_cvref_t<decltype(std::declval<Dataset&>().get(std::size_t{}))>;
};
template <class Dataset>
using SampleOf = typename SampleType<Dataset>::type;

// Where a process's shard of an iterable dataset stands in its current epoch.
template <class Dataset>
struct ShardCursor {};  // a map-style dataset has none
template <IterableDataset Dataset>
struct ShardCursor<Dataset> {
  std::uint64_t epoch = ~std::uint64_t{0};
  std::uint64_t next_batch = 0;  // the batch the parent asks for next
  bool ended = false;
  std::optional<std::ranges::iterator_t<Dataset&>> at;
};

// Throws std::invalid_argument naming the option that is out of range (or, for an iterable
// dataset, that needs a sampler: shuffle, world_size).
void check_loader_options(const DataLoaderOptions& options, bool iterable);
// The seed of a loader's permutations: options.seed, else random (a fixed one across ranks).
std::uint64_t loader_seed(const DataLoaderOptions& options);
// The sampler and the batching: the indices of every batch of epoch `epoch` for options.rank
// (sequential, or a permutation drawn from `seed` and `epoch`; with world_size > 1 every rank
// draws the same permutation, padded by repeating its start to a multiple of world_size, as
// torch's DistributedSampler, and takes every world_size-th index from its rank on).
std::vector<IndexBatch> epoch_batches(std::size_t dataset_size, const DataLoaderOptions& options, std::uint64_t seed,
                                      std::uint64_t epoch);
std::size_t batches_per_epoch(std::size_t dataset_size, const DataLoaderOptions& options);
// The default collate of tensors, fed a sample at a time: each is copied into the batch (one
// tensor with a leading batch dimension, in shared memory, made at the first sample) as it comes,
// so the caller may let it go at once. add() throws std::invalid_argument naming the first sample
// whose dtype or shape differs from the first's.
class Stacker {
 public:
  explicit Stacker(std::size_t samples) : samples_(samples) {}
  void add(const Tensor& sample);
  Tensor finish();  // after `samples` add()s

 private:
  std::size_t samples_;
  std::size_t added_ = 0;
  Tensor batch_;
  std::byte* next_ = nullptr;     // where the next sample's elements go
  std::size_t sample_bytes_ = 0;  // each sample's (they have one shape and dtype)
};
// Inside a catch block: the sample `index`'s error, as it crosses to the consumer (its type
// name kept, "sample N: " before its message).
[[noreturn]] void throw_sample_error(std::uint64_t index);
// Inside a catch block: the error of batch `batch` of an iterable dataset's shard, read by
// worker `worker` (-1: the calling process), kept as throw_sample_error keeps it.
[[noreturn]] void throw_shard_error(int worker, std::uint64_t batch);
// A worker asked for batch `asked` of its shard while it stands at `at`: it is a replacement,
// and a shard cannot resume where a lost worker left it.
[[noreturn]] void throw_shard_out_of_step(std::uint64_t asked, std::uint64_t at);
// Whether `error` says the worker is gone (WorkerLost, or TimeoutError: it was stopped).
bool lost_its_worker(const std::exception_ptr& error);
// `error`, a WorkerLost or TimeoutError, naming `batch` ("batch 3 of the epoch"), which the
// pool's message calls "the task"; any other error as it is.
std::exception_ptr naming_batch(std::exception_ptr error, const std::string& batch);
// Inside a catch block, in the calling process (num_workers 0): the error a worker's would have
// become, RemoteError, for a sample's error; the error itself otherwise.
std::exception_ptr as_remote_error();

}  // namespace detail

namespace detail {
template <class Sample>
using DefaultBatch = typename DefaultCollate<Sample>::Batch;
template <class Sample>
DefaultBatch<Sample> default_collate(std::vector<Sample> samples) {
  return DefaultCollate<Sample>::collate(std::move(samples));
}
}  // namespace detail

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
      auto state = std::make_shared<IndexedEpoch>(detail::PoolInternals::shared_core(*pool_), &load, std::move(batches),
                                                  1, options_.in_order, window,
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
  static constexpr bool kIterable = detail::IterableDataset<Dataset>;

  using ShardCursor = detail::ShardCursor<Dataset>;
  struct Shared {
    Dataset dataset;
    Collate collate;
    std::function<void(int)> worker_init;
    std::size_t batch_size;
    bool drop_last;
    ShardCursor cursor = {};  // an iterable dataset's, in each worker (or the caller: num_workers 0)
  };

  // Set in each worker by the pool's initializer: the dataset it was forked with.
  static inline Shared* in_worker = nullptr;

  static Sample get(Shared& shared, std::uint64_t index) {
    try {
      return shared.dataset.get(static_cast<std::size_t>(index));
    } catch (...) {
      detail::throw_sample_error(index);
    }
  }
  static Batch make_batch(Shared& shared, const detail::IndexBatch& indices) {
    if constexpr (std::is_same_v<Sample, Tensor> && std::is_same_v<Batch, Tensor>) {
      // The default collate takes each sample as it comes: the batch never holds them all, and
      // the next sample reuses the memory the last one left, still in cache.
      if (shared.collate == &detail::default_collate<Sample>) {
        detail::Stacker stacker(indices.size());
        for (std::size_t i = 0; i < indices.size(); ++i) stacker.add(get(shared, indices[i]));
        return stacker.finish();
      }
    }
    std::vector<Sample> samples;
    samples.reserve(indices.size());
    for (std::size_t i = 0; i < indices.size(); ++i) samples.push_back(get(shared, indices[i]));
    return shared.collate(std::move(samples));
  }
  static Batch load(detail::IndexBatch indices) { return make_batch(*in_worker, indices); }

  // Batch `batch` of this process's shard in epoch `epoch`: empty once the shard has ended.
  static std::optional<Batch> next_of_shard(Shared& shared, std::uint64_t epoch, std::uint64_t batch) {
    ShardCursor& cursor = shared.cursor;
    if (cursor.epoch != epoch) {
      cursor = ShardCursor{};
      cursor.epoch = epoch;
      cursor.at.emplace(std::ranges::begin(shared.dataset));  // the user's begin() picks the shard
    }
    if (cursor.ended) return std::nullopt;
    if (batch != cursor.next_batch) detail::throw_shard_out_of_step(batch, cursor.next_batch);
    ++cursor.next_batch;
    std::vector<Sample> samples;
    samples.reserve(shared.batch_size);
    try {
      auto end = std::ranges::end(shared.dataset);
      while (samples.size() < shared.batch_size && *cursor.at != end) {
        samples.push_back(**cursor.at);
        ++*cursor.at;
      }
    } catch (...) {
      cursor.ended = true;  // where the iterator stands is unknown: the shard ends, as a generator's
      std::optional<WorkerInfo> info = worker_info();
      detail::throw_shard_error(info ? info->id : -1, batch);
    }
    if (samples.size() < shared.batch_size) cursor.ended = true;
    if (samples.empty() || (cursor.ended && shared.drop_last)) return std::nullopt;
    return shared.collate(std::move(samples));
  }
  using ShardRequest = std::pair<std::uint64_t, std::uint64_t>;  // epoch, batch of the shard
  static std::optional<Batch> load_from_shard(ShardRequest request) {
    return next_of_shard(*in_worker, request.first, request.second);
  }

  PoolOptions pool_options() const {
    return {.processes = options_.num_workers,
            .initializer =
                [shared = shared_.shared()] {
                  in_worker = shared.get();
                  if (shared->worker_init) shared->worker_init(worker_info()->id);
                },
            .start_method = StartMethod::fork,
            .task_timeout = options_.timeout,
            .seed = seed_};
  }

  // A map-style epoch on the workers: batch i is the stream's chunk i. A batch whose worker was
  // lost (or stopped by the timeout) says which batch it was, where the pool says "the task".
  using Batches = std::vector<detail::IndexBatch>;  // owned by the stream (not owning_view: clang 14 rejects it here)
  class IndexedEpoch final : public detail::RangeStream<decltype(&load), detail::IndexBatch, false, Batches> {
   public:
    using detail::RangeStream<decltype(&load), detail::IndexBatch, false, Batches>::RangeStream;
    void chunk_failed(std::size_t chunk, std::exception_ptr error) override {
      detail::StreamState<Batch>::chunk_failed(
          chunk, detail::naming_batch(std::move(error), "batch " + std::to_string(chunk) + " of the epoch"));
    }
  };

  // num_workers 0: each batch made when the consumer asks for it, errors as a worker's. An
  // iterable dataset is read whole (worker_info() is empty here, as in torch).
  class InProcessEpoch final : public detail::StreamState<Batch> {
   public:
    InProcessEpoch(std::shared_ptr<Shared> shared, std::vector<detail::IndexBatch> batches, std::uint64_t epoch)
        : detail::StreamState<Batch>(/*ordered=*/true, /*window=*/1),
          shared_(std::move(shared)),
          batches_(std::move(batches)),
          epoch_(epoch) {
      if constexpr (!kIterable) this->set_known_total(batches_.size());
    }

   private:
    bool submit_chunk(std::size_t index) override {
      std::optional<Batch> batch;
      std::exception_ptr error;
      try {
        if constexpr (kIterable) {
          batch = next_of_shard(*shared_, epoch_, index);
        } else if (index < batches_.size()) {
          batch = make_batch(*shared_, batches_[index]);
        }
        if (!batch) return false;
      } catch (...) {
        error = detail::as_remote_error();
      }
      this->record_chunk_size(index, 1);
      if (error) {
        this->chunk_failed(index, std::move(error));
      } else {
        this->deliver(index, std::move(*batch));
      }
      return true;
    }
    std::shared_ptr<Shared> shared_;
    std::vector<detail::IndexBatch> batches_;
    std::uint64_t epoch_;
  };

  // An iterable dataset's epoch on the workers: batch requests go to each worker's own shard in
  // turn (pinned to it: the worker holds the shard's iterator), at most `window` unconsumed.
  class ShardedEpoch final : public detail::CoreStream<Batch> {
   public:
    ShardedEpoch(std::shared_ptr<detail::PoolCore> core, int workers, std::uint64_t epoch, std::size_t window,
                 bool ordered)
        : detail::CoreStream<Batch>(std::move(core), ordered, window, /*bound_unconsumed=*/true),
          shards_(static_cast<std::size_t>(workers)),
          epoch_(epoch) {}

    void chunk_done(std::size_t chunk, const detail::ElementRange& range, Reader& results) override {
      std::optional<Batch> batch;
      detail::read_results<std::optional<Batch>>(results, range, 1,
                                                 [&](std::size_t, std::optional<Batch>&& b) { batch = std::move(b); });
      if (batch) return this->deliver(chunk, std::move(*batch));
      shard_of(chunk).ended = true;
      this->skip(chunk);
    }
    // A lost worker's batch is named by its shard ("batch 2 of shard 1": shard W is read by the
    // worker whose worker_info().id is W), where the pool says "the task".
    void chunk_failed(std::size_t chunk, std::exception_ptr error) override {
      Shard& shard = shard_of(chunk);
      if (detail::lost_its_worker(error)) {
        // Its other requests fail with it: the consumer hears of the loss once.
        if (std::exchange(shard.lost, true)) return this->skip(chunk);
        shard.ended = true;
        const Sent& sent = sent_.at(chunk);
        error = detail::naming_batch(
            std::move(error), "batch " + std::to_string(sent.batch) + " of shard " + std::to_string(sent.worker));
      }
      detail::StreamState<Batch>::chunk_failed(chunk, std::move(error));
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
        ShardRequest request{epoch_, shard.requested++};
        const ShardRequest* at = &request;
        auto job = detail::make_job<decltype(&load_from_shard), ShardRequest, false>(
            &load_from_shard, at, &request + 1, 1, this->shared_from_this(), index);
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
