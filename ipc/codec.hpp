#pragma once
// codec<T>: how a value crosses between processes. Writer appends bytes (and attaches
// descriptors); Reader takes them apart and never trusts them: every length is checked against
// what remains before anything is allocated, tags and indices are range-checked, and every
// failure is a ProtocolError saying what was wrong and where.
//
// Built in: arithmetic types, enums, std::string, std::vector, std::array, std::pair,
// std::tuple, std::optional, std::variant, std::map, std::unordered_map, std::monostate, and
// trivially copyable aggregates without pointers. A user type opts in with
//   template <> struct forkpool::codec<MyType> {
//     static void encode(forkpool::Writer&, const MyType&);
//     static MyType decode(forkpool::Reader&);
//   };

#include <array>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <variant>
#include <vector>

#include <forkpool/runtime/error.hpp>
#include <forkpool/runtime/unique_fd.hpp>

namespace forkpool {

template <class T>
struct codec;

namespace detail {
// Whether T has a codec (built in, or the user's specialization).
template <class T>
concept HasCodec = requires {
  sizeof(codec<T>);
};

template <class T>
constexpr bool check_has_codec() {
  static_assert(HasCodec<T>,
                "forkpool: this type has no forkpool::codec<T>, so it cannot cross to another process: "
                "give it one (template <> struct forkpool::codec<T> { encode, decode }), see "
                "docs/values-and-codecs.md");
  return true;
}
}  // namespace detail

// An allocator that leaves new elements uninitialized: growing an encode buffer must not cost
// a memset of bytes about to be overwritten.
template <class T>
struct UninitializedAllocator : std::allocator<T> {
  template <class U>
  struct rebind {
    using other = UninitializedAllocator<U>;
  };
  UninitializedAllocator() noexcept = default;
  template <class U>
  UninitializedAllocator(const UninitializedAllocator<U>&) noexcept {}
  template <class U>
  void construct(U* p) noexcept(std::is_nothrow_default_constructible_v<U>) {
    ::new (static_cast<void*>(p)) U;
  }
  template <class U, class... Args>
  void construct(U* p, Args&&... args) {
    ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
  }
};

using ByteBuffer = std::vector<std::byte, UninitializedAllocator<std::byte>>;

// The valid range of an enum's values, for decoding. Specialize with `min` and `max` to have
// out-of-range values rejected; without it any value of the underlying type is accepted.
template <class E>
struct enum_bounds {};

// What codecs may keep about one conversation beyond a single message (shm's tensors keep the
// storages a peer already maps). ipc only carries the pointer; the layer that defines a context
// recognises its own by `kind`, the address of a tag it defines (dynamic_cast would compare type
// names with strcmp, once per tensor a message carries). Null when a message stands alone.
class CodecContext {
 public:
  explicit CodecContext(const void* kind) noexcept : kind_(kind) {}
  virtual ~CodecContext() = default;
  const void* kind() const noexcept { return kind_; }

 private:
  const void* kind_;
};

// The descriptors attached to a message and what keeps them open until it is sent: owned
// duplicates, or objects that own the descriptors they lend (no system call).
class Attachments {
 public:
  std::uint32_t add_copy(int fd);
  std::uint32_t add_borrowed(int fd, std::shared_ptr<const void> owner);
  std::span<const int> fds() const noexcept { return fds_; }

 private:
  std::vector<int> fds_;
  std::vector<UniqueFd> copies_;
  std::vector<std::shared_ptr<const void>> owners_;
};

class Writer {
 public:
  explicit Writer(CodecContext* context = nullptr) noexcept : context_(context) {}

  void write_bytes(const void* data, std::size_t size) {
    if (size == 0) return;
    std::size_t at = bytes_.size();
    bytes_.resize(at + size);  // (not insert(): g++ 12 warns falsely about it at -O2)
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wstringop-overflow"  // g++ 12, -O2: false bounds for strings (GCC bug 105329)
#pragma GCC diagnostic ignored "-Wrestrict"
#endif
    std::memcpy(bytes_.data() + at, data, size);
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
  }
  template <class T>
  void write(const T& value) {
    static_assert(detail::check_has_codec<std::remove_cvref_t<T>>());
    codec<std::remove_cvref_t<T>>::encode(*this, value);
  }
  void write_size(std::uint64_t count) { write_bytes(&count, sizeof count); }

