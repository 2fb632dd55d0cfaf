// codec<T>: round trips of every built-in type, nested, and rejection of every malformed input.

#include <gtest/gtest.h>

#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <unordered_map>
#include <variant>
#include <vector>

#include <forkpool/ipc/codec.hpp>

namespace forkpool {

enum class Color : std::uint8_t { red, green, blue };
template <>
struct enum_bounds<Color> {
  static constexpr Color min = Color::red;
  static constexpr Color max = Color::blue;
};

namespace {

struct Point {
  double x;
  double y;
  std::int32_t id;
  bool operator==(const Point&) const = default;
};

struct Named {
  std::string name;
  int value;
  bool operator==(const Named&) const = default;
};

}  // namespace

template <>
struct codec<Named> {
  static void encode(Writer& w, const Named& n) {
    w.write(n.name);
    w.write(n.value);
  }
  static Named decode(Reader& r) {
    Named n;
    n.name = r.read<std::string>();
    n.value = r.read<int>();
    return n;
  }
};

namespace {

template <class T>
T round_trip(const T& value) {
  Writer w = encode(value);
  return decode<T>(w.bytes());
}

template <class T>
void expect_round_trip(const T& value) {
  EXPECT_EQ(round_trip(value), value);
}

TEST(Codec, RoundTripsArithmeticTypes) {
  expect_round_trip<int>(-42);
  expect_round_trip<std::uint64_t>(~std::uint64_t{0});
  expect_round_trip<double>(3.25);
  expect_round_trip<float>(-0.5f);
  expect_round_trip<char>('x');
  expect_round_trip<bool>(true);
  expect_round_trip<bool>(false);
  expect_round_trip<Color>(Color::blue);
}

TEST(Codec, RoundTripsStringsAndContainers) {
  expect_round_trip(std::string());
  expect_round_trip(std::string("hello\0world", 11));
  expect_round_trip(std::vector<int>{1, 2, 3});
  expect_round_trip(std::vector<bool>{true, false, true});
  expect_round_trip(std::vector<std::string>{"a", "", "ccc"});
  expect_round_trip(std::array<int, 3>{7, 8, 9});
  expect_round_trip(std::pair<int, std::string>{1, "one"});
  expect_round_trip(std::tuple<int, double, std::string>{1, 2.5, "three"});
  expect_round_trip(std::optional<int>());
  expect_round_trip(std::optional<int>(5));
  expect_round_trip(std::variant<int, std::string>(std::string("alt")));
  expect_round_trip(std::variant<int, std::string>(9));
  expect_round_trip(std::map<std::string, int>{{"a", 1}, {"b", 2}});
  expect_round_trip(std::unordered_map<int, std::string>{{1, "x"}, {2, "y"}});
  expect_round_trip(Point{1.5, -2.5, 7});
  expect_round_trip(Named{"user type", 3});
}

TEST(Codec, RoundTripsDeeplyNestedValues) {
  using Deep =
      std::map<std::string, std::vector<std::optional<std::tuple<int, std::variant<std::string, std::vector<Point>>>>>>;
  Deep deep{
      {"k",
       {std::nullopt,
        std::tuple<int, std::variant<std::string, std::vector<Point>>>{1, std::vector<Point>{{1, 2, 3}, {4, 5, 6}}}}},
      {"j", {std::tuple<int, std::variant<std::string, std::vector<Point>>>{2, std::string("s")}}}};
  expect_round_trip(deep);
}

template <class T>
void expect_protocol_error(std::span<const std::byte> bytes, const char* fragment) {
  try {
    decode<T>(bytes);
    FAIL() << "decoding did not fail";
  } catch (const ProtocolError& e) {
    EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
  }
}

std::vector<std::byte> bytes_of(std::initializer_list<int> values) {
  std::vector<std::byte> out;
  for (int v : values) out.push_back(static_cast<std::byte>(v));
  return out;
}

TEST(Codec, AHugeClaimedCountIsAnErrorNotAnAllocation) {
  Writer w;
  w.write_size(std::uint64_t{1} << 60);
  w.write(1);
  expect_protocol_error<std::vector<int>>(w.buffer(), "claims 1152921504606846976 elements");
  expect_protocol_error<std::string>(w.buffer(), "claims");
  expect_protocol_error<std::map<int, int>>(w.buffer(), "claims");
}

TEST(Codec, ShortInputIsAnError) {
  Writer w = encode(std::string("hello"));
  std::span<const std::byte> cut = w.bytes().first(w.bytes().size() - 1);
  expect_protocol_error<std::string>(cut, "claims");
  expect_protocol_error<int>(bytes_of({1, 2}), "needed 4 bytes, 2 remain");
}

TEST(Codec, TrailingBytesAreAnError) {
  Writer w = encode(5);
  w.write(std::uint8_t{0});
  expect_protocol_error<int>(w.buffer(), "trailing");
}

TEST(Codec, OutOfRangeTagsAreErrors) {
  expect_protocol_error<bool>(bytes_of({2}), "bool is 2");
  expect_protocol_error<Color>(bytes_of({3}), "enum value 3 is out of range");
  expect_protocol_error<std::optional<int>>(bytes_of({7}), "bool is 7");
  Writer w = encode(std::uint32_t{5});
  expect_protocol_error<std::variant<int, std::string>>(w.buffer(), "variant index 5 is out of range");
}

TEST(Codec, DuplicateMapKeysAreAnError) {
  Writer w;
  w.write_size(2);
  w.write(1);
  w.write(10);
  w.write(1);
  w.write(20);
  expect_protocol_error<std::map<int, int>>(w.buffer(), "duplicate key");
}

TEST(Codec, DescriptorIndicesAreChecked) {
  Writer w = encode(std::uint32_t{0});
  Reader r(w.bytes());
  EXPECT_THROW(r.read_fd(), ProtocolError);
}

// Plain aggregates cross as their bytes only without pointers (tests/compile_errors/ shows the
// message a program that tries gets).
struct Pixel {
  float r, g, b;
};
struct Labelled {
  int id;
  Pixel pixels[4];
  std::array<double, 3> weights;
};
struct WithPointer {
  int id;
  float* data;
};
struct WithPointerArray {
  int id;
  const char* names[2];
};
struct WithNestedPointer {
  Pixel p;
  WithPointer inner;
};
struct WithMemberPointer {
  int Pixel::*field;
};

TEST(Codec, APointerAnywhereInAPlainAggregateIsFoundAtCompileTime) {
  static_assert(!detail::has_pointer_member<Pixel>());
  static_assert(!detail::has_pointer_member<Labelled>());
  static_assert(detail::has_pointer_member<WithPointer>());
  static_assert(detail::has_pointer_member<WithPointerArray>());
  static_assert(detail::has_pointer_member<WithNestedPointer>());
  static_assert(detail::has_pointer_member<WithMemberPointer>());
  Labelled in{7, {{1, 2, 3}}, {0.5, 0.25, 0.125}};
  Writer w;
  w.write(in);
  Reader r(w.bytes());
  Labelled out = r.read<Labelled>();
  EXPECT_EQ(out.id, 7);
  EXPECT_EQ(out.pixels[0].b, 3.0f);
  EXPECT_EQ(out.weights[2], 0.125);
}

}  // namespace
}  // namespace forkpool
