#pragma once
// A torch::Tensor in forkpool's terms: its elements (a complex one as its two parts), the keys of
// a plain CPU tensor, a view's shape and strides, and its offset in elements.

#include <ATen/core/Tensor.h>
#include <c10/core/DispatchKeySet.h>
#include <c10/core/ScalarType.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <forkpool/shm/tensor.hpp>
#include <forkpool/shm/tensor_codec.hpp>

namespace forkpool::torch::detail {

// What a tensor's elements are made of in forkpool's terms. forkpool has no complex DType: a
// complex element is two of its parts' DType, its real and imaginary parts, laid out as
// at::view_as_real lays them out (one more dimension, of 2 with stride 1).
struct Element {
  DType dtype;
  bool complex = false;
};

Element element_of(at::ScalarType type);
// The complex dtype whose parts are `part`, where libtorch has one.
std::optional<at::ScalarType> complex_of(DType part);
at::ScalarType scalar_type_of(DType dtype);

// The dispatch keys libtorch gives a new CPU tensor outside and inside InferenceMode: a dense
// tensor on the CPU and nothing more (no view that is read negated or conjugated, not sparse,
// quantized, nested or a zero tensor: each its own key).
const std::array<c10::DispatchKeySet, 2>& new_cpu_tensor_key_sets();
// Whether InferenceMode is on in the calling thread.
bool inference_mode_on();
// The keys of a new CPU tensor in the InferenceMode that is on now.
c10::DispatchKeySet new_cpu_tensor_keys();

// What the tensor's elements are made of, when forkpool can share it; else an Error naming why not.
Element check_shareable(const at::Tensor& tensor);

std::vector<std::int64_t> vector_of(at::IntArrayRef values);
inline std::span<const std::int64_t> span_of(at::IntArrayRef values) { return {values.data(), values.size()}; }

// A view's shape and strides, built here (a complex view's, or its parts').
struct Dims {
  std::array<std::int64_t, forkpool::detail::TensorView::kMaxDims> shape_values, stride_values;
  std::size_t count = 0;
  std::span<const std::int64_t> shape() const noexcept { return {shape_values.data(), count}; }
  std::span<const std::int64_t> strides() const noexcept { return {stride_values.data(), count}; }
};

// The view of a complex view's parts, as at::view_as_real makes it: one more dimension, of the
// 2 parts with stride 1, and every other stride doubled. Throws Error past kMaxDims or 64 bits.
Dims parts_of(std::span<const std::int64_t> shape, std::span<const std::int64_t> strides);
// Whether `shape` and `strides` view parts laid out as parts_of lays them out; if so, `complex` is
// the complex view they are the parts of. (An out-parameter, not an optional: GCC zeroes an empty
// std::optional's whole payload, here 1 KiB, and codec<at::Tensor>::decode would pay it on every
// decode, PR 86173.)
bool complex_view_of(std::span<const std::int64_t> shape, std::span<const std::int64_t> strides, Dims& complex);

// A torch storage offset counts elements, a forkpool one bytes: a forkpool view may start inside
// an element, and then no torch::Tensor can be that view (nullopt).
std::optional<std::int64_t> element_offset(std::int64_t byte_offset, std::size_t element_bytes);
// Why such a view cannot be a torch::Tensor.
std::string misplaced_view(std::int64_t byte_offset, std::size_t element_bytes);

}  // namespace forkpool::torch::detail
