#pragma once
// Value<T> and Array<T>: plain values in shared memory, each with its own Lock, as
// multiprocessing's Value and Array. Handles: copies, and copies passed to other processes (as
// arguments of start_process, spawn and pool tasks), see the same memory. Any thread.
//
//   forkpool::Value<long> counter(0);
//   // in any process:
//   { std::lock_guard held(counter.get_lock()); counter.store(counter.load() + 1); }
//
// load() and store() take the lock for one access (as Python's .value does); a read-modify-write
// holds get_lock() around both (the lock is recursive, so load and store inside it are fine).
// T is trivially copyable and holds no pointer (an address means nothing in another process).

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include <forkpool/ipc/codec.hpp>
#include <forkpool/runtime/internal/shared_handle.hpp>
#include <forkpool/sync/sync.hpp>

namespace forkpool {

namespace detail {

template <class T>
inline constexpr bool is_shareable_value_v =
    std::is_trivially_copyable_v<T> && !std::is_pointer_v<T> && !std::is_member_pointer_v<T>;

// `size` bytes of zeroed shared memory (a sealed memfd) and an RLock, what Value and Array are.
class SharedBytes {
 public:
  explicit SharedBytes(std::size_t size);  // Throws std::system_error.
  ~SharedBytes();
  std::byte* data() const noexcept;
  std::size_t size() const noexcept;
  RLock& lock() noexcept { return lock_; }
  void encode(Writer& w, const std::shared_ptr<const SharedBytes>& self) const;
  // Throws ProtocolError when the descriptor is not a sealed memfd of `size` bytes.
  static std::shared_ptr<SharedBytes> decode(Reader& r, std::size_t element_size);

 private:
  struct Memory;
  SharedBytes(std::unique_ptr<Memory> memory, RLock lock);
  std::unique_ptr<Memory> memory_;
  RLock lock_;
};

}  // namespace detail

template <class T>
class Value {
  static_assert(detail::is_shareable_value_v<T>,
                "forkpool::Value<T>: T must be trivially copyable and hold no pointer");

 public:
  explicit Value(T initial = T{}) : bytes_(std::make_shared<detail::SharedBytes>(sizeof(T))) { store(initial); }
  RLock& get_lock() { return bytes_->lock(); }
  T load() const {
    std::lock_guard held(bytes_->lock());
    T value;
    std::memcpy(&value, bytes_->data(), sizeof(T));
    return value;
  }
  void store(T value) {
    std::lock_guard held(bytes_->lock());
    std::memcpy(bytes_->data(), &value, sizeof(T));
  }

 private:
  friend struct codec<Value<T>>;
  explicit Value(std::shared_ptr<detail::SharedBytes> bytes) : bytes_(std::move(bytes)) {}
  detail::SharedHandle<detail::SharedBytes, "Value"> bytes_;
};

template <class T>
class Array {
  static_assert(detail::is_shareable_value_v<T>,
                "forkpool::Array<T>: T must be trivially copyable and hold no pointer");

 public:
  // `size` zeroed elements, or a copy of `values`.
  // std::invalid_argument when the bytes would not fit a size_t, std::system_error (ENOMEM) when
  // they are more than the process could ever have (detail::memory_limit).
  explicit Array(std::size_t size) : bytes_(std::make_shared<detail::SharedBytes>(checked_bytes(size))) {}
  Array(std::initializer_list<T> values) : Array(std::span<const T>(values.begin(), values.size())) {}
  explicit Array(std::span<const T> values) : Array(values.size()) {
    if (!values.empty()) std::memcpy(bytes_->data(), values.data(), values.size_bytes());
  }

  std::size_t size() const { return bytes_->size() / sizeof(T); }
  RLock& get_lock() { return bytes_->lock(); }
  // One element, under the lock. Throws std::out_of_range.
  T load(std::size_t index) const {
    check(index);
    std::lock_guard held(bytes_->lock());
    T value;
    std::memcpy(&value, bytes_->data() + index * sizeof(T), sizeof(T));
    return value;
  }
  void store(std::size_t index, T value) {
    check(index);
    std::lock_guard held(bytes_->lock());
    std::memcpy(bytes_->data() + index * sizeof(T), &value, sizeof(T));
  }
  // Every element, under the lock.
  std::vector<T> to_vector() const {
    std::lock_guard held(bytes_->lock());
    std::vector<T> values(size());
    if (!values.empty()) std::memcpy(values.data(), bytes_->data(), values.size() * sizeof(T));
    return values;
  }
  // The elements themselves, without the lock: hold get_lock() while other processes write.
  std::span<T> raw() const { return {reinterpret_cast<T*>(bytes_->data()), size()}; }

 private:
  friend struct codec<Array<T>>;
  explicit Array(std::shared_ptr<detail::SharedBytes> bytes) : bytes_(std::move(bytes)) {}
  void check(std::size_t index) const {
    if (index >= size()) throw std::out_of_range("forkpool: Array index out of range");
  }
  static std::size_t checked_bytes(std::size_t size) {
    std::size_t bytes;
    if (__builtin_mul_overflow(size, sizeof(T), &bytes))
      throw std::invalid_argument("forkpool: an Array of " + std::to_string(size) + " elements of " +
                                  std::to_string(sizeof(T)) + " bytes: more bytes than a size_t counts");
    return bytes;
  }
  detail::SharedHandle<detail::SharedBytes, "Array"> bytes_;
};

template <class T>
struct codec<Value<T>> {
  static constexpr std::size_t min_size = sizeof(std::uint64_t) + 2 * sizeof(std::uint32_t);
  static void encode(Writer& w, const Value<T>& value) { value.bytes_->encode(w, value.bytes_.shared()); }
  static Value<T> decode(Reader& r) { return Value<T>(detail::SharedBytes::decode(r, sizeof(T))); }
};
template <class T>
struct codec<Array<T>> {
  static constexpr std::size_t min_size = sizeof(std::uint64_t) + 2 * sizeof(std::uint32_t);
  static void encode(Writer& w, const Array<T>& array) { array.bytes_->encode(w, array.bytes_.shared()); }
  static Array<T> decode(Reader& r) { return Array<T>(detail::SharedBytes::decode(r, sizeof(T))); }
};

}  // namespace forkpool
