#include <forkpool/shm/dlpack.hpp>

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace forkpool {
namespace {

// DLPack 0.8's kDLBool; dlpack.h 0.6 lacks it.
constexpr std::uint8_t kBoolCode = 6;

struct Context {
  Tensor tensor;
  std::vector<std::int64_t> shape;
  std::vector<std::int64_t> strides;
  DLManagedTensor managed{};
};

void delete_context(DLManagedTensor* managed) { delete static_cast<Context*>(managed->manager_ctx); }

// One table serves both directions.
struct DTypeCode {
  DType dtype;
  std::uint8_t code;
  std::uint8_t bits;
};
constexpr DTypeCode kDTypeCodes[] = {
    {DType::u8, kDLUInt, 8},        {DType::i8, kDLInt, 8},     {DType::i16, kDLInt, 16},
    {DType::i32, kDLInt, 32},       {DType::i64, kDLInt, 64},   {DType::f16, kDLFloat, 16},
    {DType::bf16, kDLBfloat, 16},   {DType::f32, kDLFloat, 32}, {DType::f64, kDLFloat, 64},
    {DType::boolean, kBoolCode, 8},
};

DLDataType to_dl(DType dtype) {
  for (const DTypeCode& entry : kDTypeCodes)
    if (entry.dtype == dtype) return {entry.code, entry.bits, 1};
  throw std::logic_error("forkpool: to_dlpack: a DType without a DLPack code");
}

DType from_dl(DLDataType t) {
  if (t.lanes != 1) throw std::invalid_argument("forkpool: from_dlpack: vector dtypes (lanes > 1) are not supported");
  for (const DTypeCode& entry : kDTypeCodes)
    if (entry.code == t.code && entry.bits == t.bits) return entry.dtype;
  throw std::invalid_argument("forkpool: from_dlpack: unsupported dtype (code " + std::to_string(t.code) + ", " +
                              std::to_string(t.bits) + " bits)");
}

}  // namespace

DLManagedTensor* to_dlpack(const Tensor& tensor) {
  auto context = std::make_unique<Context>();
  context->tensor = tensor;
  context->shape.assign(tensor.shape().begin(), tensor.shape().end());
  context->strides.assign(tensor.strides().begin(), tensor.strides().end());
  DLTensor& dl = context->managed.dl_tensor;
  dl.data = tensor.storage() ? tensor.storage()->data() : nullptr;
  dl.device = {kDLCPU, 0};
  dl.ndim = static_cast<std::int32_t>(context->shape.size());
  dl.dtype = to_dl(tensor.dtype());
  dl.shape = context->shape.data();
  dl.strides = context->strides.data();
  dl.byte_offset = static_cast<std::uint64_t>(tensor.storage_offset());
  context->managed.manager_ctx = context.get();
  context->managed.deleter = &delete_context;
  return &context.release()->managed;
}

Tensor from_dlpack(DLManagedTensor* managed) {
  if (!managed) throw std::invalid_argument("forkpool: from_dlpack: null tensor");
  if (managed->deleter == &delete_context) {
    Tensor tensor = static_cast<Context*>(managed->manager_ctx)->tensor;  // ours: the same shared storage
    managed->deleter(managed);
    return tensor;
  }
  // Whatever happens below, the producer's memory is released exactly once.
  std::shared_ptr<DLManagedTensor> owner(managed, [](DLManagedTensor* m) {
    if (m->deleter) m->deleter(m);
  });
  const DLTensor& dl = managed->dl_tensor;
  if (dl.device.device_type != kDLCPU)
    throw std::invalid_argument("forkpool: from_dlpack: only CPU memory can be shared");
  if (dl.ndim < 0) throw std::invalid_argument("forkpool: from_dlpack: negative ndim");
  if (dl.ndim > 0 && !dl.shape)
    throw std::invalid_argument("forkpool: from_dlpack: no shape for " + std::to_string(dl.ndim) + " dimensions");
  DType dtype = from_dl(dl.dtype);
  std::vector<std::int64_t> shape(dl.shape, dl.shape + dl.ndim);
  std::vector<std::int64_t> strides =
      dl.strides ? std::vector<std::int64_t>(dl.strides, dl.strides + dl.ndim) : detail::contiguous_strides(shape);
  auto extent = detail::view_extent(shape, strides, element_size(dtype));
  if (!extent) throw std::invalid_argument("forkpool: from_dlpack: negative or overflowing shape or strides");
  // What reading it would make undefined: no memory under elements, or elements out of line.
  if (*extent > 0 && !dl.data)
    throw std::invalid_argument("forkpool: from_dlpack: null data for " + std::to_string(*extent) +
                                " bytes of elements");
  std::byte* base = dl.data ? static_cast<std::byte*>(dl.data) + dl.byte_offset : nullptr;
  if (reinterpret_cast<std::uintptr_t>(base) % element_size(dtype) != 0)
    throw std::invalid_argument("forkpool: from_dlpack: data + byte_offset is not aligned to its " +
                                std::to_string(element_size(dtype)) + "-byte elements");
  auto storage = detail::Storage::external(base, *extent, [owner] {});
  return Tensor::from_storage(std::move(storage), 0, std::move(shape), std::move(strides), dtype);
}

}  // namespace forkpool
