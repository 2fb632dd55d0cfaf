#include <forkpool/worker/internal/protocol.hpp>
#include <forkpool/runtime/private/loaded_objects.hpp>

#include <forkpool/ipc/internal/frame.hpp>
#include <forkpool/shm/private/peer_memory.hpp>
#include <forkpool/runtime/private/describe_exception.hpp>

namespace forkpool::detail {

namespace {

constexpr std::size_t kTaskHead = 2 * sizeof(std::uint64_t);   // invoker, function
constexpr std::size_t kTaskRange = 3 * sizeof(std::uint64_t);  // count, first, end
static_assert(sizeof(ElementRange) == kTaskRange && std::is_trivially_copyable_v<ElementRange>);

}  // namespace

void write_task_head(Writer& w, std::uint64_t invoker, std::uint64_t function) {
  w.write(invoker);
  w.write(function);
}

void write_task_tail(Writer& w, const ElementRange& range, const OutgoingBlocks& blocks) {
  w.write(range.count);
  w.write(range.first);
  w.write(range.end);
  blocks.write_table(w);
}

TaskLayout parse_task(std::span<const std::byte> body) {
  if (body.size() < kTaskHead + kTaskRange)
    throw ProtocolError("forkpool: a task message of " + std::to_string(body.size()) + " bytes is too short");
  TaskLayout task;
  auto [invoker, function] = task_code_addresses(body);  // the head: one reader of it
  task.invoker = invoker;
  task.function = function;
  std::memcpy(&task.range, body.data() + body.size() - kTaskRange, kTaskRange);
  if (task.range.first > task.range.end || task.range.end > task.range.count)
    throw ProtocolError("forkpool: a task message runs elements [" + std::to_string(task.range.first) + ", " +
                        std::to_string(task.range.end) + ") of " + std::to_string(task.range.count));
  task.elements = body.subspan(kTaskHead, body.size() - kTaskHead - kTaskRange);
  return task;
}

std::array<std::uint64_t, 2> task_code_addresses(std::span<const std::byte> payload) {
  if (payload.size() < kTaskHead) throw ProtocolError("forkpool: a task message too short to name its code");
  std::array<std::uint64_t, 2> addresses;
  std::memcpy(addresses.data(), payload.data(), kTaskHead);
  return addresses;
}

void rewrite_task_range(std::span<std::byte> payload, std::size_t table_bytes, const ElementRange& range) {
  // The range sits just before the block table (write_task_tail).
  if (payload.size() < kTaskHead + kTaskRange + table_bytes)
    throw ProtocolError("forkpool: a task message too short for its range");
  std::memcpy(payload.data() + payload.size() - table_bytes - kTaskRange, &range, kTaskRange);
}

TaskCall read_task(Message& task, PeerMemory& memory) {
  TabledPayload payload = split_block_table(task.payload.bytes());
  TaskLayout layout = parse_task(payload.body);
  return {reinterpret_cast<Invoker>(static_cast<std::uintptr_t>(layout.invoker)),
          static_cast<std::uintptr_t>(layout.function), layout.range, layout.elements,
          memory.accept_blocks(payload.table)};
}

ResultLayout parse_result(std::span<const std::byte> payload) {
  auto [release, rest] = split_release(payload);
  return {release, split_block_table(rest)};
}

void expect_result_count(Reader& results, const ElementRange& range, std::size_t chunk_size) {
  if (range.count != chunk_size) results.fail("a result for a chunk of another size");
  auto count = results.read<std::uint64_t>();
  if (count != range.size())
    results.fail(std::to_string(count) + " results for a chunk of " + std::to_string(range.size()) + " calls");
}

ObjectRecord record_of(const LoadedObject& object) { return {object.path, object.build_id, object.base, object.size}; }

LoadedObject object_of(ObjectRecord record) {
  auto [path, build_id, base, size] = std::move(record);
  return {std::move(path), std::move(build_id), static_cast<std::uintptr_t>(base), static_cast<std::uintptr_t>(size)};
}

Writer encode_object(const LoadedObject& object) { return encode(record_of(object)); }

LoadedObject decode_object(std::span<const std::byte> payload) { return object_of(decode<ObjectRecord>(payload)); }

namespace {
// [id][workers][seed][sharing strategy][spin in ns, -1: adaptive][the parent's pid]
using HelloRecord = std::tuple<std::int32_t, std::int32_t, std::uint64_t, SharingStrategy, std::int64_t, std::int32_t>;
}  // namespace

Writer encode_hello(const HelloMessage& hello) {
  std::int64_t spin = hello.spin ? hello.spin->count() : -1;  // (a negative spin is refused by PoolOptions)
  return encode(HelloRecord(hello.worker_id, hello.workers, hello.seed, hello.sharing, spin, hello.parent));
}

HelloMessage decode_hello(std::span<const std::byte> payload) {
  auto [id, workers, seed, sharing, spin, parent] = decode<HelloRecord>(payload);
  if (sharing != SharingStrategy::file_descriptor && sharing != SharingStrategy::file_system)
    throw ProtocolError("forkpool: the parent's hello names no sharing strategy");
  HelloMessage hello{id, workers, seed, sharing, std::nullopt, static_cast<pid_t>(parent)};
  if (spin >= 0) hello.spin = std::chrono::nanoseconds(spin);
  return hello;
}

Writer encode_current_exception() { return encode(describe_current_exception()); }

}  // namespace forkpool::detail
