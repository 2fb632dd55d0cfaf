#include <forkpool/shm/tensor.hpp>

#include <algorithm>
#include <cstring>
#include <limits>
#include <optional>
#include <span>
#include <vector>

namespace forkpool {

namespace detail {

std::optional<std::size_t> view_extent(std::span<const std::int64_t> shape, std::span<const std::int64_t> strides,
                                       std::size_t element_bytes) {
  if (shape.size() != strides.size()) return std::nullopt;
  std::uint64_t last = 0;  // index of the last element reached
  bool empty = false, overflow = false;
  // Every size is checked, also after a 0 (no negative size anywhere), and a 0 anywhere reaches
  // nothing however large the others are.
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] < 0 || strides[i] < 0) return std::nullopt;
    empty |= shape[i] == 0;
    std::uint64_t step;
    overflow |= __builtin_mul_overflow(static_cast<std::uint64_t>(shape[i] - 1), static_cast<std::uint64_t>(strides[i]),
                                       &step) ||
                __builtin_add_overflow(last, step, &last);
  }
  if (empty) return 0;
  if (overflow) return std::nullopt;
  std::uint64_t bytes;
  if (__builtin_add_overflow(last, 1, &bytes) || __builtin_mul_overflow(bytes, element_bytes, &bytes) ||
      bytes > (std::uint64_t{1} << 62))
    return std::nullopt;
  return static_cast<std::size_t>(bytes);
}

namespace {
// Calls visit(dim, stride) with each dim's row-major stride, last dim first, while it returns true;
// true if it always did. A stride past int64 is held at its largest value: a shape that large is
// refused by view_extent (unless a zero in it leaves no element to reach).
template <class Visit>
bool for_each_row_major_stride(std::span<const std::int64_t> shape, Visit visit) {
  std::int64_t step = 1;
  for (std::size_t i = shape.size(); i-- > 0;) {
    if (!visit(i, step)) return false;
    if (__builtin_mul_overflow(step, std::max<std::int64_t>(shape[i], 1), &step))
      step = std::numeric_limits<std::int64_t>::max();
  }
  return true;
}

// Row-major strides of `shape` into `strides`, one per dimension.
void write_contiguous_strides(std::span<const std::int64_t> shape, std::span<std::int64_t> strides) {
  for_each_row_major_stride(shape, [&](std::size_t dim, std::int64_t stride) {
    strides[dim] = stride;
    return true;
  });
}
}  // namespace

std::vector<std::int64_t> contiguous_strides(std::span<const std::int64_t> shape) {
  std::vector<std::int64_t> strides(shape.size());
  write_contiguous_strides(shape, strides);
  return strides;
}

}  // namespace detail

Tensor Tensor::empty(std::vector<std::int64_t> shape, DType dtype) {
  detail::TensorDims dims = detail::TensorDims::contiguous(shape);
  auto extent = detail::view_extent(dims.shape(), dims.strides(), element_size(dtype));
  if (!extent) throw std::invalid_argument("forkpool: Tensor shape has a negative or too large size");
  // Made here, not by tensor_from_storage: the view fits the storage made for it, so there is
  // nothing to check twice.
  Tensor t;
  t.storage_ = detail::Storage::allocate(*extent);
  t.dims_ = std::move(dims);
  t.dtype_ = dtype;
  return t;
}

Tensor Tensor::zeros(std::vector<std::int64_t> shape, DType dtype) {
  Tensor t = empty(std::move(shape), dtype);
  if (t.storage_) std::memset(t.raw_data(), 0, t.nbytes());
  return t;
}

Tensor Tensor::from_storage(std::shared_ptr<detail::Storage> storage, std::int64_t byte_offset,
                            std::vector<std::int64_t> shape, std::vector<std::int64_t> strides, DType dtype) {
  return detail::tensor_from_storage(std::move(storage), byte_offset, shape, strides, dtype);
}

detail::TensorDims::TensorDims(std::span<const std::int64_t> shape, std::span<const std::int64_t> strides)
    : dims_(shape.size()) {
  std::int64_t* out = in_place_.data();
  if (dims_ > kInPlace) {
    on_heap_.resize(2 * dims_);
    out = on_heap_.data();
  }
  std::copy(shape.begin(), shape.end(), out);
  std::copy(strides.begin(), strides.end(), out + dims_);
}

detail::TensorDims detail::TensorDims::contiguous(std::span<const std::int64_t> shape) {
  TensorDims dims(shape, shape);
  write_contiguous_strides(shape, {dims.data() + dims.dims_, dims.dims_});
  return dims;
}

Tensor detail::tensor_from_storage(std::shared_ptr<Storage> storage, std::int64_t byte_offset,
                                   std::span<const std::int64_t> shape, std::span<const std::int64_t> strides,
                                   DType dtype) {
  auto extent = view_extent(shape, strides, element_size(dtype));
  if (!extent || byte_offset < 0 || !storage || static_cast<std::uint64_t>(byte_offset) + *extent > storage->size())
    throw std::invalid_argument("forkpool: the tensor's view does not fit in its storage");
  Tensor t;
  t.storage_ = std::move(storage);
  t.offset_ = byte_offset;
  t.dims_ = TensorDims(shape, strides);
  t.dtype_ = dtype;
  return t;
}

bool Tensor::is_contiguous() const noexcept {
  // As strides() == contiguous_strides(shape()), without making the vector (a collate asks it of
  // every sample).
  std::span<const std::int64_t> strides = dims_.strides();
  return detail::for_each_row_major_stride(
      dims_.shape(), [&](std::size_t dim, std::int64_t stride) { return strides[dim] == stride; });
}

