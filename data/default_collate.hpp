#pragma once
// DefaultCollate<Sample>: what a DataLoader makes of a batch of samples when it is given no
// collate. A library above forkpool may specialize it for its own sample types (forkpool-torch
// does, in <forkpool/torch.hpp>); a specialization must be seen before the DataLoader that uses it.

#include <vector>

#include <forkpool/shm/tensor.hpp>

namespace forkpool {

namespace detail {
// `samples` stacked into one batch tensor in shared memory, a leading batch dimension added.
// Throws std::invalid_argument naming the first sample whose dtype or shape differs.
Tensor stack(const std::vector<Tensor>& samples);
}  // namespace detail

// What a DataLoader's default collate makes of a batch of `Sample`s, as torch's default_collate:
// forkpool Tensors stack into one batch tensor; samples of other kinds make a vector, unless a
// specialization says otherwise (forkpool-torch stacks at::Tensor samples and collates pairs and
// tuples of tensors and numbers field by field: include <forkpool/torch.hpp> before the loader).
template <class Sample>
struct DefaultCollate {
  using Batch = std::vector<Sample>;
  static Batch collate(std::vector<Sample> samples) { return samples; }
};
template <>
struct DefaultCollate<Tensor> {
  using Batch = Tensor;
  static Tensor collate(const std::vector<Tensor>& samples) { return detail::stack(samples); }
};

}  // namespace forkpool
