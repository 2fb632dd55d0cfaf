#include <forkpool/shm/dtype.hpp>

namespace forkpool {

std::size_t element_size(DType dtype) noexcept {
  switch (dtype) {
    case DType::u8:
    case DType::i8:
    case DType::boolean: return 1;
    case DType::i16:
    case DType::f16:
    case DType::bf16: return 2;
    case DType::i32:
    case DType::f32: return 4;
    case DType::i64:
    case DType::f64: return 8;
  }
  return 1;
}

const char* dtype_name(DType dtype) noexcept {
  static constexpr const char* names[] = {"u8", "i8", "i16", "i32", "i64", "f16", "bf16", "f32", "f64", "boolean"};
  return names[static_cast<int>(dtype)];
}

}  // namespace forkpool
