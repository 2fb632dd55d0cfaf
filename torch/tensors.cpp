#include <forkpool/torch/tensors.hpp>

#include <ATen/ATen.h>
#include <c10/core/AutogradState.h>
#include <c10/core/InferenceMode.h>
#include <c10/core/Storage.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include <forkpool/worker/private/task_end.hpp>
#include <forkpool/runtime/error.hpp>
#include <forkpool/runtime/private/loop_wait.hpp>
#include <forkpool/shm/internal/storage.hpp>
#include <forkpool/shm/tensor_codec.hpp>

namespace forkpool::torch {
namespace {

// A torch storage over forkpool memory holds its forkpool storage: the block goes back when the
// last torch tensor on it goes. Its DataPtr's context is always a `const Holder*`, and its
// deleter says which of two kinds holds it:
// - a HeldStorage, the torch storages made here, which is the holder: one allocation;
// - a Holder of its own (let_go deletes it), for a storage share_memory moved in place.
using Holder = std::shared_ptr<forkpool::detail::Storage>;
void let_go(void* holder) { delete static_cast<Holder*>(holder); }
void held_by_its_storage_impl(void*) {}  // HeldStorage lets go of it

bool holds_forkpool_memory(const c10::DataPtr& data) {
  return data.get_deleter() == &held_by_its_storage_impl || data.get_deleter() == &let_go;
}
const Holder& holder_of(const c10::DataPtr& data) { return *static_cast<const Holder*>(data.get_context()); }

struct HeldStorage final : c10::StorageImpl {
  explicit HeldStorage(Holder storage)
      : c10::StorageImpl(use_byte_size_t(), storage->size(),
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

// What a tensor's elements are made of in forkpool's terms. forkpool has no complex DType: a
// complex element is two of its parts' DType, its real and imaginary parts, laid out as
// at::view_as_real lays them out (one more dimension, of 2 with stride 1).
struct Element {
  DType dtype;
  bool complex = false;
};

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

// A DataPtr for share_memory's move in place (a torch storage not made here).
c10::DataPtr data_ptr_over(Holder storage) {
  std::byte* data = storage->data();
  return c10::DataPtr(data, new Holder(std::move(storage)), &let_go, c10::Device(c10::kCPU));
}

std::vector<std::int64_t> vector_of(at::IntArrayRef values) { return {values.begin(), values.end()}; }
std::span<const std::int64_t> span_of(at::IntArrayRef values) { return {values.data(), values.size()}; }

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

// A view's shape and strides, built here (a complex view's, or its parts').
struct Dims {
  std::array<std::int64_t, forkpool::detail::TensorView::kMaxDims> shape_values, stride_values;
  std::size_t count = 0;
  std::span<const std::int64_t> shape() const noexcept { return {shape_values.data(), count}; }
  std::span<const std::int64_t> strides() const noexcept { return {stride_values.data(), count}; }
};

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

// A forkpool storage keeps a weak handle to the torch storage over it (Storage::with_binding):
// weak, since the torch storage holds the forkpool one.
void drop_weak_handle(void* impl) noexcept {
  c10::raw::weak_intrusive_ptr::decref(static_cast<c10::StorageImpl*>(impl));
}

// Under the storage's lock: `over_it` becomes the torch storage it names.
void remember_torch_storage(forkpool::detail::Storage::Binding& binding, c10::StorageImpl* over_it) {
  c10::raw::weak_intrusive_ptr::incref(over_it);
  if (binding.release) binding.release(binding.object);  // a weak handle holds no forkpool storage
  binding = {over_it, &drop_weak_handle};
}

// Whether `impl` still lies over `storage` (nobody gave it other memory since) and reaches its
// first `bytes` (share_memory's torch storage may be shorter than the block it moved into).
bool lies_over(const c10::StorageImpl& impl, const Holder& storage, std::size_t bytes) {
  const c10::DataPtr& data = impl.data_ptr();
  return holds_forkpool_memory(data) && holder_of(data) == storage && impl.nbytes() >= bytes;
}

// Whether a new torch storage is named in its forkpool storage for the next tensor over it.
// Tensors made here (from_forkpool, empty, zeros, share_memory) are: a block that comes back to
// this process while one of them lives arrives on its storage. Tensors decoded from a message
// are not: a worker's argument storage is gone after its task, and the naming would cost every
// round trip more than it saves.
enum class Remember { yes, no };

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

// A torch::Tensor over `storage`, viewed as given (its offset in elements), which reaches `extent`
// bytes from its offset (a view checked already: a decoded one, or a forkpool::Tensor's).
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
  SpareTensorImpl& spare = SpareTensorImpl::instance();
  c10::intrusive_ptr<c10::TensorImpl> impl = spare.take(keys);
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
  spare.want(shape, strides, offset, dtype);  // the next spare is made as this one
  return at::Tensor(std::move(impl));
}

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

// A decode's tensor: a pool worker's spare filled in when it has one (and the block has no torch
// storage named), else a new one, kept for reuse after the task when in a pool worker.
at::Tensor decoded_tensor_over(Holder storage, std::int64_t offset, std::span<const std::int64_t> shape,
                               std::span<const std::int64_t> strides, at::ScalarType type, std::size_t extent) {
  if (!forkpool::detail::in_pool_task() || storage->has_binding())
    return tensor_over(storage, offset, shape, strides, type, extent, Remember::no);
  KeptTensors& kept = KeptTensors::instance();
  if (std::optional<at::Tensor> reused = kept.reuse(storage, offset, shape, strides, type))
    return std::move(*reused);  // (a copy would cost an increment and a decrement)
  at::Tensor made = tensor_over(storage, offset, shape, strides, type, extent, Remember::no);
  kept.keep_made(made);
  return made;
}

}  // namespace

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

namespace forkpool {
namespace {

// After the view, a byte of flags: what a torch::Tensor is beyond a forkpool view.
enum TensorFlags : std::uint8_t {
  kRequiresGrad = 1,
  kComplex = 2,  // the view is of its elements' parts (torch::parts_of)
};

// `shape` and `strides` count elements of `element`: a complex view is written as its parts'.
void encode_view(Writer& w, const torch::Holder& storage, std::int64_t byte_offset, at::IntArrayRef shape,
                 at::IntArrayRef strides, torch::Element element) {
  if (!element.complex) {
    detail::encode_tensor_view(w, storage, byte_offset, torch::span_of(shape), torch::span_of(strides), element.dtype);
    return;
  }
  torch::Dims parts = torch::parts_of(torch::span_of(shape), torch::span_of(strides));
  detail::encode_tensor_view(w, storage, byte_offset, parts.shape(), parts.strides(), element.dtype);
}

}  // namespace

void codec<at::Tensor>::encode(Writer& w, const at::Tensor& tensor) {
  torch::Element element = torch::check_shareable(tensor);
  bool requires_grad = tensor.requires_grad();
  if (requires_grad && !tensor.is_leaf())
    throw Error(
        "forkpool-torch: a non-leaf tensor that requires grad cannot cross (autograd state does not): detach() it");
  if (const torch::Holder* storage = torch::shared_storage_of(tensor)) {
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
  at::ScalarType type = torch::scalar_type_of(view.dtype);
  std::span<const std::int64_t> shape = view.shape(), strides = view.strides();
  torch::Dims complex;  // (its arrays left unset: a decode's hot path)
  if (flags & kComplex) {
    std::optional<at::ScalarType> complex_type = torch::complex_of(view.dtype);
    if (!complex_type || !torch::complex_view_of(shape, strides, complex))
      r.fail(
          "a complex torch::Tensor arrived whose parts are not two of a floating dtype in a last dimension of "
          "stride 1, as at::view_as_real lays them out");
    type = *complex_type;
    shape = complex.shape();
    strides = complex.strides();
  }
  std::optional<std::int64_t> offset = torch::element_offset(view.byte_offset, c10::elementSize(type));
  if (!offset)
    r.fail("a torch::Tensor arrived that " + torch::misplaced_view(view.byte_offset, c10::elementSize(type)));
  at::Tensor out = torch::decoded_tensor_over(std::move(view.storage), *offset, shape, strides, type, view.extent);
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
