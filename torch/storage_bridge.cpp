#include <forkpool/torch/private/storage_bridge.hpp>

#include <optional>
#include <utility>

namespace forkpool::torch::detail {

namespace {

// A forkpool storage keeps a weak handle to the torch storage over it (Storage::with_binding):
// weak, since the torch storage holds the forkpool one.
void drop_weak_handle(void* impl) noexcept {
  c10::raw::weak_intrusive_ptr::decref(static_cast<c10::StorageImpl*>(impl));
}

// Whether `impl` still lies over `storage` (nobody gave it other memory since) and reaches its
// first `bytes` (share_memory's torch storage may be shorter than the block it moved into).
bool lies_over(const c10::StorageImpl& impl, const Holder& storage, std::size_t bytes) {
  const c10::DataPtr& data = impl.data_ptr();
  return holds_forkpool_memory(data) && holder_of(data) == storage && impl.nbytes() >= bytes;
}

}  // namespace

void let_go(void* holder) { delete static_cast<Holder*>(holder); }
void held_by_its_storage_impl(void*) {}  // HeldStorage lets go of it

bool holds_forkpool_memory(const c10::DataPtr& data) {
  return data.get_deleter() == &held_by_its_storage_impl || data.get_deleter() == &let_go;
}
const Holder& holder_of(const c10::DataPtr& data) { return *static_cast<const Holder*>(data.get_context()); }

// A DataPtr for share_memory's move in place (a torch storage not made here).
c10::DataPtr data_ptr_over(Holder storage) {
  std::byte* data = storage->data();
  return c10::DataPtr(data, new Holder(std::move(storage)), &let_go, c10::Device(c10::kCPU));
}

// The forkpool storage under `tensor` if it is shared (is_shared), else null.
const Holder* shared_storage_of(const at::Tensor& tensor) {
  if (!tensor.defined()) return nullptr;
  // (unsafe_storage: inline, where has_storage() and storage() are virtual calls into libc10; a
  // tensor without a storage of its own has an empty one here, or one that is not forkpool's.)
  const c10::Storage& storage = tensor.unsafeGetTensorImpl()->unsafe_storage();
  if (!storage) return nullptr;
  const c10::DataPtr& data = storage.data_ptr();
  return holds_forkpool_memory(data) ? &holder_of(data) : nullptr;
}

// Under the storage's lock: `over_it` becomes the torch storage it names.
void remember_torch_storage(forkpool::detail::Storage::Binding& binding, c10::StorageImpl* over_it) {
  c10::raw::weak_intrusive_ptr::incref(over_it);
  if (binding.release) binding.release(binding.object);  // a weak handle holds no forkpool storage
  binding = {over_it, &drop_weak_handle};
}

// The torch storage over `storage` for a tensor that reaches its first `reach` bytes: the one
// this process named while any tensor uses it (so a block that comes back is on the storage it
// left, as torch.multiprocessing's shared_cache makes it, and costs no new one), else a new one.
c10::Storage torch_storage_over(const Holder& storage, std::size_t reach, Remember remember) {
  auto make = [&] { return c10::Storage(c10::make_intrusive<HeldStorage>(storage)); };
  // None named (a worker's decode): no lock to take.
  if (remember == Remember::no && !storage->has_binding()) return make();
  c10::intrusive_ptr<c10::StorageImpl> known;  // let go after the lock when it does not fit
  std::optional<c10::Storage> made;
  storage->with_binding([&](forkpool::detail::Storage::Binding& binding) {
    if (binding.object) {
      // The binding's weak handle keeps the pointer valid while the lock is held.
      known = c10::intrusive_ptr<c10::StorageImpl>::reclaim(
          c10::raw::weak_intrusive_ptr::lock(static_cast<c10::StorageImpl*>(binding.object)));
      if (known && lies_over(*known, storage, reach)) return;
    }
    made.emplace(make());
    if (remember == Remember::yes) remember_torch_storage(binding, made->unsafeGetStorageImpl());
  });
  return made ? std::move(*made) : c10::Storage(std::move(known));
}

}  // namespace forkpool::torch::detail
