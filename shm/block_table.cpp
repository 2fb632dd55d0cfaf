#include <forkpool/shm/internal/block_table.hpp>

#include <cstring>
#include <string>

#include <forkpool/runtime/error.hpp>
#include <forkpool/shm/internal/slab.hpp>

namespace forkpool::detail {
namespace {

[[noreturn]] void broken(const std::string& what) { throw ProtocolError("forkpool: " + what); }

}  // namespace

std::optional<std::uint32_t> OutgoingBlocks::block_index(const std::shared_ptr<Storage>& storage) {
  auto next = static_cast<std::uint32_t>(storages_.size());
  if (index_.empty()) {  // a few blocks so far: scan them
    for (std::uint32_t i = 0; i < next; ++i)
      if (storages_[i] == storage) return i;
    storages_.push_back(storage);
    if (storages_.size() == kIndexedFrom)  // many: index them from here on
      for (std::uint32_t i = 0; i <= next; ++i) index_.emplace(storages_[i].get(), i);
    return next;
  }
  auto [it, fresh] = index_.try_emplace(storage.get(), next);
  if (fresh) storages_.push_back(storage);
  return it->second;
}

void OutgoingBlocks::write_table(Writer& w) const {
  for (const auto& storage : storages_) {
    w.write(storage->slab()->id());
    w.write(static_cast<std::uint64_t>(storage->slab_offset()));
    w.write(static_cast<std::uint64_t>(storage->size()));
  }
  w.write(static_cast<std::uint32_t>(storages_.size()));
}

std::size_t OutgoingBlocks::table_bytes() const noexcept {
  return storages_.size() * sizeof(BlockEntry) + sizeof(std::uint32_t);
}

TabledPayload split_block_table(std::span<const std::byte> payload) {
  std::uint32_t count = 0;
  if (payload.size() < sizeof count)
    broken("a message of " + std::to_string(payload.size()) + " bytes has no table of blocks");
  std::memcpy(&count, payload.data() + payload.size() - sizeof count, sizeof count);
  std::size_t table = std::size_t{count} * sizeof(BlockEntry);
  if (table > payload.size() - sizeof count)
    broken("a message claims " + std::to_string(count) + " blocks in " + std::to_string(payload.size()) + " bytes");
  std::size_t body = payload.size() - sizeof count - table;
  TabledPayload split{payload.first(body), std::vector<BlockEntry>(count)};
  if (count > 0) std::memcpy(split.table.data(), payload.data() + body, table);
  return split;
}

void BlockRelease::encode_to(Writer& w) const {
  w.write(blocks);
  w.write(slabs);
}

Writer BlockRelease::encode() const {
  Writer w;
  w.buffer().reserve(codec<std::vector<std::uint64_t>>::min_size * 2 +
                     (blocks.size() + slabs.size()) * sizeof(std::uint64_t));  // one allocation, not three
  encode_to(w);
  return w;
}

ReleaseView ReleaseView::read(std::span<const std::byte> payload) {
  Reader r(payload);
  ReleaseView view;
  std::size_t numbers = r.read_count(sizeof(std::uint64_t), "release");
  if (numbers % 3 != 0) broken("a release of " + std::to_string(numbers) + " numbers");
  view.blocks_ = r.read_span(numbers * sizeof(std::uint64_t));
  view.slabs_ = r.read_span(r.read_count(sizeof(std::uint64_t), "release") * sizeof(std::uint64_t));
  r.expect_end();
  return view;
}

void append_release(Writer& w, const BlockRelease& release) {
  std::size_t start = w.buffer().size();
  release.encode_to(w);
  w.write(static_cast<std::uint32_t>(w.buffer().size() - start));
}

std::pair<std::span<const std::byte>, std::span<const std::byte>> split_release(std::span<const std::byte> payload) {
  std::uint32_t length = 0;
  if (payload.size() < sizeof length)
    broken("a message of " + std::to_string(payload.size()) + " bytes has no release");
  std::memcpy(&length, payload.data() + payload.size() - sizeof length, sizeof length);
  if (length > payload.size() - sizeof length)
    broken("a message claims a release of " + std::to_string(length) + " bytes");
  std::size_t rest = payload.size() - sizeof length - length;
  return {payload.subspan(rest, length), payload.first(rest)};
}

}  // namespace forkpool::detail
