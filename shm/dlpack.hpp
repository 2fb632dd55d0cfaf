#pragma once
// DLPack interchange (dlpack/dlpack.h): share tensors with other libraries without copies.

#include <dlpack/dlpack.h>

#include <forkpool/shm/tensor.hpp>

namespace forkpool {

// A DLManagedTensor viewing `tensor`'s memory; it keeps the storage alive until its deleter runs.
DLManagedTensor* to_dlpack(const Tensor& tensor);

// Takes ownership of `managed` (its deleter runs when the last holder lets go). A tensor that
// came from to_dlpack() is shared memory again; any other memory is not shared: is_shared() is
// false and sending it throws until share_memory_() copies it, once, into shared memory.
// Throws std::invalid_argument for a device other than the CPU, an unsupported dtype or negative
// strides.
Tensor from_dlpack(DLManagedTensor* managed);

}  // namespace forkpool
