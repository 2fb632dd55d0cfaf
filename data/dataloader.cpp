#include <forkpool/data/dataloader.hpp>

#include <sys/random.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <random>
#include <stdexcept>

#include <forkpool/runtime/private/describe_exception.hpp>
#include <forkpool/runtime/private/splitmix64.hpp>

namespace forkpool::detail {
namespace {

// This rank's count of samples per epoch: the padded total's share.
std::size_t rank_samples(std::size_t dataset_size, const DataLoaderOptions& options) {
  auto world = static_cast<std::size_t>(options.world_size);
  return dataset_size / world + (dataset_size % world != 0 ? 1 : 0);  // (a sum could wrap)
}

// Whether two shapes are equal: a loop, as a sample has a dim or two (std::ranges::equal calls
// memcmp, a collate compares every sample).
bool same_shape(std::span<const std::int64_t> a, std::span<const std::int64_t> b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (a[i] != b[i]) return false;
  return true;
}

// Copies `t`'s elements, in row-major order, to `out`: a strided walk when it is not contiguous.
void copy_elements(const Tensor& t, std::byte* out) {
  if (t.is_contiguous()) {
    std::memcpy(out, t.raw_data(), t.nbytes());
    return;
  }
  std::size_t element = element_size(t.dtype());
  auto shape = t.shape();
  auto strides = t.strides();
  std::vector<std::int64_t> at(shape.size(), 0);
  const auto* base = static_cast<const std::byte*>(t.raw_data());
  for (std::int64_t n = 0; n < t.numel(); ++n) {
    std::int64_t offset = 0;
    for (std::size_t d = 0; d < shape.size(); ++d) offset += at[d] * strides[d];
    std::memcpy(out + static_cast<std::size_t>(n) * element, base + offset * static_cast<std::int64_t>(element),
                element);
    for (std::size_t d = shape.size(); d-- > 0;) {
      if (++at[d] < shape[d]) break;
      at[d] = 0;
    }
  }
}

}  // namespace

void check_loader_options(const DataLoaderOptions& options, bool iterable) {
  auto refuse = [](const char* what) {
    throw std::invalid_argument(std::string("forkpool: DataLoaderOptions::") + what);
  };
  if (options.batch_size == 0) refuse("batch_size must be >= 1");
  if (options.num_workers < 0) refuse("num_workers must be >= 0");
  if (options.prefetch_factor < 1) refuse("prefetch_factor must be >= 1");
  if (options.timeout < std::chrono::nanoseconds::zero()) refuse("timeout must be >= 0");
  if (options.world_size < 1) refuse("world_size must be >= 1");
  if (options.rank < 0 || options.rank >= options.world_size) refuse("rank must be in [0, world_size)");
  // As torch's: an iterable dataset has no sampler; it shuffles and splits by rank itself.
  if (iterable && options.shuffle) refuse("shuffle needs a dataset with size() and get(index), not an iterable one");
  if (iterable && options.world_size > 1)
    refuse("world_size needs a dataset with size() and get(index); an iterable one reads its rank's share itself");
}

std::uint64_t loader_seed(const DataLoaderOptions& options) {
  if (options.seed != 0) return options.seed;
  if (options.world_size > 1) return 0x5eed;  // every rank must draw the same permutation
  std::uint64_t seed = 0;
  if (getrandom(&seed, sizeof seed, 0) != static_cast<ssize_t>(sizeof seed))
    seed = static_cast<std::uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  return seed | 1;
}

std::size_t batches_per_epoch(std::size_t dataset_size, const DataLoaderOptions& options) {
  std::size_t samples = rank_samples(dataset_size, options);
  // (Not (samples + batch_size - 1) / batch_size: that wraps for a batch_size near SIZE_MAX.)
  bool short_batch = !options.drop_last && samples % options.batch_size != 0;
  return samples / options.batch_size + (short_batch ? 1 : 0);
}

namespace {

// Positions [0, samples) cut into batch_size runs (the last one short unless drop_last), each
// batch made by make(first position, count).
template <class Make>
std::vector<IndexBatch> cut_into_batches(std::size_t samples, const DataLoaderOptions& options, Make make) {
  std::vector<IndexBatch> batches;
  for (std::size_t first = 0; first < samples; first += options.batch_size) {
    std::size_t count = std::min(options.batch_size, samples - first);
    if (count < options.batch_size && options.drop_last) break;
    batches.push_back(make(first, count));
  }
  return batches;
}

}  // namespace

std::vector<IndexBatch> epoch_batches(std::size_t dataset_size, const DataLoaderOptions& options, std::uint64_t seed,
                                      std::uint64_t epoch) {
  if (!options.shuffle && options.world_size <= 1)  // runs, without listing the dataset
    return cut_into_batches(dataset_size, options, &IndexBatch::run);
  std::vector<std::uint64_t> order(dataset_size);
  std::iota(order.begin(), order.end(), std::uint64_t{0});
  if (options.shuffle) {
    std::mt19937_64 random(splitmix64(seed ^ splitmix64(epoch)));
    for (std::size_t i = order.size(); i > 1; --i) std::swap(order[i - 1], order[random() % i]);
  }
  if (options.world_size > 1 && !order.empty()) {
    // This rank's share of the order padded, by repeating its start, to a multiple of world_size
    // (padded[i] is order[i % size]), read without making the padded order: a world larger than
    // the dataset would make it world_size long.
    auto world = static_cast<std::size_t>(options.world_size);
    std::vector<std::uint64_t> share(rank_samples(dataset_size, options));
    std::size_t at = static_cast<std::size_t>(options.rank) % order.size();
    for (std::uint64_t& index : share) {
      index = order[at];
      at = (at + world % order.size()) % order.size();
    }
    order = std::move(share);
  }
  return cut_into_batches(order.size(), options, [&order](std::size_t first, std::size_t count) {
    return IndexBatch::of(std::span<const std::uint64_t>(order).subspan(first, count));
  });
}

void throw_sample_error(std::uint64_t index) {
  auto [type, message] = describe_current_exception();
  throw DescribedException(type, "sample " + std::to_string(index) + ": " + message);
}

void throw_shard_error(int worker, std::uint64_t batch) {
  auto [type, message] = describe_current_exception();
  std::string who = worker >= 0 ? "worker " + std::to_string(worker) + ", " : std::string();
  throw DescribedException(type, who + "batch " + std::to_string(batch) + " of its shard: " + message);
}

void throw_shard_out_of_step(std::uint64_t asked, std::uint64_t at) {
  throw std::logic_error("forkpool: DataLoader: a worker was asked for batch " + std::to_string(asked) +
                         " of its shard but stands at batch " + std::to_string(at) +
                         " (a replacement cannot resume a lost worker's shard)");
}

bool lost_its_worker(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const WorkerLost&) {
    return true;
  } catch (const TimeoutError&) {
    return true;
  } catch (...) {
    return false;
  }
}

