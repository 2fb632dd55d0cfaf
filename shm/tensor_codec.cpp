#include <forkpool/shm/tensor_codec.hpp>

#include <stdexcept>
#include <string>

#include <forkpool/runtime/error.hpp>
#include <forkpool/shm/private/slab_allocator.hpp>
#include <forkpool/shm/internal/storage_conversation.hpp>

namespace forkpool {
namespace {

// memfd: a descriptor rides along; named: a /dev/shm name; block: a block of a slab, by its
// place in the message's table of blocks (storage_conversation.hpp).
enum class StorageKind : std::uint8_t { none, memfd, named, block };

}  // namespace

template <>
struct enum_bounds<StorageKind> {
  static constexpr StorageKind min = StorageKind::none;
  static constexpr StorageKind max = StorageKind::block;
};

namespace detail {

const char StorageConversation::kKind = 0;

void encode_tensor_view(Writer& w, const std::shared_ptr<Storage>& storage, std::int64_t byte_offset,
                        std::span<const std::int64_t> shape, std::span<const std::int64_t> strides, DType dtype) {
  // Refused here, not where it arrives: there it would read as a malformed message.
  if (shape.size() > TensorView::kMaxDims)
    throw std::invalid_argument("forkpool: a tensor of " + std::to_string(shape.size()) +
                                " dimensions cannot be sent: a receiver reads at most " +
                                std::to_string(TensorView::kMaxDims));
  if (!storage) {
    w.write(StorageKind::none);
    return;
  }
  if (!storage->is_shared())
    throw std::invalid_argument(
        "forkpool: this tensor's memory is not shared (it came from DLPack): call share_memory_() to copy it "
        "into shared memory once, then send it");
  StorageConversation* conversation = StorageConversation::of(w.context());
  std::uint64_t storage_size = storage->size();
  std::int64_t offset = byte_offset;
  if (auto index = storage->slab() && conversation ? conversation->block_index(storage) : std::nullopt) {
    w.write(StorageKind::block);
    w.write(*index);
  } else if (Slab* slab = storage->slab()) {
    // No conversation to say when the receiver lets go: the whole slab crosses, and its blocks
    // are never handed out again (the slab goes once those in use come back).
    SlabAllocator::instance().retire(*slab);
    w.write(StorageKind::memfd);
    w.write_fd(slab->fd(), storage);
    storage_size = slab->size();
    offset += static_cast<std::int64_t>(storage->slab_offset());
  } else if (storage->strategy() == SharingStrategy::file_descriptor) {
    w.write(StorageKind::memfd);
    w.write_fd(storage->fd(), storage);  // the message keeps the storage, no dup
  } else {
    w.write(StorageKind::named);
    w.write(storage->name());
    storage->add_message_reference();
  }
  w.write(storage_size);
  w.write(offset);
  w.write(dtype);
  // As codec<std::vector<std::int64_t>> writes them, without the vectors.
  for (std::span<const std::int64_t> values : {shape, strides}) {
    w.write_size(values.size());
    w.write_bytes(values.data(), values.size_bytes());
  }
}

}  // namespace detail

void codec<Tensor>::encode(Writer& w, const Tensor& tensor) {
  detail::encode_tensor_view(w, tensor.storage(), tensor.storage_offset(), tensor.shape(), tensor.strides(),
                             tensor.dtype());
}

namespace detail {

void decode_tensor_view(Reader& r, TensorView& view) {
  auto kind = r.read<StorageKind>();
  if (kind == StorageKind::none) {
    view = {};
    return;
  }
  std::uint32_t index = 0;  // of the descriptor (memfd) or of the block (block)
  std::string name;
  if (kind == StorageKind::named)
    name = r.read<std::string>();
  else
    index = r.read<std::uint32_t>();
  auto storage_size = r.read<std::uint64_t>();
  view.byte_offset = r.read<std::int64_t>();
  view.dtype = r.read<DType>();
  // As codec<std::vector<std::int64_t>> wrote them, shape then strides.
  auto read_count = [&r] {
    std::size_t count = r.read_count(sizeof(std::int64_t), "tensor dimensions");
    if (count > TensorView::kMaxDims) r.fail("tensor has " + std::to_string(count) + " dimensions");
    return count;
  };
  view.dims = read_count();
  r.read_bytes(view.shape_values.data(), view.dims * sizeof(std::int64_t));
  if (std::size_t strides = read_count(); strides != view.dims)
    r.fail("tensor shape and strides are mismatched: " + std::to_string(view.dims) + " dimensions, " +
           std::to_string(strides) + " strides");
  r.read_bytes(view.stride_values.data(), view.dims * sizeof(std::int64_t));

  // The view must fit in the storage it claims, before anything is mapped.
  std::int64_t offset = view.byte_offset;
  auto extent = view_extent(view.shape(), view.strides(), element_size(view.dtype));
  if (!extent) r.fail("tensor shape or strides are negative, mismatched or overflow");
  if (offset < 0 || static_cast<std::uint64_t>(offset) > storage_size || *extent > storage_size - offset)
    r.fail("tensor view (offset " + std::to_string(offset) + ", " + std::to_string(*extent) +
           " bytes) exceeds its storage of " + std::to_string(storage_size) + " bytes");
  view.extent = *extent;

  switch (kind) {
    case StorageKind::memfd: view.storage = Storage::adopt_memfd(r.take_fd(index), storage_size); break;
    case StorageKind::named: view.storage = Storage::adopt_named(name, storage_size); break;
    default: {
      const StorageConversation* conversation = StorageConversation::of(r.context());
      view.storage = conversation ? conversation->block_at(index) : nullptr;
      if (!view.storage) r.fail("tensor names block " + std::to_string(index) + ", which its message does not carry");
      if (view.storage->size() < storage_size) r.fail("tensor claims a block larger than the one its message carries");
      break;
    }
  }
}

}  // namespace detail

Tensor codec<Tensor>::decode(Reader& r) {
  detail::TensorView view;
  detail::decode_tensor_view(r, view);
  if (!view.storage) return Tensor();
  return detail::tensor_from_storage(std::move(view.storage), view.byte_offset, view.shape(), view.strides(),
                                     view.dtype);
}

}  // namespace forkpool
