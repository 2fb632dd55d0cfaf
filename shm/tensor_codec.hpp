#pragma once
// codec<Tensor>: a tensor crosses as its storage and its view (offset, shape, strides, dtype);
// its bytes are never serialized. The storage is a block of a slab named in the message's table
// of blocks (lent, and coming home when let go), a whole memfd attached as a descriptor, or a
// /dev/shm name (file_system sharing). The receiver
// validates everything before it maps: a lying peer can never cause SIGBUS.

#include <array>
#include <cstdint>
#include <memory>
#include <span>

#include <forkpool/ipc/codec.hpp>
#include <forkpool/shm/tensor.hpp>

namespace forkpool {

namespace detail {
// What codec<Tensor>::encode writes, from the parts of a view, so that another tensor type over
// forkpool memory (forkpool-torch's) crosses as a Tensor without building one. Throws
// std::invalid_argument for a storage that is not shared.
void encode_tensor_view(Writer& w, const std::shared_ptr<Storage>& storage, std::int64_t byte_offset,
                        std::span<const std::int64_t> shape, std::span<const std::int64_t> strides, DType dtype);

// What codec<Tensor>::decode reads, validated (the view fits in its storage), without a Tensor
// in between: the other half of encode_tensor_view. Shape and strides sit in place (a tensor's
// dimensions are bounded), so decoding allocates nothing of its own.
struct TensorView {
  static constexpr std::size_t kMaxDims = 64;
  std::shared_ptr<Storage> storage;  // null: a Tensor() crossed
  std::int64_t byte_offset = 0;
  DType dtype = DType::u8;
  std::size_t dims = 0;
  std::size_t extent = 0;                           // the bytes the view reaches from its offset
  std::array<std::int64_t, kMaxDims> shape_values;  // the first `dims` are set
  std::array<std::int64_t, kMaxDims> stride_values;
  std::span<const std::int64_t> shape() const noexcept { return {shape_values.data(), dims}; }
  std::span<const std::int64_t> strides() const noexcept { return {stride_values.data(), dims}; }
};
// Throws ProtocolError (through the reader) for a malformed or lying view.
void decode_tensor_view(Reader& r, TensorView& view);
}  // namespace detail

template <>
struct codec<Tensor> {
  static constexpr std::size_t min_size = 1;
  static void encode(Writer& w, const Tensor& tensor);
  static Tensor decode(Reader& r);
};

}  // namespace forkpool
