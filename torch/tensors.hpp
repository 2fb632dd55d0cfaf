#pragma once
// forkpool-torch: torch::Tensor as a value a task takes and returns, and as a Queue or Pipe item.
// A tensor whose storage is forkpool shared memory crosses with no copy, both ways, with its
// dtype, shape, strides and storage offset; an ordinary one is copied once into shared memory
// when it is sent (as torch.multiprocessing does on a first send). A tensor that arrives is a
// torch::Tensor over the same recycled block: when its last user lets go, the block goes home.
//
// Every dtype libtorch and DLPack share crosses; a complex tensor as its real and imaginary
// parts (at::view_as_real's layout), since forkpool has no complex DType. requires_grad crosses
// as a flag (autograd state does not); a non-leaf tensor that requires grad is an Error (detach()
// it), as in torch.multiprocessing. CUDA, sparse, quantized and nested tensors, negative and
// conjugate views, named tensors and zero tensors are an Error before anything is sent.
//
//   torch::Tensor w = forkpool::torch::zeros({1024, 1024});    // in shared memory
//   co_await pool.apply_async(train_step, w);                    // the worker writes w itself

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <c10/core/TensorOptions.h>

#include <cstdint>
#include <stdexcept>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <forkpool/ipc/codec.hpp>
#include <forkpool/data/default_collate.hpp>
#include <forkpool/shm/tensor.hpp>

namespace torch::nn {
class Module;  // <torch/nn/module.h>, which this header need not cost its users
}

namespace forkpool::torch {

// A tensor whose storage is forkpool shared memory (options: dtype, requires_grad, a memory
// format such as channels_last; the device must be CPU, the layout strided). Throws Error for
// a dtype, device, layout or memory format forkpool cannot make.
at::Tensor empty(at::IntArrayRef sizes, const c10::TensorOptions& options = {});
at::Tensor zeros(at::IntArrayRef sizes, const c10::TensorOptions& options = {});
// Moves `tensor`'s storage into shared memory in place (every tensor on that storage follows),
// as torch's share_memory_(); nothing to do when it is there already. Returns `tensor`.
at::Tensor& share_memory(at::Tensor& tensor);
// Every parameter and buffer of `module` and its submodules, as torch's Module.share_memory():
// the module's own tensors move, so a copy of the module's parameters sent to a worker is
// the model itself. Returns `module`.
//   auto model = torch::nn::Linear(16, 4);
//   forkpool::torch::share_memory(*model);
::torch::nn::Module& share_memory(::torch::nn::Module& module);
bool is_shared(const at::Tensor& tensor);

// A DataLoader collate for torch::Tensor samples: one batch tensor in shared memory, stacked
// along a new first dimension (the samples: one dtype and shape, else std::invalid_argument).
//   forkpool::DataLoader loader(images, {.batch_size = 64}, &forkpool::torch::collate);
at::Tensor collate(std::vector<at::Tensor> samples);

// A DataLoader collate for samples that are pairs or tuples of tensors and numbers, as torch's
// default_collate takes an (image, label) sample: one batch tensor per field, in shared memory.
// Tensor fields stack as `collate` stacks them; number fields (int64_t, int, double, float,
// bool, ...) make a 1-D tensor of their own dtype. Give the sample type, as a collate is a
// function pointer:
//   forkpool::DataLoader loader(labelled, {.batch_size = 64},
//                               &forkpool::torch::collate_fields<std::pair<at::Tensor, std::int64_t>>);
//   for (auto& [images, labels] : loader) ...
template <class Sample>
auto collate_fields(std::vector<Sample> samples);

// The same memory seen the other way: a forkpool Tensor over a shared torch tensor's storage
// (Error when it is not shared, or complex: forkpool has no complex DType, and
// at::view_as_real(t) is the same memory as parts), and a torch tensor over a forkpool Tensor's.
Tensor to_forkpool(const at::Tensor& tensor);
at::Tensor from_forkpool(const Tensor& tensor);

namespace detail {

// A field of a collate_fields sample: a tensor, or a number libtorch has a dtype for.
template <class Field>
concept CollatedField = std::is_same_v<Field, at::Tensor> ||
    (std::is_arithmetic_v<Field>&& requires { c10::CppTypeToScalarType<Field>::value; });

template <class Sample>
struct FieldsOf;
template <class... Fields>
struct FieldsOf<std::tuple<Fields...>> {
  template <class... T>
  using Batch = std::tuple<T...>;
};
template <class A, class B>
struct FieldsOf<std::pair<A, B>> {
  template <class T, class U>
  using Batch = std::pair<T, U>;
};

// Field `I` of every sample, as one batch tensor.
template <std::size_t I, class Sample>
at::Tensor collate_field(const std::vector<Sample>& samples) {
  using Field = std::tuple_element_t<I, Sample>;
  static_assert(CollatedField<Field>, "forkpool-torch: collate_fields: each field is an at::Tensor or a number");
  if constexpr (std::is_same_v<Field, at::Tensor>) {
    std::vector<at::Tensor> tensors;
    tensors.reserve(samples.size());
    for (const Sample& sample : samples) tensors.push_back(std::get<I>(sample));
    return collate(std::move(tensors));
  } else {
    if (samples.empty()) throw std::invalid_argument("forkpool-torch: collate_fields: a batch without samples");
    at::Tensor batch = empty({static_cast<std::int64_t>(samples.size())},
                             c10::TensorOptions().dtype(c10::CppTypeToScalarType<Field>::value));
    Field* values = batch.data_ptr<Field>();
    for (std::size_t i = 0; i < samples.size(); ++i) values[i] = std::get<I>(samples[i]);
    return batch;
  }
}

template <std::size_t>
using TensorOfField = at::Tensor;

template <class Sample, std::size_t... I>
auto collate_each_field(const std::vector<Sample>& samples, std::index_sequence<I...>) {
  using Batch = typename FieldsOf<Sample>::template Batch<TensorOfField<I>...>;
  return Batch{collate_field<I>(samples)...};
}

}  // namespace detail

template <class Sample>
auto collate_fields(std::vector<Sample> samples) {
  return detail::collate_each_field(samples, std::make_index_sequence<std::tuple_size_v<Sample>>{});
}

}  // namespace forkpool::torch

namespace forkpool {

// A DataLoader's default collate of libtorch samples, as torch's default_collate: tensors stack
// into one batch tensor in shared memory; pairs and tuples of tensors and numbers collate field
// by field (forkpool::torch::collate, collate_fields).
template <>
struct DefaultCollate<at::Tensor> {
  using Batch = at::Tensor;
  static at::Tensor collate(std::vector<at::Tensor> samples) { return torch::collate(std::move(samples)); }
};
template <class A, class B>
requires(torch::detail::CollatedField<A>&& torch::detail::CollatedField<B>) struct DefaultCollate<std::pair<A, B>> {
  using Batch = std::pair<at::Tensor, at::Tensor>;
  static Batch collate(std::vector<std::pair<A, B>> samples) { return torch::collate_fields(std::move(samples)); }
};
template <class... Fields>
requires(torch::detail::CollatedField<Fields>&&...) struct DefaultCollate<std::tuple<Fields...>> {
  using Batch = decltype(torch::collate_fields(std::declval<std::vector<std::tuple<Fields...>>>()));
  static Batch collate(std::vector<std::tuple<Fields...>> samples) { return torch::collate_fields(std::move(samples)); }
};

template <>
struct codec<at::Tensor> {
  static constexpr std::size_t min_size = 2;
  static void encode(Writer& w, const at::Tensor& tensor);
  static at::Tensor decode(Reader& r);
};

}  // namespace forkpool