std::exception_ptr naming_batch(std::exception_ptr error, const std::string& batch) {
  try {
    std::rethrow_exception(error);
  } catch (const WorkerLost& lost) {
    return std::make_exception_ptr(WorkerLost(lost.pid(), lost.exit_code(), lost.signal(), batch));
  } catch (const TimeoutError& timeout) {
    return std::make_exception_ptr(TimeoutError(std::string(timeout.what()) + " (it ran " + batch + ")"));
  } catch (...) {
    return error;
  }
}

std::exception_ptr as_remote_error() {
  try {
    throw;
  } catch (const DescribedException& e) {
    return std::make_exception_ptr(RemoteError(e.type_name(), e.what(), getpid()));
  } catch (...) {
    return std::current_exception();
  }
}

void Stacker::add(const Tensor& sample) {
  if (added_ == samples_) throw std::logic_error("forkpool: Stacker: more samples than the batch holds");
  if (added_ == 0) {
    std::vector<std::int64_t> shape{static_cast<std::int64_t>(samples_)};
    shape.insert(shape.end(), sample.shape().begin(), sample.shape().end());
    batch_ = Tensor::empty(std::move(shape), sample.dtype());
    next_ = static_cast<std::byte*>(batch_.raw_data());
    sample_bytes_ = sample.nbytes();
  } else if (sample.dtype() != batch_.dtype() || !same_shape(sample.shape(), batch_.shape().subspan(1))) {
    throw std::invalid_argument(
        "forkpool: DataLoader: the default collate stacks samples of one dtype and shape; "
        "sample " +
        std::to_string(added_) + " of the batch differs from the first (give a collate)");
  }
  copy_elements(sample, next_);
  next_ += sample_bytes_;
  ++added_;
}

Tensor Stacker::finish() {
  if (added_ == 0) throw std::invalid_argument("forkpool: DataLoader: a batch without samples");
  if (added_ != samples_) throw std::logic_error("forkpool: Stacker: fewer samples than the batch holds");
  return std::move(batch_);
}

Tensor stack(const std::vector<Tensor>& samples) {
  Stacker stacker(samples.size());
  for (const Tensor& sample : samples) stacker.add(sample);
  return stacker.finish();
}

}  // namespace forkpool::detail
