#include <mpi.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>

#include <forkpool/mpi/private/mpi_pool_core.hpp>
#include <forkpool/mpi/private/node_server.hpp>
#include <forkpool/mpi/private/protocol.hpp>
#include <forkpool/mpi/private/world.hpp>
#include <forkpool/mpi/mpi_pool.hpp>
#include <forkpool/worker/init.hpp>
#include <forkpool/runtime/private/loaded_objects.hpp>

namespace forkpool::mpi {
namespace detail {
namespace {

World* g_world = nullptr;

std::string hex(const std::string& bytes) {
  static const char digits[] = "0123456789abcdef";
  std::string out;
  for (unsigned char c : bytes) {
    out += digits[c >> 4];
    out += digits[c & 15];
  }
  return out.empty() ? "(none)" : out;
}

// Every rank learns every rank's build id of the main program; all throw if one differs.
void check_same_build(const World& w) {
  constexpr std::size_t kIdBytes = 64;
  std::string mine = forkpool::detail::loaded_objects().front().build_id.substr(0, kIdBytes);
  std::array<char, kIdBytes + 1> sent{};
  sent[0] = static_cast<char>(mine.size());
  mine.copy(sent.data() + 1, mine.size());
  std::string all(sent.size() * static_cast<std::size_t>(w.size), '\0');
  MPI_Allgather(sent.data(), static_cast<int>(sent.size()), MPI_BYTE, all.data(), static_cast<int>(sent.size()),
                MPI_BYTE, MPI_COMM_WORLD);
  auto id_of = [&](int rank) {
    const char* at = all.data() + static_cast<std::size_t>(rank) * sent.size();
    return std::string(at + 1, static_cast<unsigned char>(at[0]));
  };
  std::string differing;
  for (int rank = 1; rank < w.size; ++rank)
    if (id_of(rank) != id_of(0))
      differing += (differing.empty() ? "" : ", ") + std::to_string(rank) + " (" + hex(id_of(rank)) + ")";
  if (differing.empty()) return;
  MPI_Finalize();
  throw BuildMismatch("forkpool::mpi::init: ranks " + differing + " run another build of the program than rank 0 (" +
                      hex(id_of(0)) + "): every rank must run the same executable");
}

// Rank 0's view of the nodes: the lowest rank of each machine other than its own.
std::vector<int> find_node_ranks(const World& w) {
  const char* switch_value = std::getenv("FORKPOOL_MPI_NODE_PER_RANK");
  bool per_rank = switch_value && std::string(switch_value) == "1";
  MPI_Comm node;
  if (per_rank)
    MPI_Comm_split(MPI_COMM_WORLD, w.rank, 0, &node);
  else
    MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, w.rank, MPI_INFO_NULL, &node);
  int node_rank = 0;
  MPI_Comm_rank(node, &node_rank);
  int leads = node_rank == 0 ? 1 : 0;
  std::vector<int> all(static_cast<std::size_t>(w.size));
  MPI_Allgather(&leads, 1, MPI_INT, all.data(), 1, MPI_INT, MPI_COMM_WORLD);
  MPI_Comm_free(&node);
  std::vector<int> ranks;
  for (int rank = 1; rank < w.size; ++rank)
    if (all[static_cast<std::size_t>(rank)]) ranks.push_back(rank);
  return ranks;
}

// Rank 0's object table, which every rank needs to translate the code addresses tasks name.
std::vector<forkpool::detail::ObjectRecord> share_rank0_objects(const World& w) {
  ByteBuffer bytes;
  if (w.rank == 0) {
    std::vector<forkpool::detail::ObjectRecord> records;
    for (const auto& object : forkpool::detail::loaded_objects())
      records.push_back(forkpool::detail::record_of(object));
    Writer writer;
    writer.write(records);
    bytes = std::move(writer.buffer());
  }
  std::uint64_t size = bytes.size();
  MPI_Bcast(&size, 1, MPI_UINT64_T, 0, MPI_COMM_WORLD);
  bytes.resize(size);
  MPI_Bcast(bytes.data(), static_cast<int>(size), MPI_BYTE, 0, MPI_COMM_WORLD);
  return decode<std::vector<forkpool::detail::ObjectRecord>>(bytes);
}

// Rank 0's program has ended: the other ranks stop serving, and MPI is finalised.
void finalize_at_exit() {
  World& w = *g_world;
  for (int rank = 1; rank < w.size; ++rank) {
    Writer message;
    message.write(Kind::shutdown);
    w.transport.send(rank, std::move(message.buffer()));
  }
  w.transport.flush();
  MPI_Finalize();
}

}  // namespace

World& world(const char* who) {
  if (!g_world) throw std::logic_error(std::string("forkpool: ") + who + " before forkpool::mpi::init()");
  if (std::this_thread::get_id() != g_world->thread)
    throw std::logic_error(std::string("forkpool: ") + who +
                           " called from another thread than forkpool::mpi::init()'s (MPI is initialised FUNNELED)");
  return *g_world;
}

std::shared_ptr<forkpool::detail::PoolCore> make_pool_core(PoolOptions options) {
  return MpiPoolCore::create(std::move(options));
}

}  // namespace detail

void init(int& argc, char**& argv) {
  if (detail::g_world) throw std::logic_error("forkpool::mpi::init() called twice");
  forkpool::init();  // the fork server, before MPI_Init starts threads
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);
  auto* w = new detail::World;
  w->thread = std::this_thread::get_id();
  MPI_Comm_rank(MPI_COMM_WORLD, &w->rank);
  MPI_Comm_size(MPI_COMM_WORLD, &w->size);
  try {
    detail::check_same_build(*w);
  } catch (...) {
    delete w;
    throw;
  }
  w->node_ranks = detail::find_node_ranks(*w);
  w->rank0_objects = detail::share_rank0_objects(*w);
  detail::g_world = w;
  if (w->rank != 0) {
    detail::serve_node(*w);
    w->transport.flush();
    MPI_Finalize();
    std::exit(0);
  }
  std::atexit(detail::finalize_at_exit);
}

int world_size() { return detail::world("forkpool::mpi::world_size").size; }

int node_count() { return 1 + static_cast<int>(detail::world("forkpool::mpi::node_count").node_ranks.size()); }

}  // namespace forkpool::mpi
