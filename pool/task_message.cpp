#include <forkpool/pool/internal/task_message.hpp>
#include <forkpool/runtime/internal/loaded_objects.hpp>

#include <forkpool/ipc/internal/frame.hpp>
#include <forkpool/pool/internal/loans.hpp>
#include <forkpool/runtime/internal/describe_exception.hpp>

namespace forkpool::detail {

namespace {
// Bytes from the end of a task message to its range: the lent ids and their number.
std::size_t lent_ids_bytes(std::size_t lent) { return lent * sizeof(std::uint64_t) + sizeof(std::uint32_t); }
}  // namespace

void write_task_trailer(Writer& w, std::size_t count, const MessageLoan& loan) {
  w.write(static_cast<std::uint64_t>(count));
  w.write(std::uint64_t{0});
  w.write(static_cast<std::uint64_t>(count));
  for (const auto& storage : loan.storages()) w.write(storage->id());
  w.write(static_cast<std::uint32_t>(loan.storages().size()));
}

std::shared_ptr<Job> job_part(const std::shared_ptr<Job>& job, std::uint64_t first, std::uint64_t end) {
  std::shared_ptr<Job> root = job->whole ? job->whole : job;
  auto part = std::make_shared<Job>();
  part->sink = root->sink;
  part->chunk = root->chunk;
  part->payload = root->payload;
  part->range = {root->range.count, first, end};
  part->attempts = job->attempts;
  std::size_t at = part->payload.size() - lent_ids_bytes(root->loan.storages().size()) - 2 * sizeof(std::uint64_t);
  std::memcpy(part->payload.data() + at, &first, sizeof first);
  std::memcpy(part->payload.data() + at + sizeof first, &end, sizeof end);
  part->whole = std::move(root);
  return part;
}

std::vector<int> task_descriptors(std::span<const int> new_lent_fds, const Attachments& attachments) {
  std::vector<int> fds(new_lent_fds.begin(), new_lent_fds.end());
  fds.insert(fds.end(), attachments.fds().begin(), attachments.fds().end());
  return fds;
}

TaskCall read_task(Message& task, BorrowedStorages& borrowed) {
  std::span<const std::byte> payload = task.payload.bytes();
  constexpr std::size_t kHeader = 2 * sizeof(std::uint64_t);
  std::uint32_t lent = 0;
  if (payload.size() < kHeader + sizeof(std::uint64_t) + sizeof lent)
    throw ProtocolError("forkpool: a task message of " + std::to_string(payload.size()) + " bytes is too short");
  std::memcpy(&lent, payload.data() + payload.size() - sizeof lent, sizeof lent);
  std::size_t trailer = 3 * sizeof(std::uint64_t) + lent_ids_bytes(lent);
  if (trailer > payload.size() - kHeader)
    throw ProtocolError("forkpool: a task message claims " + std::to_string(lent) + " lent storages in " +
                        std::to_string(payload.size()) + " bytes");
  std::size_t body_end = payload.size() - trailer;
  ElementRange range;
  std::memcpy(&range.count, payload.data() + body_end, sizeof range.count);
  std::memcpy(&range.first, payload.data() + body_end + 8, sizeof range.first);
  std::memcpy(&range.end, payload.data() + body_end + 16, sizeof range.end);
  if (range.first > range.end || range.end > range.count)
    throw ProtocolError("forkpool: a task message runs elements [" + std::to_string(range.first) + ", " +
                        std::to_string(range.end) + ") of " + std::to_string(range.count));
  std::vector<std::uint64_t> lent_ids(lent);
  if (lent > 0) std::memcpy(lent_ids.data(), payload.data() + body_end + 24, lent * sizeof(std::uint64_t));

  std::size_t taken = borrowed.begin_message(lent_ids, task.fds);
  Reader header(payload.first(kHeader));
  auto invoker = reinterpret_cast<Invoker>(static_cast<std::uintptr_t>(header.read<std::uint64_t>()));
  auto function = static_cast<std::uintptr_t>(header.read<std::uint64_t>());
  return {invoker, function, range,
          Reader(payload.subspan(kHeader, body_end - kHeader), std::span(task.fds).subspan(taken), &borrowed)};
}

Writer encode_object(const LoadedObject& object) {
  return encode(std::tuple<std::string, std::string, std::uint64_t, std::uint64_t>(object.path, object.build_id,
                                                                                   object.base, object.size));
}

LoadedObject decode_object(std::span<const std::byte> payload) {
  auto [path, build_id, base, size] = decode<std::tuple<std::string, std::string, std::uint64_t, std::uint64_t>>(payload);
  return {std::move(path), std::move(build_id), static_cast<std::uintptr_t>(base), static_cast<std::uintptr_t>(size)};
}

Writer encode_current_exception() {
  return encode(describe_current_exception());
}

void expect_result_count(Reader& results, std::size_t expected) {
  auto count = results.read<std::uint64_t>();
  if (count != expected)
    results.fail(std::to_string(count) + " results for a chunk of " + std::to_string(expected) + " calls");
}

}  // namespace forkpool::detail
