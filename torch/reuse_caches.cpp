#include <forkpool/torch/private/reuse_caches.hpp>

#include <ATen/ATen.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <utility>
#include <vector>

#include <forkpool/runtime/private/loop_wait.hpp>
#include <forkpool/torch/private/dtypes.hpp>
#include <forkpool/worker/private/task_end.hpp>

namespace forkpool::torch::detail {

bool reuse_caches_on() noexcept {
  static const bool on = [] {
    const char* setting = std::getenv("FORKPOOL_TORCH_CACHES");
    return !setting || std::strcmp(setting, "off") != 0;
  }();
  return on;
}

namespace {

// Whether `impl` has this view already. (Element by element: ArrayRef's == calls memcmp through
// the PLT, about 30 ns of a round trip for a view of a dimension or two.)
bool has_view(const c10::TensorImpl& impl, std::span<const std::int64_t> shape, std::span<const std::int64_t> strides,
              std::int64_t offset) {
  at::IntArrayRef sizes = impl.sizes(), steps = impl.strides();
  if (sizes.size() != shape.size() || impl.storage_offset() != offset) return false;
  for (std::size_t d = 0; d < shape.size(); ++d)
    if (sizes[d] != shape[d] || steps[d] != strides[d]) return false;
  return true;
}

// The parent's next TensorImpl, made while a loop waits for a worker (a loop-wait hook), so that a
// decode takes one ready. A decode's TensorImpl is the caller's, so it cannot be reused as a
// worker's are, and making it (two allocations, the constructor, the view's contiguity worked
// out) was about 200 ns of the parent's part of a round trip (perf). Most results are viewed as
// the one before: the spare is made with the view and dtype of the last tensor made without one,
// and a decode that wants another sets its own. Any thread takes it (an exchange). It has the keys
// of the waiting thread's InferenceMode; a decode in the other mode drops it and makes its own.
class SpareTensorImpl {
 public:
  // (Never destroyed: a loop may wait, and run the hook, until the process ends.)
  static SpareTensorImpl& instance() {
    static SpareTensorImpl* const spare = [] {
      auto* made = new SpareTensorImpl;
      forkpool::detail::at_every_loop_wait(&make_while_waiting);
      return made;
    }();
    return *spare;
  }

  // The spare when it has these keys (a new tensor's, in the caller's InferenceMode), else null.
  c10::intrusive_ptr<c10::TensorImpl> take(c10::DispatchKeySet keys) {
    c10::TensorImpl* made = made_.exchange(nullptr, std::memory_order_acquire);
    if (!made) return {};
    auto impl = c10::intrusive_ptr<c10::TensorImpl>::reclaim(made);
    if (impl->key_set() != keys) return {};
    return impl;
  }

  // The next spare is made viewed so. (Skipped while another thread reads or sets it.)
  void want(std::span<const std::int64_t> shape, std::span<const std::int64_t> strides, std::int64_t offset,
            caffe2::TypeMeta dtype) noexcept {
    if (wanted_lock_.test_and_set(std::memory_order_acquire)) return;
    wanted_.set(shape, strides, offset, dtype);
    wanted_lock_.clear(std::memory_order_release);
  }

 private:
  struct View {
    Dims dims;
    std::int64_t offset = 0;
    caffe2::TypeMeta dtype;
    bool set_yet = false;
    void set(std::span<const std::int64_t> shape, std::span<const std::int64_t> strides, std::int64_t at,
             caffe2::TypeMeta type) noexcept {
      dims.count = shape.size();
      std::copy(shape.begin(), shape.end(), dims.shape_values.begin());
      std::copy(strides.begin(), strides.end(), dims.stride_values.begin());
      offset = at;
      dtype = type;
      set_yet = true;
    }
  };

  // The storage a spare lies over until a decode gives it its own: an empty one.
  static c10::Storage placeholder() {
    static const c10::Storage* const empty = new c10::Storage(c10::make_intrusive<c10::StorageImpl>(
        c10::StorageImpl::use_byte_size_t(), 0, c10::DataPtr(nullptr, c10::Device(c10::kCPU)), nullptr, false));
    return *empty;
  }

  static void make_while_waiting() noexcept {
    SpareTensorImpl& spare = instance();
    if (spare.made_.load(std::memory_order_relaxed)) return;
    if (spare.wanted_lock_.test_and_set(std::memory_order_acquire)) return;
    View view = spare.wanted_;
    spare.wanted_lock_.clear(std::memory_order_release);
    if (!view.set_yet) return;
    try {
      auto impl =
          c10::make_intrusive<c10::TensorImpl>(c10::TensorImpl::VIEW, placeholder(), new_cpu_tensor_keys(), view.dtype);
      impl->set_sizes_and_strides(at::IntArrayRef(view.dims.shape().data(), view.dims.count),
                                  at::IntArrayRef(view.dims.strides().data(), view.dims.count), view.offset);
      c10::TensorImpl* none = nullptr;
      if (spare.made_.compare_exchange_strong(none, impl.get(), std::memory_order_release, std::memory_order_relaxed))
        impl.release();
    } catch (...) {
      // (none made: the next decode makes its own)
    }
  }

