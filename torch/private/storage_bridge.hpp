#pragma once
// How a torch storage lies over forkpool memory, and which torch storage a block comes back on.

#include <ATen/core/Tensor.h>
#include <c10/core/Storage.h>
#include <c10/core/StorageImpl.h>

#include <cstddef>
#include <memory>

#include <forkpool/shm/internal/storage.hpp>

namespace forkpool::torch::detail {

// A torch storage over forkpool memory holds its forkpool storage: the block goes back when the
// last torch tensor on it goes. Its DataPtr's context is always a `const Holder*`, and its
// deleter says which of two kinds holds it:
// - a HeldStorage, the torch storages made here, which is the holder: one allocation;
// - a Holder of its own (let_go deletes it), for a storage share_memory moved in place.
using Holder = std::shared_ptr<forkpool::detail::Storage>;
// The two deleters that say a DataPtr is over forkpool memory (see above).
void let_go(void* holder);
void held_by_its_storage_impl(void*);
bool holds_forkpool_memory(const c10::DataPtr& data);
const Holder& holder_of(const c10::DataPtr& data);

struct HeldStorage final : c10::StorageImpl {
  explicit HeldStorage(Holder storage)
      : c10::StorageImpl(use_byte_size_t(), static_cast<std::int64_t>(storage->size()),
                         // (the member's address is known before it is built; it is read after)
                         c10::DataPtr(storage->data(), &holder, &held_by_its_storage_impl, c10::Device(c10::kCPU)),
                         nullptr, false),
        holder(std::move(storage)) {}
  // When the last torch::Tensor goes (a weak handle may keep this object a while): the block
  // goes too. Its storage's binding drops that weak handle, which cannot be the last here
  // (intrusive_ptr holds one more while it calls this).
  void release_resources() override {
    c10::StorageImpl::release_resources();
    holder.reset();
  }
  // Lies over `storage` from now on, or over no memory when it is null (a kept tensor waiting).
  void hold(Holder storage) {
    holder = std::move(storage);
    set_data_ptr_noswap(
        c10::DataPtr(holder ? holder->data() : nullptr, &holder, &held_by_its_storage_impl, c10::Device(c10::kCPU)));
    set_nbytes(holder ? holder->size() : 0);
  }
  Holder holder;
};

// A DataPtr for share_memory's move in place (a torch storage not made here).
c10::DataPtr data_ptr_over(Holder storage);

// The forkpool storage under `tensor` if it is shared (is_shared), else null.
const Holder* shared_storage_of(const at::Tensor& tensor);

// Under the storage's lock: `over_it` becomes the torch storage it names.
void remember_torch_storage(forkpool::detail::Storage::Binding& binding, c10::StorageImpl* over_it);

// Whether a new torch storage is named in its forkpool storage for the next tensor over it.
// Tensors made here (from_forkpool, empty, zeros, share_memory) are: a block that comes back to
// this process while one of them lives arrives on its storage. Tensors decoded from a message
// are not: a worker's argument storage is gone after its task, and the naming would cost every
// round trip more than it saves.
enum class Remember { yes, no };

// The torch storage over `storage` for a tensor that reaches its first `reach` bytes: the one
// this process named while any tensor uses it (so a block that comes back is on the storage it
// left, as torch.multiprocessing's shared_cache makes it, and costs no new one), else a new one.
c10::Storage torch_storage_over(const Holder& storage, std::size_t reach, Remember remember);

}  // namespace forkpool::torch::detail