  // Attaches a duplicate of `fd` (the message owns its copy, so the caller's object may go
  // away before the message is sent); returns its index among the message's descriptors.
  std::uint32_t attach_fd(int fd) { return attachments_.add_copy(fd); }
  // Attaches `fd` as lent by `owner`, which the message keeps alive until it is sent.
  std::uint32_t attach_fd(int fd, std::shared_ptr<const void> owner) {
    return attachments_.add_borrowed(fd, std::move(owner));
  }
  // A descriptor as a field of the message: attached as above, its index written in the
  // bytes; Reader::read_fd takes it back at the same place.
  void write_fd(int fd);
  void write_fd(int fd, std::shared_ptr<const void> owner);

  std::span<const std::byte> bytes() const noexcept { return bytes_; }
  ByteBuffer& buffer() noexcept { return bytes_; }
  std::span<const int> fds() const noexcept { return attachments_.fds(); }
  Attachments& attachments() noexcept { return attachments_; }
  CodecContext* context() const noexcept { return context_; }

 private:
  ByteBuffer bytes_;
  Attachments attachments_;
  CodecContext* context_ = nullptr;
};

class Reader {
 public:
  explicit Reader(std::span<const std::byte> bytes, std::span<UniqueFd> fds = {},
                  CodecContext* context = nullptr) noexcept
      : bytes_(bytes), fds_(fds), context_(context) {}

  void read_bytes(void* out, std::size_t size) {
    if (size > remaining())
      fail("needed " + std::to_string(size) + " bytes, " + std::to_string(remaining()) + " remain");
    if (size == 0) return;  // `out` may be an empty vector's null data()
    std::memcpy(out, bytes_.data() + offset_, size);
    offset_ += size;
  }
  template <class T>
  T read() {
    static_assert(detail::check_has_codec<T>());
    return codec<T>::decode(*this);
  }
  // The next `size` bytes, in place (valid as long as the message).
  std::span<const std::byte> read_span(std::size_t size) {
    if (size > remaining())
      fail("needed " + std::to_string(size) + " bytes, " + std::to_string(remaining()) + " remain");
    offset_ += size;
    return bytes_.subspan(offset_ - size, size);
  }
  // A count of elements that take at least `min_element_size` bytes each: checked against
  // what remains, so a lying count never causes a large allocation.
  std::size_t read_count(std::size_t min_element_size, const char* what);
  // As read_count, for a count already read from elsewhere in the message.
  std::size_t check_count(std::uint64_t count, std::size_t min_element_size, const char* what) const;
  // The descriptor attached at `index`; each may be taken once.
  UniqueFd take_fd(std::uint32_t index);
  // The descriptor Writer::write_fd wrote here. Throws ProtocolError as take_fd does.
  UniqueFd read_fd();

  std::size_t remaining() const noexcept { return bytes_.size() - offset_; }
  // Trailing bytes are an error.
  void expect_end() const {
    if (remaining() != 0) fail(std::to_string(remaining()) + " unexpected trailing bytes");
  }
  [[noreturn]] void fail(const std::string& what) const;

  CodecContext* context() const noexcept { return context_; }
  void set_context(CodecContext* context) noexcept { context_ = context; }

