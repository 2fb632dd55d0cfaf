// codec<at::Tensor>: a torch::Tensor as a forkpool tensor view and a byte of flags.
#include <forkpool/torch/tensors.hpp>

#include <ATen/ATen.h>

#include <cstdint>
#include <cstring>
#include <optional>
#include <span>
#include <string>

#include <forkpool/runtime/error.hpp>
#include <forkpool/shm/tensor_codec.hpp>
#include <forkpool/torch/private/dtypes.hpp>
#include <forkpool/torch/private/reuse_caches.hpp>
#include <forkpool/torch/private/storage_bridge.hpp>

namespace forkpool {
namespace {

// After the view, a byte of flags: what a torch::Tensor is beyond a forkpool view.
enum TensorFlags : std::uint8_t {
  kRequiresGrad = 1,
  kComplex = 2,  // the view is of its elements' parts (torch::parts_of)
};

// `shape` and `strides` count elements of `element`: a complex view is written as its parts'.
void encode_view(Writer& w, const torch::detail::Holder& storage, std::int64_t byte_offset, at::IntArrayRef shape,
                 at::IntArrayRef strides, torch::detail::Element element) {
  if (!element.complex) {
    detail::encode_tensor_view(w, storage, byte_offset, torch::detail::span_of(shape), torch::detail::span_of(strides),
                               element.dtype);
    return;
  }
  torch::detail::Dims parts = torch::detail::parts_of(torch::detail::span_of(shape), torch::detail::span_of(strides));
  detail::encode_tensor_view(w, storage, byte_offset, parts.shape(), parts.strides(), element.dtype);
}

}  // namespace

void codec<at::Tensor>::encode(Writer& w, const at::Tensor& tensor) {
  torch::detail::Element element = torch::detail::check_shareable(tensor);
  bool requires_grad = tensor.requires_grad();
  if (requires_grad && !tensor.is_leaf())
    throw Error(
        "forkpool-torch: a non-leaf tensor that requires grad cannot cross (autograd state does not): detach() it");
  if (const torch::detail::Holder* storage = torch::detail::shared_storage_of(tensor)) {
    // As codec<Tensor> writes its to_forkpool(), without making it.
    auto element_bytes = static_cast<std::int64_t>(tensor.element_size());
    encode_view(w, *storage, tensor.storage_offset() * element_bytes, tensor.sizes(), tensor.strides(), element);
  } else {
    // Copied once into shared memory, laid out as it is when its elements are dense (a transpose,
    // channels_last: torch.multiprocessing moves the storage, strides and all), else made dense
    // in its memory format first.
    at::Tensor made_dense;  // (read through `tensor` itself when it is dense: no op to dispatch)
    if (!tensor.is_non_overlapping_and_dense()) made_dense = tensor.detach().contiguous(tensor.suggest_memory_format());
    const at::Tensor& dense = made_dense.defined() ? made_dense : tensor;
    Tensor copy = Tensor::empty({dense.numel() * (element.complex ? 2 : 1)}, element.dtype);
    if (copy.nbytes() > 0) std::memcpy(copy.raw_data(), dense.data_ptr(), copy.nbytes());
    encode_view(w, copy.storage(), 0, dense.sizes(), dense.strides(), element);
  }
  w.write(static_cast<std::uint8_t>((requires_grad ? kRequiresGrad : 0) | (element.complex ? kComplex : 0)));
}

at::Tensor codec<at::Tensor>::decode(Reader& r) {
  detail::TensorView view;  // as codec<Tensor> reads it, without making the Tensor
  detail::decode_tensor_view(r, view);
  auto flags = r.read<std::uint8_t>();
  if (flags & ~(kRequiresGrad | kComplex))
    r.fail("a torch::Tensor arrived with flags " + std::to_string(flags) + ", which name nothing");
  if (!view.storage || !view.storage->is_shared()) r.fail("a torch::Tensor arrived without shared memory under it");
  at::ScalarType type = torch::detail::scalar_type_of(view.dtype);
  std::span<const std::int64_t> shape = view.shape(), strides = view.strides();
  torch::detail::Dims complex;  // (its arrays left unset: a decode's hot path)
  if (flags & kComplex) {
    std::optional<at::ScalarType> complex_type = torch::detail::complex_of(view.dtype);
    if (!complex_type || !torch::detail::complex_view_of(shape, strides, complex))
      r.fail(
          "a complex torch::Tensor arrived whose parts are not two of a floating dtype in a last dimension of "
          "stride 1, as at::view_as_real lays them out");
    type = *complex_type;
    shape = complex.shape();
    strides = complex.strides();
  }
  std::optional<std::int64_t> offset = torch::detail::element_offset(view.byte_offset, c10::elementSize(type));
  if (!offset)
    r.fail("a torch::Tensor arrived that " + torch::detail::misplaced_view(view.byte_offset, c10::elementSize(type)));
  at::Tensor out =
      torch::detail::decoded_tensor_over(std::move(view.storage), *offset, shape, strides, type, view.extent);
  if (flags & kRequiresGrad) {
    // (libtorch throws its own c10::Error for the others; a message that says so is malformed.)
    if (!at::isFloatingType(type) && !at::isComplexType(type))
      r.fail(std::string("a torch::Tensor of dtype ") + c10::toString(type) +
             " arrived requiring grad, which only floating and complex dtypes can");
    out.requires_grad_(true);
  }
  return out;
}

}  // namespace forkpool
