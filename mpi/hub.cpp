#include <forkpool/mpi/private/hub.hpp>

#include <cstdio>

#include <forkpool/mpi/private/mpi_pool_core.hpp>
#include <forkpool/mpi/private/polling.hpp>
#include <forkpool/mpi/private/world.hpp>
#include <forkpool/runtime/error.hpp>
#include <forkpool/shm/private/slab_allocator.hpp>

namespace forkpool::mpi::detail {

Hub& Hub::instance() {
  static Hub* hub = new Hub;  // outlives every pool and the loop's last turn
  return *hub;
}

std::uint64_t Hub::add(MpiPoolCore* pool) {
  std::uint64_t id = next_id_++;
  pools_[id] = pool;
  return id;
}

void Hub::remove(std::uint64_t pool) { pools_.erase(pool); }

void Hub::send(int rank, ByteBuffer payload, const std::vector<std::shared_ptr<forkpool::detail::Storage>>& blocks) {
  world("mpi::Pool").transport.send(rank, std::move(payload), blocks);
  wake();
}

void Hub::wake() {
  if (polling_) return;
  polling_ = true;
  scope_.start([](Hub& hub) -> Task<void> {
    co_await poll_with_backoff([&hub] { return hub.step(); }, [&hub] { return hub.busy(); });
    hub.polling_ = false;
  }(*this));
}

bool Hub::busy() const {
  if (world("mpi::Pool").transport.sending()) return true;
  for (const auto& [id, pool] : pools_)
    if (pool->awaits_nodes()) return true;
  return false;
}

bool Hub::step() {
  Transport& transport = world("mpi::Pool").transport;
  bool any = transport.progress();
  while (auto message = transport.try_receive()) {
    any = true;
    try {
      Reader r(message->payload);
      route(message->source, r);
    } catch (const ProtocolError& e) {
      // A rank runs our own build, so this is a bug, not an attack: say so and keep serving.
      std::fprintf(stderr, "forkpool::mpi: a malformed message from rank %d was dropped: %s\n", message->source,
                   e.what());
    }
  }
  return any;
}

void Hub::route(int source, Reader& r) {
  auto kind = r.read<Kind>();
  auto pool_id = r.read<std::uint64_t>();
  auto it = pools_.find(pool_id);
  if (it == pools_.end()) {
    // A pool dropped since: its results are unwanted, but their blocks must still be taken in.
    if (kind == Kind::done) {
      (void)r.read<std::uint64_t>();
      (void)r.read<std::uint64_t>();
      (void)r.read<std::uint64_t>();
      (void)receive_result_blocks(r, source);
    }
    return;
  }
  it->second->receive(kind, source, r);
}

std::shared_ptr<forkpool::detail::Storage> new_block(std::uint64_t bytes) {
  if (bytes == 0 || bytes > (std::uint64_t{1} << 40))
    throw ProtocolError("forkpool::mpi: a block of an impossible size");
  return forkpool::detail::SlabAllocator::instance().allocate(bytes);
}

std::vector<std::shared_ptr<forkpool::detail::Storage>> receive_result_blocks(Reader& r, int source) {
  auto sizes = r.read<std::vector<std::uint64_t>>();
  std::vector<std::shared_ptr<forkpool::detail::Storage>> blocks;
  blocks.reserve(sizes.size());
  for (std::uint64_t bytes : sizes) blocks.push_back(new_block(bytes));
  world("mpi::Pool").transport.receive_blocks(source, blocks);
  return blocks;
}

}  // namespace forkpool::mpi::detail
