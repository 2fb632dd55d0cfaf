// libFuzzer target: every built-in codec decoding arbitrary bytes. The first byte picks the
// type; the rest is the message. Decoding must succeed or throw ProtocolError, never crash,
// never allocate more than the input could describe.

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <unordered_map>
#include <variant>
#include <vector>

#include <forkpool/ipc/codec.hpp>
#include <forkpool/pool/internal/loans.hpp>
#include <forkpool/shm/tensor_codec.hpp>

namespace fp = forkpool;

namespace {

template <class T>
void try_decode(std::span<const std::byte> bytes) {
  try {
    T value = fp::decode<T>(bytes);
    fp::Writer again = fp::encode(value);  // what decodes must encode
    (void)again;
  } catch (const fp::ProtocolError&) {
  }
}

// A worker's reply as the parent decodes it: it may name storages the job lent (this one, id 1
// in a fresh process) by id alone.
void try_decode_reply(std::span<const std::byte> bytes) {
  static fp::detail::MessageLoan* loan = [] {
    auto* made = new fp::detail::MessageLoan();
    made->lend(fp::Tensor::zeros({64}, fp::DType::f32).storage());
    return made;
  }();
  try {
    fp::Reader reader(bytes, {}, loan);
    fp::Tensor tensor = reader.read<fp::Tensor>();
    reader.expect_end();
    // Every byte the view reaches is inside the mapping: touch the last one.
    auto extent = fp::detail::view_extent(tensor.shape(), tensor.strides(), fp::element_size(tensor.dtype()));
    if (tensor.storage() && extent && *extent > 0) (void)static_cast<volatile std::byte*>(tensor.raw_data())[*extent - 1];
  } catch (const fp::ProtocolError&) {
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  auto bytes = std::as_bytes(std::span(data + 1, size - 1));
  switch (data[0] % 15) {
    case 0: try_decode<int>(bytes); break;
    case 1: try_decode<bool>(bytes); break;
    case 2: try_decode<std::string>(bytes); break;
    case 3: try_decode<std::vector<double>>(bytes); break;
    case 4: try_decode<std::vector<std::string>>(bytes); break;
    case 5: try_decode<std::array<std::int16_t, 3>>(bytes); break;
    case 6: try_decode<std::pair<int, std::string>>(bytes); break;
    case 7: try_decode<std::tuple<std::uint8_t, std::optional<std::string>, double>>(bytes); break;
    case 8: try_decode<std::variant<int, std::string, std::vector<int>>>(bytes); break;
    case 9: try_decode<std::map<std::string, std::vector<int>>>(bytes); break;
    case 10: try_decode<std::unordered_map<int, std::optional<int>>>(bytes); break;
    case 11: try_decode<fp::DType>(bytes); break;
    case 12: try_decode<std::vector<std::vector<std::pair<int, bool>>>>(bytes); break;
    case 13: try {
        fp::decode<fp::Tensor>(bytes);  // no descriptors attached: every memfd reference fails cleanly
      } catch (const fp::ProtocolError&) {
      } catch (const std::invalid_argument&) {
      }
      break;
    case 14: try_decode_reply(bytes); break;
  }
  return 0;
}