  std::atomic<c10::TensorImpl*> made_{nullptr};  // a reference of its own (intrusive_ptr::release)
  std::atomic_flag wanted_lock_;                 // held while wanted_ is read or set; never waited for
  View wanted_;
};

// A pool worker's decoded tensors, reused from task to task. A worker decodes a torch::Tensor for
// each argument and destroys it when the task ends: a TensorImpl and a storage (three allocations)
// made and destroyed on every task were most of what a torch::Tensor round trip cost over a
// forkpool::Tensor one. So a worker keeps the tensors its tasks decoded. When a task ends, each
// that only the worker still holds, as a decode made it, lets go of its block (which goes home
// with the result, as before) and waits without memory for a later decode, which fills it in. A
// decode within the task may reuse one the task let go of already.
// Only a pool worker's serving thread keeps any (in_pool_task): nowhere else has a task's end at
// which to let go.
class KeptTensors {
 public:
  // (Never destroyed: a worker may end with libtorch's own statics gone.)
  static KeptTensors& instance() {
    static auto* kept = new KeptTensors;
    return *kept;
  }

  // A tensor over `storage` (moved into it) from a spare, or nullopt when there is none to reuse
  // (`storage` left as it was).
  std::optional<at::Tensor> reuse(Holder& storage, std::int64_t offset, std::span<const std::int64_t> shape,
                                  std::span<const std::int64_t> strides, at::ScalarType type) {
    std::optional<Kept> spare = take_spare();
    if (!spare) return std::nullopt;
    Kept kept = std::move(*spare);
    c10::TensorImpl& impl = *kept.tensor.unsafeGetTensorImpl();
    held_storage_of(kept.tensor).hold(std::move(storage));
    caffe2::TypeMeta dtype = caffe2::TypeMeta::fromScalarType(type);
    if (impl.dtype() != dtype) impl.set_storage_and_dtype(impl.unsafe_storage(), dtype);
    // (Most tasks take the same view each time: then its contiguity, worked out again, is the same.)
    if (!has_view(impl, shape, strides, offset))
      impl.set_sizes_and_strides(at::IntArrayRef(shape.data(), shape.size()),
                                 at::IntArrayRef(strides.data(), strides.size()), offset);
    // As new: a version counter of its own at 0 (a task that wrote in place moved it).
    if (impl.version_counter().enabled() &&
        (!impl.version_counter().unique() || impl.version_counter().current_version() != 0))
      impl.set_version_counter(c10::VariableVersion(0));
    at::Tensor out = kept.tensor;
    keep(std::move(kept));
    return out;
  }

  // Keeps `made`, a tensor a decode just made, until the task's end.
  void keep_made(const at::Tensor& made) { keep({made, made.key_set(), inference_mode_on()}); }

 private:
  struct Kept {
    at::Tensor tensor;
    c10::DispatchKeySet keys;  // as the decode made it: a bit set since (conj, neg) is not as new
    bool inference;            // made in InferenceMode (no autograd keys, no version counter)
  };
  static constexpr std::size_t kMost = 4;  // kept in use, and spare: a task of many tensors keeps its first

  // A spare made in the InferenceMode that is on now (a new tensor's keys and version counter
  // depend on it): one from an earlier task, else one this task decoded and let go of already (the
  // element before, in a chunk), so a long task holds no more blocks it dropped than this keeps.
  std::optional<Kept> take_spare() {
    bool inference = inference_mode_on();
    auto fits = [&](const Kept& k) { return k.inference == inference; };
    if (auto spare = std::find_if(spares_.begin(), spares_.end(), fits); spare != spares_.end()) {
      Kept kept = std::move(*spare);
      spares_.erase(spare);
      return kept;
    }
    auto dropped =
        std::find_if(in_task_.begin(), in_task_.end(), [&](const Kept& k) { return fits(k) && reusable(k); });
    if (dropped == in_task_.end()) return std::nullopt;
    Kept kept = std::move(*dropped);
    in_task_.erase(dropped);
    return kept;
  }

  // A kept tensor's storage, always one a decode made here (reusable() checks its deleter).
  static HeldStorage& held_storage_of(const at::Tensor& tensor) {
    return static_cast<HeldStorage&>(*tensor.unsafeGetTensorImpl()->unsafe_storage().unsafeGetStorageImpl());
  }

  void keep(Kept kept) {
    if (in_task_.size() < kMost) in_task_.push_back(std::move(kept));
  }