Tensor& Tensor::share_memory_() {
  if (is_shared()) return *this;
  std::span<const std::int64_t> shape = dims_.shape(), strides = dims_.strides();
  Tensor copy = empty({shape.begin(), shape.end()}, dtype_);
  // Copy element by element in index order (the source may be strided).
  std::size_t element = element_size(dtype_);
  std::vector<std::int64_t> index(shape.size(), 0);
  auto* out = static_cast<std::byte*>(copy.raw_data());
  const auto* in = static_cast<const std::byte*>(raw_data());
  for (std::int64_t n = 0; n < numel(); ++n) {
    std::int64_t source = 0;
    for (std::size_t d = 0; d < shape.size(); ++d) source += index[d] * strides[d];
    std::memcpy(out + n * element, in + source * element, element);
    for (std::size_t d = shape.size(); d-- > 0;) {
      if (++index[d] < shape[d]) break;
      index[d] = 0;
    }
  }
  *this = std::move(copy);
  return *this;
}

namespace {

// The strides that view `shape`'s elements over a tensor of `old_shape` and `old_strides`, in the
// same row-major order, or nullopt where a new dimension would span two of the tensor's separate
// runs of elements. torch's computeStride: each run of old dimensions laid out contiguously with
// each other (a "chunk") must be cut into whole new dimensions.
std::optional<std::vector<std::int64_t>> view_strides(std::span<const std::int64_t> old_shape,
                                                      std::span<const std::int64_t> old_strides,
                                                      std::span<const std::int64_t> shape, std::int64_t numel) {
  if (numel == 0 || old_shape.empty()) {
    // No element to place (torch keeps the strides where the shape is the same), or one.
    if (numel == 0 && std::ranges::equal(old_shape, shape))
      return std::vector<std::int64_t>(old_strides.begin(), old_strides.end());
    return detail::contiguous_strides(shape);
  }
  std::vector<std::int64_t> strides(shape.size());
  auto view_d = static_cast<std::ptrdiff_t>(shape.size()) - 1;
  std::int64_t chunk_stride = old_strides.back(), chunk_numel = 1, view_numel = 1;
  for (auto d = static_cast<std::ptrdiff_t>(old_shape.size()) - 1; d >= 0; --d) {
    chunk_numel *= old_shape[d];
    bool chunk_ends = d == 0 || (old_shape[d - 1] != 1 && old_strides[d - 1] != chunk_numel * chunk_stride);
    if (!chunk_ends) continue;
    while (view_d >= 0 && (view_numel < chunk_numel || shape[view_d] == 1)) {
      strides[view_d] = view_numel * chunk_stride;
      view_numel *= shape[view_d];
      --view_d;
    }
    if (view_numel != chunk_numel) return std::nullopt;
    if (d > 0) {
      chunk_stride = old_strides[d - 1];
      chunk_numel = view_numel = 1;
    }
  }
  if (view_d != -1) return std::nullopt;
  return strides;
}

}  // namespace

Tensor Tensor::view(std::vector<std::int64_t> shape) const {
  std::int64_t known = 1;  // the product of the sizes given
  int inferred = -1;
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] == -1 && inferred < 0) {
      inferred = static_cast<int>(i);
    } else if (shape[i] < 0) {
      throw std::invalid_argument("forkpool: Tensor::view: invalid size");
    } else if (__builtin_mul_overflow(known, shape[i], &known)) {
      throw std::invalid_argument("forkpool: Tensor::view: a shape of more elements than an int64 counts");
    }
  }
  if (inferred >= 0) {
    // As torch: with no element to divide, the -1 could be any size.
    if (known == 0)
      throw std::invalid_argument("forkpool: Tensor::view: the size -1 could be anything beside a 0 size");
    shape[inferred] = numel() / known;
  }
  std::int64_t total = inferred >= 0 ? known * shape[inferred] : known;
  if (total != numel())
    throw std::invalid_argument("forkpool: Tensor::view: " + std::to_string(total) + " elements for a tensor of " +
                                std::to_string(numel()));
  std::optional<std::vector<std::int64_t>> strides = view_strides(dims_.shape(), dims_.strides(), shape, total);
  if (!strides)
    throw std::invalid_argument(
        "forkpool: Tensor::view: the shape does not fit the tensor's strides (a dimension would span two of its "
        "separate runs of elements, as torch says); view a contiguous copy");
  return from_storage(storage_, offset_, std::move(shape), std::move(*strides), dtype_);
}

Tensor Tensor::slice(int dim, std::int64_t begin, std::int64_t end, std::int64_t step) const {
  if (step < 1) throw std::invalid_argument("forkpool: Tensor::slice: the step must be at least 1");
  int ndim = static_cast<int>(dims_.size());
  if (dim < 0) dim += ndim;
  if (dim < 0 || dim >= ndim) throw std::out_of_range("forkpool: Tensor::slice: dimension out of range");
  std::int64_t size = dims_.shape()[dim];
  begin = std::clamp<std::int64_t>(begin < 0 ? begin + size : begin, 0, size);
  end = std::clamp<std::int64_t>(end < 0 ? end + size : end, begin, size);
  std::vector<std::int64_t> shape(dims_.shape().begin(), dims_.shape().end());
  std::vector<std::int64_t> strides(dims_.strides().begin(), dims_.strides().end());
  auto offset = offset_ + begin * strides[dim] * static_cast<std::int64_t>(element_size(dtype_));
  shape[dim] = (end - begin) / step + ((end - begin) % step != 0 ? 1 : 0);
  if (shape[dim] > 1) strides[dim] *= step;  // (then step < size: it cannot overflow; one element needs no step)
  return detail::tensor_from_storage(storage_, offset, shape, strides, dtype_);
}

}  // namespace forkpool