 private:
  std::span<const std::byte> bytes_;
  std::span<UniqueFd> fds_;
  std::size_t offset_ = 0;
  CodecContext* context_ = nullptr;
};

// Encodes `value` alone into a fresh Writer.
template <class T>
Writer encode(const T& value) {
  Writer w;
  w.write(value);
  return w;
}

// Decodes a whole message as one T; trailing bytes are an error.
template <class T>
T decode(std::span<const std::byte> bytes, std::span<UniqueFd> fds = {}) {
  Reader r(bytes, fds);
  T value = r.read<T>();
  r.expect_end();
  return value;
}

// The fewest bytes any T encodes to: how counts are bounded before allocating.
template <class T>
constexpr std::size_t min_encoded_size() {
  if constexpr (requires { codec<T>::min_size; }) {
    return codec<T>::min_size;
  } else {
    return 1;
  }
}

namespace detail {

template <class T>
inline constexpr bool is_std_array_v = false;
template <class T, std::size_t N>
inline constexpr bool is_std_array_v<std::array<T, N>> = true;

template <class T>
concept Bitwise = std::is_arithmetic_v<T> && !std::is_same_v<T, bool>;

// Trivially copyable aggregates travel as their bytes. (Pointers inside would be meaningless in
// another process: such types need a codec of their own.)
template <class T>
concept PlainAggregate =
    std::is_trivially_copyable_v<T> && std::is_aggregate_v<T> && std::is_class_v<T> && !is_std_array_v<T> &&
    !std::is_empty_v<T>;

// Whether an aggregate has a pointer member, found without reflection. An initializer that
// converts to anything but an aggregate class makes brace elision split every nested aggregate
// and array into its leaves: count them (the most such initializers `T{...}` takes), then try as
// many that also refuse to become a pointer. Leaves past the first 64 are not checked.
template <class U>
inline constexpr bool is_leaf_v = !(std::is_class_v<U> && std::is_aggregate_v<U>);

struct AnyLeaf {
  template <class U>
  requires is_leaf_v<U>
  operator U() const;  // NOLINT: only in unevaluated contexts
};
struct NonPointerLeaf {
  template <class U>
  requires(is_leaf_v<U> && !std::is_pointer_v<U> && !std::is_member_pointer_v<U> && !std::is_null_pointer_v<U>)
  operator U() const;  // NOLINT
};

template <class T, class Leaf, std::size_t... I>
constexpr bool initializable(std::index_sequence<I...>) {
  return requires { T{(void(I), Leaf{})...}; };
}

inline constexpr std::size_t kMaxCheckedLeaves = 64;

template <class T, std::size_t N = 1, std::size_t Found = 0>
constexpr std::size_t leaf_count() {
  if constexpr (N > kMaxCheckedLeaves) {
    return Found;
  } else {
    constexpr bool takes = initializable<T, AnyLeaf>(std::make_index_sequence<N>{});
    return takes ? leaf_count<T, N + 1, N>() : Found;
  }
}

template <class T>
constexpr bool has_pointer_member() {
  if constexpr (!std::is_aggregate_v<T> || !std::is_class_v<T>) {
    return false;
  } else {
    return !initializable<T, NonPointerLeaf>(std::make_index_sequence<leaf_count<T>()>{});
  }
}

template <class Map>
struct MapCodec {
  using K = typename Map::key_type;
  using V = typename Map::mapped_type;
  static constexpr std::size_t min_size = sizeof(std::uint64_t);
  static void encode(Writer& w, const Map& map) {
    w.write_size(map.size());
    for (const auto& [key, value] : map) {
      w.write(key);
      w.write(value);
    }
  }
  static Map decode(Reader& r) {
    std::size_t count = r.read_count(min_encoded_size<K>() + min_encoded_size<V>(), "map");
    Map map;
    for (std::size_t i = 0; i < count; ++i) {
      K key = r.read<K>();
      V value = r.read<V>();
      if (!map.emplace(std::move(key), std::move(value)).second) r.fail("map has a duplicate key");
    }
    return map;
  }
};

}  // namespace detail

// Numbers and plain aggregates travel as their bytes.
template <class T>
requires detail::Bitwise<T> || detail::PlainAggregate<T>
struct codec<T> {
  static_assert(!detail::has_pointer_member<T>(),
                "forkpool: an aggregate with a pointer member cannot cross as its bytes (the pointer "
                "means nothing in another process): hold the data by value, or give the type a "
                "forkpool::codec<T> of its own (docs/values-and-codecs.md)");
  static constexpr std::size_t min_size = sizeof(T);
  static void encode(Writer& w, const T& value) { w.write_bytes(&value, sizeof value); }
  static T decode(Reader& r) {
    T value;
    r.read_bytes(&value, sizeof value);
    return value;
  }
};

template <>
struct codec<bool> {
  static constexpr std::size_t min_size = 1;
  static void encode(Writer& w, bool value) { w.write(static_cast<std::uint8_t>(value)); }
  static bool decode(Reader& r) {
    auto byte = r.read<std::uint8_t>();
    if (byte > 1) r.fail("bool is " + std::to_string(byte));
    return byte == 1;
  }
};

template <class E>
requires std::is_enum_v<E>
struct codec<E> {
  using U = std::underlying_type_t<E>;
  static constexpr std::size_t min_size = sizeof(U);
  static void encode(Writer& w, E value) { w.write(static_cast<U>(value)); }
  static E decode(Reader& r) {
    U raw = r.read<U>();
    if constexpr (requires { enum_bounds<E>::min; }) {
      if (raw < static_cast<U>(enum_bounds<E>::min) || raw > static_cast<U>(enum_bounds<E>::max))
        r.fail("enum value " + std::to_string(raw) + " is out of range");
    }
    return static_cast<E>(raw);
  }
};

template <>
struct codec<std::monostate> {
  static constexpr std::size_t min_size = 0;
  static void encode(Writer&, std::monostate) {}
  static std::monostate decode(Reader&) { return {}; }
};

template <>
struct codec<std::string> {
  static constexpr std::size_t min_size = sizeof(std::uint64_t);
  static void encode(Writer& w, const std::string& s) {
    w.write_size(s.size());
    w.write_bytes(s.data(), s.size());
  }
  static std::string decode(Reader& r) {
    std::string s(r.read_count(1, "string"), '\0');
    r.read_bytes(s.data(), s.size());
    return s;
  }
};

template <class T, class A>
struct codec<std::vector<T, A>> {
  static constexpr std::size_t min_size = sizeof(std::uint64_t);
  static void encode(Writer& w, const std::vector<T, A>& v) {
    w.write_size(v.size());
    if constexpr (detail::Bitwise<T>) {
      w.write_bytes(v.data(), v.size() * sizeof(T));
    } else {
      for (const auto& element : v) w.write(static_cast<const T&>(element));
    }
  }
  static std::vector<T, A> decode(Reader& r) {
    std::size_t count = r.read_count(std::max<std::size_t>(min_encoded_size<T>(), 1), "vector");
    std::vector<T, A> v;
    if constexpr (detail::Bitwise<T>) {
      v.resize(count);
      r.read_bytes(v.data(), count * sizeof(T));
    } else {
      v.reserve(count);
      for (std::size_t i = 0; i < count; ++i) v.push_back(r.read<T>());
    }
    return v;
  }
};

template <class T, std::size_t N>
struct codec<std::array<T, N>> {
  static constexpr std::size_t min_size = N * min_encoded_size<T>();
  static void encode(Writer& w, const std::array<T, N>& a) {
    for (const auto& element : a) w.write(element);
  }
  static std::array<T, N> decode(Reader& r) {
    return [&]<std::size_t... I>(std::index_sequence<I...>) { return std::array<T, N>{((void)I, r.read<T>())...}; }
    (std::make_index_sequence<N>{});
  }
};

template <class A, class B>
struct codec<std::pair<A, B>> {
  static constexpr std::size_t min_size = min_encoded_size<A>() + min_encoded_size<B>();
  static void encode(Writer& w, const std::pair<A, B>& p) {
    w.write(p.first);
    w.write(p.second);
  }
  static std::pair<A, B> decode(Reader& r) {
    A first = r.read<A>();
    B second = r.read<B>();
    return {std::move(first), std::move(second)};
  }
};

template <class... Ts>
struct codec<std::tuple<Ts...>> {
  static constexpr std::size_t min_size = (std::size_t{0} + ... + min_encoded_size<Ts>());
  static void encode(Writer& w, const std::tuple<Ts...>& t) {
    std::apply([&](const auto&... element) { (w.write(element), ...); }, t);
  }
  static std::tuple<Ts...> decode(Reader& r) {
    // Braced initialization evaluates left to right, as the elements were written.
    return std::tuple<Ts...>{r.read<Ts>()...};
  }
};

template <class T>
struct codec<std::optional<T>> {
  static constexpr std::size_t min_size = 1;
  static void encode(Writer& w, const std::optional<T>& o) {
    w.write(o.has_value());
    if (o) w.write(*o);
  }
  static std::optional<T> decode(Reader& r) {
    if (!r.read<bool>()) return std::nullopt;
    return r.read<T>();
  }
};

template <class... Ts>
struct codec<std::variant<Ts...>> {
  static constexpr std::size_t min_size = sizeof(std::uint32_t);
  static void encode(Writer& w, const std::variant<Ts...>& v) {
    w.write(static_cast<std::uint32_t>(v.index()));
    std::visit([&](const auto& alternative) { w.write(alternative); }, v);
  }
  static std::variant<Ts...> decode(Reader& r) {
    auto index = r.read<std::uint32_t>();
    if (index >= sizeof...(Ts)) r.fail("variant index " + std::to_string(index) + " is out of range");
    using Decoder = std::variant<Ts...> (*)(Reader&);
    static constexpr Decoder decoders[] = {
        +[](Reader& rr) { return std::variant<Ts...>(std::in_place_type<Ts>, rr.read<Ts>()); }...};
    return decoders[index](r);
  }
};

template <class K, class V, class C, class A>
struct codec<std::map<K, V, C, A>> : detail::MapCodec<std::map<K, V, C, A>> {};
template <class K, class V, class H, class E, class A>
struct codec<std::unordered_map<K, V, H, E, A>> : detail::MapCodec<std::unordered_map<K, V, H, E, A>> {};

}  // namespace forkpool