  // Whether only this keeps `kept`, and it is as a decode made it, beyond its view: nobody can
  // see it change.
  static bool reusable(const Kept& kept) {
    const at::Tensor& t = kept.tensor;
    if (t.use_count() != 1 || t.weak_use_count() != 1) return false;
    const c10::TensorImpl& impl = *t.unsafeGetTensorImpl();
    if (impl.key_set() != kept.keys || impl.autograd_meta() != nullptr || impl.has_named_tensor_meta() ||
        impl.is_wrapped_number() || !impl.allow_tensor_metadata_change() || impl.has_symbolic_sizes_strides())
      return false;
    const c10::Storage& storage = impl.unsafe_storage();
    if (storage.use_count() != 1 || storage.resizable() ||
        storage.data_ptr().get_deleter() != &held_by_its_storage_impl)
      return false;
    // (Its weak count read through a handle borrowed and given back: a reference of our own
    // would cost an increment and a decrement at every task's end.)
    auto borrowed = c10::intrusive_ptr<c10::StorageImpl>::reclaim(storage.unsafeGetStorageImpl());
    bool unseen = borrowed.weak_use_count() == 1;
    borrowed.release();
    return unseen;
  }

  static void task_ended() noexcept {
    KeptTensors& kept = instance();
    for (Kept& k : kept.in_task_) {
      if (!reusable(k) || kept.spares_.size() >= kMost) continue;  // (dropped below: the task's)
      held_storage_of(k.tensor).hold(nullptr);
      kept.spares_.push_back(std::move(k));
    }
    kept.in_task_.clear();
  }

  // Made by a worker's first decode within a task (decoded_tensor_over), where the hook can be
  // registered: once for the process.
  KeptTensors() {
    in_task_.reserve(kMost);  // task_ended, noexcept, moves into spares_: never a new allocation
    spares_.reserve(kMost);
    forkpool::detail::at_every_task_end(&task_ended);
  }

  std::vector<Kept> in_task_, spares_;
};

}  // namespace

at::Tensor tensor_over(const Holder& storage, std::int64_t offset, std::span<const std::int64_t> shape,
                       std::span<const std::int64_t> strides, at::ScalarType type, std::size_t extent,
                       Remember remember) {
  std::size_t reach = static_cast<std::size_t>(offset) * c10::elementSize(type) + extent;
  c10::Storage shared = torch_storage_over(storage, reach, remember);
  // Built as at::for_blob builds its tensor, with no dispatched op (at::empty and set_ took about
  // a third of a small tensor's round trip), and with its keys given (see new_cpu_tensor_keys):
  // the spare a loop made while it waited, else a new one.
  c10::DispatchKeySet keys = new_cpu_tensor_keys();
  caffe2::TypeMeta dtype = caffe2::TypeMeta::fromScalarType(type);
  SpareTensorImpl* spare = reuse_caches_on() ? &SpareTensorImpl::instance() : nullptr;
  c10::intrusive_ptr<c10::TensorImpl> impl;
  if (spare) impl = spare->take(keys);
  if (impl && impl->dtype() == dtype && has_view(*impl, shape, strides, offset)) {
    impl->set_storage_keep_dtype(std::move(shared));  // (set_storage_and_dtype copies it once more)
    return at::Tensor(std::move(impl));
  }
  if (impl)
    impl->set_storage_and_dtype(std::move(shared), dtype);
  else
    impl = c10::make_intrusive<c10::TensorImpl>(c10::TensorImpl::VIEW, std::move(shared), keys, dtype);
  // (The offset in the same call: set_storage_offset is a virtual call with its own checks.)
  impl->set_sizes_and_strides(at::IntArrayRef(shape.data(), shape.size()),
                              at::IntArrayRef(strides.data(), strides.size()), offset);
  if (spare) spare->want(shape, strides, offset, dtype);  // the next spare is made as this one
  return at::Tensor(std::move(impl));
}

at::Tensor decoded_tensor_over(Holder storage, std::int64_t offset, std::span<const std::int64_t> shape,
                               std::span<const std::int64_t> strides, at::ScalarType type, std::size_t extent) {
  if (!reuse_caches_on() || !forkpool::detail::in_pool_task() || storage->has_binding())
    return tensor_over(storage, offset, shape, strides, type, extent, Remember::no);
  KeptTensors& kept = KeptTensors::instance();
  if (std::optional<at::Tensor> reused = kept.reuse(storage, offset, shape, strides, type))
    return std::move(*reused);  // (a copy would cost an increment and a decrement)
  at::Tensor made = tensor_over(storage, offset, shape, strides, type, extent, Remember::no);
  kept.keep_made(made);
  return made;
}

}  // namespace forkpool::torch::detail
