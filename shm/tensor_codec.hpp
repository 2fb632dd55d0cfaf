#pragma once
// codec<Tensor>: a tensor crosses as its storage (a memfd descriptor, or a /dev/shm name) and
// its view (offset, shape, strides, dtype); its bytes are never serialized. The receiver
// validates everything before it maps: a lying peer can never cause SIGBUS.

#include <forkpool/ipc/codec.hpp>
#include <forkpool/shm/tensor.hpp>

namespace forkpool {

template <>
struct codec<Tensor> {
  static constexpr std::size_t min_size = 1;
  static void encode(Writer& w, const Tensor& tensor);
  static Tensor decode(Reader& r);
};

}  // namespace forkpool
