#pragma once
// The indices of one DataLoader batch, as the sampler made them and as they cross to a worker.
// A run of consecutive indices (every batch of a sequential sampler) is two numbers, whatever
// the batch size: a batch of 64 costs 17 bytes on the wire instead of 520, and the worker builds
// no list. Any other order (a shuffled batch) is the list itself.

#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <forkpool/ipc/codec.hpp>

namespace forkpool::detail {

class IndexBatch {
 public:
  IndexBatch() = default;
  // The run [first, first + count).
  static IndexBatch run(std::uint64_t first, std::uint64_t count) noexcept {
    IndexBatch batch;
    batch.first_ = first;
    batch.count_ = count;
    return batch;
  }
  // `indices` in their order: a run when they are consecutive.
  static IndexBatch of(std::span<const std::uint64_t> indices) {
    bool consecutive = true;
    for (std::size_t i = 1; i < indices.size() && consecutive; ++i) consecutive = indices[i] == indices[0] + i;
    if (consecutive) return run(indices.empty() ? 0 : indices[0], indices.size());
    IndexBatch batch;
    batch.list_.assign(indices.begin(), indices.end());
    return batch;
  }

  std::size_t size() const noexcept { return is_run() ? static_cast<std::size_t>(count_) : list_.size(); }
  std::uint64_t operator[](std::size_t i) const noexcept { return is_run() ? first_ + i : list_[i]; }
  bool is_run() const noexcept { return list_.empty(); }

 private:
  friend struct codec<IndexBatch>;
  std::uint64_t first_ = 0;          // a run's
  std::uint64_t count_ = 0;          // a run's
  std::vector<std::uint64_t> list_;  // empty for a run
};

}  // namespace forkpool::detail

namespace forkpool {

// [u8 1][u64 first][u64 count] for a run, [u8 0][the list as a vector] otherwise. A run that
// would pass the largest index, or a list of one index or fewer (always a run), is malformed.
template <>
struct codec<detail::IndexBatch> {
  static constexpr std::size_t min_size = 1 + 2 * sizeof(std::uint64_t);
  static void encode(Writer& w, const detail::IndexBatch& batch) {
    w.write(static_cast<std::uint8_t>(batch.is_run()));
    if (batch.is_run()) {
      w.write(batch.first_);
      w.write(batch.count_);
    } else {
      w.write(batch.list_);
    }
  }
  static detail::IndexBatch decode(Reader& r) {
    auto kind = r.read<std::uint8_t>();
    if (kind == 1) {
      auto first = r.read<std::uint64_t>();
      auto count = r.read<std::uint64_t>();
      if (count > std::numeric_limits<std::uint64_t>::max() - first) r.fail("a batch of indices past the largest");
      return detail::IndexBatch::run(first, count);
    }
    if (kind != 0) r.fail("a batch of indices of unknown kind " + std::to_string(kind));
    auto list = r.read<std::vector<std::uint64_t>>();
    if (list.size() < 2) r.fail("a list of indices that should have been a run");
    detail::IndexBatch batch;
    batch.list_ = std::move(list);
    return batch;
  }
};

}  // namespace forkpool
