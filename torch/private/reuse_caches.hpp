#pragma once
// The torch::Tensors a decode makes, and the two caches that make them cheap: the parent's spare
// TensorImpl, made while its loop waits, and a pool worker's kept tensors, reused from task to
// task. Both are behind one switch: FORKPOOL_TORCH_CACHES=off in the environment turns them off
// (every tensor then made anew), and the torch suite runs once so to show they change no result.

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <cstdint>
#include <span>

#include <forkpool/torch/private/storage_bridge.hpp>

namespace forkpool::torch::detail {

// Whether the caches are on: read once, from FORKPOOL_TORCH_CACHES ("off": not).
bool reuse_caches_on() noexcept;

// A torch::Tensor over `storage`, viewed as given (its offset in elements), which reaches `extent`
// bytes from its offset (a view checked already: a decoded one, or a forkpool::Tensor's).
at::Tensor tensor_over(const Holder& storage, std::int64_t offset, std::span<const std::int64_t> shape,
                       std::span<const std::int64_t> strides, at::ScalarType type, std::size_t extent,
                       Remember remember);

// A decode's tensor: a pool worker's spare filled in when it has one (and the block has no torch
// storage named), else a new one, kept for reuse after the task when in a pool worker.
at::Tensor decoded_tensor_over(Holder storage, std::int64_t offset, std::span<const std::int64_t> shape,
                               std::span<const std::int64_t> strides, at::ScalarType type, std::size_t extent);

}  // namespace forkpool::torch::detail
