#pragma once
// codec<Tensor>: a tensor crosses as its storage (a memfd descriptor, or a /dev/shm name) and
// its view (offset, shape, strides, dtype); its bytes are never serialized. The receiver
// validates everything before it maps: a lying peer can never cause SIGBUS.

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
}  // namespace detail

template <>
struct codec<Tensor> {
  static constexpr std::size_t min_size = 1;
  static void encode(Writer& w, const Tensor& tensor);
  static Tensor decode(Reader& r);
};

}  // namespace forkpool
