#pragma once
// The DataLoader's dataset side (data/dataloader.hpp): which datasets it takes, how a batch is
// made, where a shard stands, and how errors name their sample or batch.

#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <optional>
#include <ranges>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <forkpool/data/default_collate.hpp>
#include <forkpool/pool/internal/index_batch.hpp>
#include <forkpool/shm/tensor.hpp>
#include <forkpool/worker/worker_info.hpp>

namespace forkpool {
struct DataLoaderOptions;
}

namespace forkpool::detail {

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

template <class Sample>
using DefaultBatch = typename DefaultCollate<Sample>::Batch;
template <class Sample>
DefaultBatch<Sample> default_collate(std::vector<Sample> samples) {
  return DefaultCollate<Sample>::collate(std::move(samples));
}

// What a DataLoader's workers read (and the caller, with num_workers 0): the dataset, how a batch
// is made of its samples, and an iterable dataset's place in its shard. A worker finds it at
// `in_worker`, set by the pool's initializer (the loader's state as the worker was forked with it).
template <class Dataset, class Batch>
struct LoaderState {
  using Sample = SampleOf<Dataset>;
  using BatchType = Batch;
  using Collate = Batch (*)(std::vector<Sample>);
  using ShardRequest = std::pair<std::uint64_t, std::uint64_t>;  // epoch, batch of the shard
  static constexpr bool kIterable = IterableDataset<Dataset>;

  Dataset dataset;
  Collate collate;
  std::function<void(int)> worker_init;
  std::size_t batch_size;
  bool drop_last;
  ShardCursor<Dataset> cursor = {};  // an iterable dataset's, in each worker (or the caller: num_workers 0)

  static inline LoaderState* in_worker = nullptr;

  Sample get(std::uint64_t index) {
    try {
      return dataset.get(static_cast<std::size_t>(index));
    } catch (...) {
      throw_sample_error(index);
    }
  }

  Batch make_batch(const IndexBatch& indices) {
    if constexpr (std::is_same_v<Sample, Tensor> && std::is_same_v<Batch, Tensor>) {
      // The default collate takes each sample as it comes: the batch never holds them all, and
      // the next sample reuses the memory the last one left, still in cache.
      if (collate == &default_collate<Sample>) {
        Stacker stacker(indices.size());
        for (std::size_t i = 0; i < indices.size(); ++i) stacker.add(get(indices[i]));
        return stacker.finish();
      }
    }
    std::vector<Sample> samples;
    samples.reserve(indices.size());
    for (std::size_t i = 0; i < indices.size(); ++i) samples.push_back(get(indices[i]));
    return collate(std::move(samples));
  }

  // Batch `batch` of this process's shard in epoch `epoch`: empty once the shard has ended.
  std::optional<Batch> next_of_shard(std::uint64_t epoch, std::uint64_t batch) {
    if (cursor.epoch != epoch) {
      cursor = ShardCursor<Dataset>{};
      cursor.epoch = epoch;
      cursor.at.emplace(std::ranges::begin(dataset));  // the user's begin() picks the shard
    }
    if (cursor.ended) return std::nullopt;
    if (batch != cursor.next_batch) throw_shard_out_of_step(batch, cursor.next_batch);
    ++cursor.next_batch;
    std::vector<Sample> samples;
    samples.reserve(batch_size);
    try {
      auto end = std::ranges::end(dataset);
      while (samples.size() < batch_size && *cursor.at != end) {
        samples.push_back(**cursor.at);
        ++*cursor.at;
      }
    } catch (...) {
      cursor.ended = true;  // where the iterator stands is unknown: the shard ends, as a generator's
      std::optional<WorkerInfo> info = worker_info();
      throw_shard_error(info ? info->id : -1, batch);
    }
    if (samples.size() < batch_size) cursor.ended = true;
    if (samples.empty() || (cursor.ended && drop_last)) return std::nullopt;
    return collate(std::move(samples));
  }

  // The tasks the workers run.
  static Batch load(IndexBatch indices) { return in_worker->make_batch(indices); }
  static std::optional<Batch> load_from_shard(ShardRequest request) {
    return in_worker->next_of_shard(request.first, request.second);
  }
};

}  // namespace forkpool::detail
