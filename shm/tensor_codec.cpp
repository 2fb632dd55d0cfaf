#include <forkpool/shm/tensor_codec.hpp>

#include <string>

#include <forkpool/runtime/error.hpp>
#include <forkpool/shm/internal/storage_conversation.hpp>

namespace forkpool {
namespace {

// memfd: a descriptor rides along; named: a /dev/shm name; lent: lent by this message or an
// earlier one of the conversation (storage_loans.hpp), by the lender's id; returned: a storage the
// message being answered lent, by that id.
enum class StorageKind : std::uint8_t { none, memfd, named, lent, returned };
constexpr std::size_t kMaxDims = 64;

// A storage named by id in this conversation.
std::shared_ptr<Storage> find_referenced(Reader& r, detail::StorageReference ref, std::uint64_t min_size) {
  auto* conversation = dynamic_cast<const detail::StorageConversation*>(r.context());
  std::shared_ptr<Storage> storage = conversation ? conversation->resolve(ref) : nullptr;
  if (!storage)
    r.fail("tensor names storage " + std::to_string(ref.id) + ", which this conversation did not " +
           (ref.returned ? "lend in the message answered" : "lend"));
  if (storage->size() < min_size) r.fail("tensor storage " + std::to_string(ref.id) + " is shorter than claimed");
  return storage;
}

}  // namespace

template <>
struct enum_bounds<StorageKind> {
  static constexpr StorageKind min = StorageKind::none;
  static constexpr StorageKind max = StorageKind::returned;
};

void codec<Tensor>::encode(Writer& w, const Tensor& tensor) {
  const auto& storage = tensor.storage();
  if (!storage) {
    w.write(StorageKind::none);
    return;
  }
  if (!storage->is_shared())
    throw std::invalid_argument(
        "forkpool: this tensor's memory is not shared (it came from DLPack): call share_memory_() to copy it "
        "into shared memory once, then send it");
  auto* conversation = dynamic_cast<detail::StorageConversation*>(w.context());
  if (auto ref = conversation ? conversation->reference(storage) : std::nullopt) {
    w.write(ref->returned ? StorageKind::returned : StorageKind::lent);
    w.write(ref->id);
  } else if (storage->strategy() == SharingStrategy::file_descriptor) {
    w.write(StorageKind::memfd);
    w.write(w.attach_fd(storage->fd(), storage));  // the message keeps the storage, no dup
  } else {
    w.write(StorageKind::named);
    w.write(storage->name());
    storage->add_message_reference();
  }
  w.write(static_cast<std::uint64_t>(storage->size()));
  w.write(tensor.storage_offset());
  w.write(tensor.dtype());
  w.write(std::vector<std::int64_t>(tensor.shape().begin(), tensor.shape().end()));
  w.write(std::vector<std::int64_t>(tensor.strides().begin(), tensor.strides().end()));
}

Tensor codec<Tensor>::decode(Reader& r) {
  auto kind = r.read<StorageKind>();
  if (kind == StorageKind::none) return Tensor();
  std::uint32_t fd_index = 0;
  std::uint64_t lent_id = 0;
  std::string name;
  if (kind == StorageKind::memfd) fd_index = r.read<std::uint32_t>();
  else if (kind == StorageKind::named) name = r.read<std::string>();
  else lent_id = r.read<std::uint64_t>();
  auto storage_size = r.read<std::uint64_t>();
  auto offset = r.read<std::int64_t>();
  auto dtype = r.read<DType>();
  auto shape = r.read<std::vector<std::int64_t>>();
  auto strides = r.read<std::vector<std::int64_t>>();

  // The view must fit in the storage it claims, before anything is mapped.
  if (shape.size() > kMaxDims) r.fail("tensor has " + std::to_string(shape.size()) + " dimensions");
  auto extent = detail::view_extent(shape, strides, element_size(dtype));
  if (!extent) r.fail("tensor shape or strides are negative, mismatched or overflow");
  if (offset < 0 || static_cast<std::uint64_t>(offset) > storage_size || *extent > storage_size - offset)
    r.fail("tensor view (offset " + std::to_string(offset) + ", " + std::to_string(*extent) +
           " bytes) exceeds its storage of " + std::to_string(storage_size) + " bytes");

  std::shared_ptr<Storage> storage;
  switch (kind) {
    case StorageKind::memfd: storage = Storage::adopt_memfd(r.take_fd(fd_index), storage_size); break;
    case StorageKind::named: storage = Storage::adopt_named(name, storage_size); break;
    default:
      storage = find_referenced(r, {lent_id, kind == StorageKind::returned}, storage_size);
      break;
  }
  return Tensor::from_storage(std::move(storage), offset, std::move(shape), std::move(strides), dtype);
}

}  // namespace forkpool
