#pragma once
// Element types of tensors.

#include <cstddef>
#include <cstdint>
#include <string>

#include <forkpool/ipc/codec.hpp>

namespace forkpool {

enum class DType : std::uint8_t { u8, i8, i16, i32, i64, f16, bf16, f32, f64, boolean };

template <>
struct enum_bounds<DType> {
  static constexpr DType min = DType::u8;
  static constexpr DType max = DType::boolean;
};

// 16-bit floats have no C++ type here: their bits, for data<T>().
struct float16 {
  std::uint16_t bits;
};
struct bfloat16 {
  std::uint16_t bits;
};

std::size_t element_size(DType dtype) noexcept;
const char* dtype_name(DType dtype) noexcept;

// The DType of C++ type T (a compile error for types no DType stands for).
template <class T>
constexpr DType dtype_of() {
  using U = std::remove_cv_t<T>;
  if constexpr (std::is_same_v<U, std::uint8_t>)
    return DType::u8;
  else if constexpr (std::is_same_v<U, std::int8_t>)
    return DType::i8;
  else if constexpr (std::is_same_v<U, std::int16_t>)
    return DType::i16;
  else if constexpr (std::is_same_v<U, std::int32_t>)
    return DType::i32;
  else if constexpr (std::is_same_v<U, std::int64_t>)
    return DType::i64;
  else if constexpr (std::is_same_v<U, float16>)
    return DType::f16;
  else if constexpr (std::is_same_v<U, bfloat16>)
    return DType::bf16;
  else if constexpr (std::is_same_v<U, float>)
    return DType::f32;
  else if constexpr (std::is_same_v<U, double>)
    return DType::f64;
  else if constexpr (std::is_same_v<U, bool>)
    return DType::boolean;
  else
    static_assert(sizeof(U) == 0, "forkpool: no DType for this element type");
}

}  // namespace forkpool
