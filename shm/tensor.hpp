#pragma once
// Tensor: an n-dimensional view (shape, strides, dtype, byte offset) of a Storage. Copies are
// cheap and share the storage, as do views and slices. Tensors made here live in shared memory
// from birth: sent to a worker or returned from one, they are the same memory on both sides.
// Tensors may be copied and dropped on any thread (a Tensor object itself is not synchronized:
// like std::shared_ptr, one object is not written on two threads at once).

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include <forkpool/shm/dtype.hpp>
#include <forkpool/shm/internal/storage.hpp>

namespace forkpool {

class Tensor;

namespace detail {
// A tensor's shape and strides, side by side. Up to four dimensions are held in place: a tensor
// of the usual few dimensions is made, copied and decoded without an allocation.
class TensorDims {
 public:
  TensorDims() = default;
  TensorDims(std::span<const std::int64_t> shape, std::span<const std::int64_t> strides);  // of one length
  static TensorDims contiguous(std::span<const std::int64_t> shape);                       // row-major strides
  std::span<const std::int64_t> shape() const noexcept { return {data(), dims_}; }
  std::span<const std::int64_t> strides() const noexcept { return {data() + dims_, dims_}; }
  std::size_t size() const noexcept { return dims_; }

 private:
  static constexpr std::size_t kInPlace = 4;
  const std::int64_t* data() const noexcept { return dims_ <= kInPlace ? in_place_.data() : on_heap_.data(); }
  std::int64_t* data() noexcept { return dims_ <= kInPlace ? in_place_.data() : on_heap_.data(); }
  std::size_t dims_ = 0;
  std::array<std::int64_t, 2 * kInPlace> in_place_{};
  std::vector<std::int64_t> on_heap_;  // more than kInPlace dimensions
};

// As Tensor::from_storage, with the view given as spans (a decoded tensor makes no vectors).
Tensor tensor_from_storage(std::shared_ptr<Storage> storage, std::int64_t byte_offset,
                           std::span<const std::int64_t> shape, std::span<const std::int64_t> strides, DType dtype);
}  // namespace detail

class Tensor {
 public:
  // No storage; numel() == 0.
  Tensor() = default;

  // Shared from birth (the kind of storage follows get_sharing_strategy()). empty() leaves the
  // bytes as they are, as torch.empty does: recycled memory holds what the last tensor left in
  // it. zeros() clears them.
  static Tensor empty(std::vector<std::int64_t> shape, DType dtype);
  static Tensor zeros(std::vector<std::int64_t> shape, DType dtype);
  // Copies `values` once into new shared storage; numel of `shape` must equal values.size().
  template <class T>
  static Tensor from(std::span<const T> values, std::vector<std::int64_t> shape) {
    DType dtype = dtype_of<T>();
    Tensor t = empty(std::move(shape), dtype);
    if (static_cast<std::size_t>(t.numel()) != values.size())
      throw std::invalid_argument("forkpool: Tensor::from: " + std::to_string(values.size()) +
                                  " values for a shape of " + std::to_string(t.numel()) + " elements");
    if (!values.empty()) std::memcpy(t.raw_data(), values.data(), values.size_bytes());
    return t;
  }
  // A tensor over existing storage. Throws std::invalid_argument when the view does not fit in it.
  static Tensor from_storage(std::shared_ptr<detail::Storage> storage, std::int64_t byte_offset,
                             std::vector<std::int64_t> shape, std::vector<std::int64_t> strides, DType dtype);

  std::span<const std::int64_t> shape() const noexcept { return dims_.shape(); }
  std::span<const std::int64_t> strides() const noexcept { return dims_.strides(); }  // in elements
  DType dtype() const noexcept { return dtype_; }
  // Inline: a loop `for (i = 0; i < t.numel(); ++i)` hoists it instead of calling into the
  // library once per element.
  std::int64_t numel() const noexcept {
    if (!storage_) return 0;
    // Unsigned: a shape with a 0 in it may have sizes whose product overflows; modulo 2^64 it is
    // still 0. Any other shape was checked to fit in memory.
    std::uint64_t count = 1;
    for (std::int64_t extent : dims_.shape()) count *= static_cast<std::uint64_t>(extent);
    return static_cast<std::int64_t>(count);
  }
  std::size_t nbytes() const noexcept { return static_cast<std::size_t>(numel()) * element_size(dtype_); }
  std::int64_t dim() const noexcept { return static_cast<std::int64_t>(dims_.size()); }
  bool is_contiguous() const noexcept;

  // The first element. Throws std::invalid_argument if T does not match dtype().
  template <class T>
  T* data() const {
    if (dtype_of<T>() != dtype_)
      throw std::invalid_argument(std::string("forkpool: Tensor::data<") + dtype_name(dtype_of<T>()) +
                                  ">() on a tensor of dtype " + dtype_name(dtype_));
    return static_cast<T*>(raw_data());
  }
  void* raw_data() const noexcept { return storage_ ? storage_->data() + offset_ : nullptr; }

  bool is_shared() const noexcept { return !storage_ || storage_->is_shared(); }
  // Moves the data into shared memory (one copy) if it is not there yet.
  Tensor& share_memory_();

  // The same elements in another shape, over the same memory; one dimension may be -1. As torch's
  // view: a non-contiguous tensor too, where each new dimension lies within one of its runs of
  // contiguous elements (std::invalid_argument otherwise).
  Tensor view(std::vector<std::int64_t> shape) const;
  // Elements [begin, end) along `dim`, every `step`-th from begin, as torch's slice: a negative dim,
  // begin or end counts from the end, and begin and end are clamped to the dimension. Shares the
  // storage. A step below 1 is std::invalid_argument.
  Tensor slice(int dim, std::int64_t begin, std::int64_t end, std::int64_t step = 1) const;

  const std::shared_ptr<detail::Storage>& storage() const noexcept { return storage_; }
  std::int64_t storage_offset() const noexcept { return offset_; }  // in bytes

 private:
  friend Tensor detail::tensor_from_storage(std::shared_ptr<detail::Storage>, std::int64_t,
                                            std::span<const std::int64_t>, std::span<const std::int64_t>, DType);
  std::shared_ptr<detail::Storage> storage_;
  std::int64_t offset_ = 0;
  detail::TensorDims dims_;
  DType dtype_ = DType::f32;
};

namespace detail {
// Bytes a view reaches from its offset (0 for no elements); nullopt on overflow or a negative
// size or stride.
std::optional<std::size_t> view_extent(std::span<const std::int64_t> shape, std::span<const std::int64_t> strides,
                                       std::size_t element_bytes);
std::vector<std::int64_t> contiguous_strides(std::span<const std::int64_t> shape);
}  // namespace detail

}  // namespace forkpool
