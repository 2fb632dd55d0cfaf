#include <forkpool/torch/private/dtypes.hpp>

#include <ATen/ATen.h>
#include <c10/core/AutogradState.h>
#include <c10/core/InferenceMode.h>

#include <bit>

#include <forkpool/runtime/error.hpp>

namespace forkpool::torch::detail {

namespace {

DType real_dtype_of(at::ScalarType type) {
  switch (type) {
    case at::kByte: return DType::u8;
    case at::kChar: return DType::i8;
    case at::kShort: return DType::i16;
    case at::kInt: return DType::i32;
    case at::kLong: return DType::i64;
    case at::kHalf: return DType::f16;
    case at::kBFloat16: return DType::bf16;
    case at::kFloat: return DType::f32;
    case at::kDouble: return DType::f64;
    case at::kBool: return DType::boolean;
    default: throw Error(std::string("forkpool-torch: a tensor of dtype ") + c10::toString(type) + " cannot be shared");
  }
}

}  // namespace

Element element_of(at::ScalarType type) {
  if (at::isComplexType(type)) return {real_dtype_of(c10::toRealValueType(type)), true};
  return {real_dtype_of(type)};
}

// The complex dtype whose parts are `part`, where libtorch has one.
std::optional<at::ScalarType> complex_of(DType part) {
  switch (part) {
    case DType::f16: return at::kComplexHalf;
    case DType::f32: return at::kComplexFloat;
    case DType::f64: return at::kComplexDouble;
    default: return std::nullopt;
  }
}

at::ScalarType scalar_type_of(DType dtype) {
  switch (dtype) {
    case DType::u8: return at::kByte;
    case DType::i8: return at::kChar;
    case DType::i16: return at::kShort;
    case DType::i32: return at::kInt;
    case DType::i64: return at::kLong;
    case DType::f16: return at::kHalf;
    case DType::bf16: return at::kBFloat16;
    case DType::f32: return at::kFloat;
    case DType::f64: return at::kDouble;
    case DType::boolean: return at::kBool;
  }
  throw Error("forkpool-torch: a tensor of an unknown dtype");
}

// The dispatch keys libtorch gives a new CPU tensor outside and inside InferenceMode: a dense
// tensor on the CPU and nothing more (no view that is read negated or conjugated, not sparse,
// quantized, nested or a zero tensor: each its own key).
const std::array<c10::DispatchKeySet, 2>& new_cpu_tensor_key_sets() {
  static const std::array<c10::DispatchKeySet, 2> keys = [] {
    auto made_in = [](bool inference) {
      c10::InferenceMode mode(inference);
      return at::empty({0}, at::kFloat).key_set();
    };
    return std::array{made_in(false), made_in(true)};
  }();
  return keys;
}

// Whether InferenceMode is on in the calling thread, as InferenceMode::is_enabled() tells, read
// through the address of libc10's thread-local AutogradState, which this thread keeps: is_enabled()
// is two calls and a __tls_get_addr into libc10 (13 ns warm, about 40 ns in a round trip, paid on
// each side). (A TLS descriptor, as the loop's in libforkpool.)
bool inference_mode_on() {
  static thread_local const c10::AutogradState* state = nullptr;
  if (!state) state = &c10::AutogradState::get_tls_state();
  return state->get_inference_mode();
}

// The keys of a new CPU tensor in the InferenceMode that is on now. A tensor is made with them by
// TensorImpl's constructor that takes its keys as given (libtorch's views use it): the other one
// works them out from the backend's key on each call, most of its own time in a decode (perf: 8%
// of a decode's samples, 3% with the keys given). Both make the same tensor (TorchTest checks the
// keys).
c10::DispatchKeySet new_cpu_tensor_keys() { return new_cpu_tensor_key_sets()[inference_mode_on()]; }

// What the tensor's elements are made of, when forkpool can share it; else an Error naming why not.
Element check_shareable(const at::Tensor& tensor) {
  // Most tensors have a new tensor's keys, and then only the dtype is left to check (names, too,
  // are a key: Named).
  const c10::TensorImpl& impl = *tensor.unsafeGetTensorImpl();  // (undefined: keys of its own)
  const std::array<c10::DispatchKeySet, 2>& plain = new_cpu_tensor_key_sets();
  if (impl.key_set() == plain[0] || impl.key_set() == plain[1])
    return element_of(c10::typeMetaToScalarType(impl.dtype()));
  if (!tensor.defined()) throw Error("forkpool-torch: an undefined tensor cannot cross");
  if (!tensor.device().is_cpu())
    throw Error("forkpool-torch: a tensor on " + tensor.device().str() + " cannot cross: only CPU tensors are shared");
  if (tensor.is_nested()) throw Error("forkpool-torch: a nested tensor cannot cross: send its tensors (unbind())");
  if (tensor.layout() != at::kStrided) throw Error("forkpool-torch: a sparse tensor cannot cross: to_dense() it first");
  if (tensor.is_quantized()) throw Error("forkpool-torch: a quantized tensor cannot cross: dequantize() it first");
  // What a tensor is beyond its memory and view, which would not cross (each a bit to test).
  if (tensor.is_neg())
    throw Error("forkpool-torch: a negative view cannot cross (its values are read negated): resolve_neg() it first");
  if (tensor.is_conj())
    throw Error(
        "forkpool-torch: a conjugate view cannot cross (its values are read conjugated): resolve_conj() it first");
  if (tensor._is_zerotensor())
    throw Error("forkpool-torch: a zero tensor (no memory under it) cannot cross: clone() it first");
  if (tensor.has_names())
    throw Error(
        "forkpool-torch: a named tensor cannot cross (its names do not, as in torch.multiprocessing): "
        "rename(c10::nullopt) it first");
  return element_of(tensor.scalar_type());
}

std::vector<std::int64_t> vector_of(at::IntArrayRef values) { return {values.begin(), values.end()}; }

// The view of a complex view's parts, as at::view_as_real makes it: one more dimension, of the
// 2 parts with stride 1, and every other stride doubled.
Dims parts_of(std::span<const std::int64_t> shape, std::span<const std::int64_t> strides) {
  if (shape.size() >= forkpool::detail::TensorView::kMaxDims)
    throw Error("forkpool-torch: a complex tensor of " + std::to_string(shape.size()) +
                " dimensions cannot cross: its parts take one more, and a receiver reads at most " +
                std::to_string(forkpool::detail::TensorView::kMaxDims));
  Dims parts;
  parts.count = shape.size() + 1;
  for (std::size_t d = 0; d < shape.size(); ++d) {
    parts.shape_values[d] = shape[d];
    // (as_strided takes any stride for a dimension of one element)
    if (__builtin_mul_overflow(strides[d], 2, &parts.stride_values[d]))
      throw Error("forkpool-torch: a complex tensor with a stride of " + std::to_string(strides[d]) +
                  " elements cannot cross: its parts' stride, twice that, is past 64 bits");
  }
  parts.shape_values[shape.size()] = 2;
  parts.stride_values[shape.size()] = 1;
  return parts;
}

// Whether `shape` and `strides` view parts laid out as parts_of lays them out; if so, `complex` is
// the complex view they are the parts of. (An out-parameter, not an optional: GCC zeroes an empty
// std::optional's whole payload, here 1 KiB, and codec<at::Tensor>::decode would pay it on every
// decode, PR 86173.)
bool complex_view_of(std::span<const std::int64_t> shape, std::span<const std::int64_t> strides, Dims& complex) {
  if (shape.empty() || shape.back() != 2 || strides.back() != 1) return false;
  complex.count = shape.size() - 1;
  for (std::size_t d = 0; d < complex.count; ++d) {
    if (strides[d] % 2 != 0) return false;
    complex.shape_values[d] = shape[d];
    complex.stride_values[d] = strides[d] / 2;
  }
  return true;
}

// A torch storage offset counts elements, a forkpool one bytes: a forkpool view may start inside
// an element, and then no torch::Tensor can be that view. (Element sizes are powers of two: a
// shift, not a division, on every decode.)
std::optional<std::int64_t> element_offset(std::int64_t byte_offset, std::size_t element_bytes) {
  int shift = std::countr_zero(element_bytes);
  if (byte_offset & ((std::int64_t{1} << shift) - 1)) return std::nullopt;
  return byte_offset >> shift;
}

std::string misplaced_view(std::int64_t byte_offset, std::size_t element_bytes) {
  return "starts " + std::to_string(byte_offset) + " bytes into its storage, not at a whole element of " +
         std::to_string(element_bytes) + " bytes";
}

}  // namespace forkpool::torch::detail
