#include <forkpool/torch/tensors.hpp>

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include <forkpool/runtime/error.hpp>
#include <forkpool/shm/internal/storage.hpp>
#include <forkpool/shm/tensor_codec.hpp>
#include <forkpool/torch/private/dtypes.hpp>
#include <forkpool/torch/private/reuse_caches.hpp>
#include <forkpool/torch/private/storage_bridge.hpp>

namespace forkpool::torch {

using namespace detail;  // this library's own internals

bool is_shared(const at::Tensor& tensor) { return shared_storage_of(tensor) != nullptr; }

::torch::nn::Module& share_memory(::torch::nn::Module& module) {
  // (Each a handle on the module's own tensor: its storage moves for the module too.)
  for (at::Tensor tensor : module.parameters())
    if (tensor.defined()) share_memory(tensor);
  for (at::Tensor tensor : module.buffers())
    if (tensor.defined()) share_memory(tensor);
  return module;
}

at::Tensor from_forkpool(const Tensor& tensor) {
  const Holder& storage = tensor.storage();
  if (!storage || !storage->is_shared()) throw Error("forkpool-torch: from_forkpool needs a tensor in shared memory");
  std::size_t element_bytes = element_size(tensor.dtype());
  std::optional<std::int64_t> offset = element_offset(tensor.storage_offset(), element_bytes);
  if (!offset)
    throw Error("forkpool-torch: from_forkpool: the tensor " + misplaced_view(tensor.storage_offset(), element_bytes) +
                ", which a torch::Tensor cannot start at");
  std::size_t extent =
      forkpool::detail::view_extent(tensor.shape(), tensor.strides(), element_bytes).value_or(storage->size());
  return tensor_over(storage, *offset, tensor.shape(), tensor.strides(), scalar_type_of(tensor.dtype()), extent,
                     Remember::yes);
}

Tensor to_forkpool(const at::Tensor& tensor) {
  const Holder* storage = shared_storage_of(tensor);
  if (!storage) throw Error("forkpool-torch: to_forkpool needs a tensor in shared memory (share_memory() it)");
  Element element = element_of(tensor.scalar_type());
  if (element.complex)
    throw Error(
        "forkpool-torch: to_forkpool: forkpool has no complex dtype; at::view_as_real(t) is the same memory "
        "as its real and imaginary parts");
  auto element_bytes = static_cast<std::int64_t>(tensor.element_size());
  return forkpool::detail::tensor_from_storage(*storage, tensor.storage_offset() * element_bytes,
                                               span_of(tensor.sizes()), span_of(tensor.strides()), element.dtype);
}

at::Tensor empty(at::IntArrayRef sizes, const c10::TensorOptions& options) {
  if (!options.device().is_cpu()) throw Error("forkpool-torch: shared tensors live on the CPU");
  if (options.layout() != at::kStrided) throw Error("forkpool-torch: shared tensors are dense (strided), not sparse");
  at::ScalarType type = c10::typeMetaToScalarType(options.dtype());
  Element element = element_of(type);
  at::Tensor out;
  if (!element.complex) {
    out = from_forkpool(Tensor::empty(vector_of(sizes), element.dtype));
  } else {
    std::vector<std::int64_t> parts_shape = vector_of(sizes);
    parts_shape.push_back(2);
    Tensor parts = Tensor::empty(std::move(parts_shape), element.dtype);
    Dims complex;
    complex_view_of(parts.shape(), parts.strides(), complex);  // (laid out so by Tensor::empty)
    out = tensor_over(parts.storage(), 0, complex.shape(), complex.strides(), type, parts.nbytes(), Remember::yes);
  }
  // A memory format lays the same dense block out another way, as torch::empty does.
  at::MemoryFormat format = options.memory_format_opt().value_or(at::MemoryFormat::Contiguous);
  if (format != at::MemoryFormat::Contiguous) {
    std::int64_t rank = format == at::MemoryFormat::ChannelsLast     ? 4
                        : format == at::MemoryFormat::ChannelsLast3d ? 5
                                                                     : -1;
    if (out.dim() != rank)
      throw Error(std::string("forkpool-torch: memory format ") + c10::toString(format) + " for a tensor of " +
                  std::to_string(out.dim()) + " dimensions (channels_last needs 4, channels_last_3d 5)");
    out.unsafeGetTensorImpl()->empty_tensor_restride(format);
  }
  if (options.requires_grad()) out.requires_grad_(true);
  return out;
}

at::Tensor zeros(at::IntArrayRef sizes, const c10::TensorOptions& options) {
  at::Tensor out = empty(sizes, options.requires_grad(false));
  out.zero_();
  if (options.requires_grad()) out.requires_grad_(true);
  return out;
}

at::Tensor& share_memory(at::Tensor& tensor) {
  check_shareable(tensor);
  if (is_shared(tensor)) return tensor;
  c10::Storage storage = tensor.storage();
  std::size_t bytes = storage.nbytes();
  Tensor block = Tensor::empty({static_cast<std::int64_t>(std::max<std::size_t>(bytes, 1))}, DType::u8);
  if (bytes > 0) std::memcpy(block.raw_data(), storage.data(), bytes);
  // The storage itself moves: every tensor on it sees shared memory from here on. It no longer
  // grows, as torch's shared storages: grown, it would leave for memory of its own.
  storage.unsafeGetStorageImpl()->set_data_ptr_noswap(data_ptr_over(block.storage()));
  storage.unsafeGetStorageImpl()->set_resizable(false);
  block.storage()->with_binding([&](forkpool::detail::Storage::Binding& binding) {
    remember_torch_storage(binding, storage.unsafeGetStorageImpl());
  });
  return tensor;
}

at::Tensor collate(std::vector<at::Tensor> samples) {
  if (samples.empty()) throw std::invalid_argument("forkpool-torch: collate: a batch without samples");
  const at::Tensor& first = samples.front();
  for (std::size_t i = 1; i < samples.size(); ++i)
    if (samples[i].scalar_type() != first.scalar_type() || samples[i].sizes() != first.sizes())
      throw std::invalid_argument("forkpool-torch: collate: sample " + std::to_string(i) +
                                  " of the batch differs from the first in dtype or shape");
  std::vector<std::int64_t> sizes{static_cast<std::int64_t>(samples.size())};
  sizes.insert(sizes.end(), first.sizes().begin(), first.sizes().end());
  at::Tensor batch = empty(sizes, at::TensorOptions().dtype(first.scalar_type()));
  for (std::size_t i = 0; i < samples.size(); ++i) batch[static_cast<std::int64_t>(i)].copy_(samples[i]);
  return batch;
}

}  // namespace forkpool::torch
