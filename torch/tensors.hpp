#pragma once
// forkpool-torch: torch::Tensor as a value a task takes and returns, and as a Queue or Pipe item.
// A tensor whose storage is forkpool shared memory crosses with no copy, both ways, with its
// dtype, shape, strides and storage offset; an ordinary one is copied once into shared memory
// when it is sent (as torch.multiprocessing does on a first send). A tensor that arrives is a
// torch::Tensor over the same recycled block: when its last user lets go, the block goes home.
//
// requires_grad crosses as a flag (autograd state does not); a non-leaf tensor that requires
// grad is an Error (detach() it), as in torch.multiprocessing. CUDA, sparse, quantized and nested
// tensors, dtypes without a forkpool DType (complex), negative views, named tensors and zero
// tensors are an Error before anything is sent.
//
//   torch::Tensor w = forkpool::torch::zeros({1024, 1024});    // in shared memory
//   co_await pool.apply_async(train_step, w);                    // the worker writes w itself

#include <ATen/core/Tensor.h>
#include <c10/core/TensorOptions.h>

#include <cstdint>
#include <vector>

#include <forkpool/ipc/codec.hpp>
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

// The same memory seen the other way: a forkpool Tensor over a shared torch tensor's storage
// (Error when it is not shared), and a torch tensor over a forkpool Tensor's.
Tensor to_forkpool(const at::Tensor& tensor);
at::Tensor from_forkpool(const Tensor& tensor);

}  // namespace forkpool::torch

namespace forkpool {

template <>
struct codec<at::Tensor> {
  static constexpr std::size_t min_size = 2;
  static void encode(Writer& w, const at::Tensor& tensor);
  static at::Tensor decode(Reader& r);
};

}  // namespace forkpool
