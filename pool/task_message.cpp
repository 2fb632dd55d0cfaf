#include <forkpool/pool/internal/task_message.hpp>
#include <forkpool/runtime/internal/loaded_objects.hpp>

#include <forkpool/ipc/internal/frame.hpp>
#include <forkpool/pool/internal/peer_memory.hpp>
#include <forkpool/runtime/internal/describe_exception.hpp>

namespace forkpool::detail {

void write_task_trailer(Writer& w, std::size_t count, const OutgoingBlocks& blocks) {
  w.write(static_cast<std::uint64_t>(count));
  w.write(std::uint64_t{0});
  w.write(static_cast<std::uint64_t>(count));
  blocks.write_table(w);
}

std::shared_ptr<Job> job_part(const std::shared_ptr<Job>& job, std::uint64_t first, std::uint64_t end) {
  std::shared_ptr<Job> root = job->whole ? job->whole : job;
  auto part = std::make_shared<Job>();
  part->sink = root->sink;
  part->chunk = root->chunk;
  part->payload = root->payload;
  part->range = {root->range.count, first, end};
  part->attempts = job->attempts;
  std::size_t at = part->payload.size() - root->blocks.table_bytes() - 2 * sizeof(std::uint64_t);
  std::memcpy(part->payload.data() + at, &first, sizeof first);
  std::memcpy(part->payload.data() + at + sizeof first, &end, sizeof end);
  part->whole = std::move(root);
  return part;
}

TaskCall read_task(Message& task, PeerMemory& memory) {
  TabledPayload payload = split_block_table(task.payload.bytes());
  constexpr std::size_t kHeader = 2 * sizeof(std::uint64_t);
  constexpr std::size_t kRange = 3 * sizeof(std::uint64_t);
  std::span<const std::byte> body = payload.body;
  if (body.size() < kHeader + kRange)
    throw ProtocolError("forkpool: a task message of " + std::to_string(task.payload.bytes().size()) + " bytes is too short");
  ElementRange range;
  std::memcpy(&range, body.data() + body.size() - kRange, kRange);
  if (range.first > range.end || range.end > range.count)
    throw ProtocolError("forkpool: a task message runs elements [" + std::to_string(range.first) + ", " +
                        std::to_string(range.end) + ") of " + std::to_string(range.count));
  Reader header(body.first(kHeader));
  auto invoker = reinterpret_cast<Invoker>(static_cast<std::uintptr_t>(header.read<std::uint64_t>()));
  auto function = static_cast<std::uintptr_t>(header.read<std::uint64_t>());
  return {invoker, function, range, body.subspan(kHeader, body.size() - kHeader - kRange),
          memory.accept_blocks(payload.table)};
}

ObjectRecord record_of(const LoadedObject& object) {
  return {object.path, object.build_id, object.base, object.size};
}

LoadedObject object_of(ObjectRecord record) {
  auto& [path, build_id, base, size] = record;
  return {std::move(path), std::move(build_id), static_cast<std::uintptr_t>(base), static_cast<std::uintptr_t>(size)};
}

Writer encode_object(const LoadedObject& object) { return encode(record_of(object)); }

LoadedObject decode_object(std::span<const std::byte> payload) { return object_of(decode<ObjectRecord>(payload)); }

Writer encode_current_exception() {
  return encode(describe_current_exception());
}

void expect_result_count(Reader& results, std::size_t expected) {
  auto count = results.read<std::uint64_t>();
  if (count != expected)
    results.fail(std::to_string(count) + " results for a chunk of " + std::to_string(expected) + " calls");
}

}  // namespace forkpool::detail
