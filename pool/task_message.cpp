#include <forkpool/pool/internal/task_message.hpp>

#include <forkpool/ipc/internal/frame.hpp>
#include <forkpool/pool/internal/loans.hpp>
#include <forkpool/runtime/internal/describe_exception.hpp>

namespace forkpool::detail {

void write_task_trailer(Writer& w, std::size_t count, const MessageLoan& loan) {
  w.write(static_cast<std::uint64_t>(count));
  for (const auto& storage : loan.storages()) w.write(storage->id());
  w.write(static_cast<std::uint32_t>(loan.storages().size()));
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
  std::size_t trailer = sizeof(std::uint64_t) + std::size_t{lent} * sizeof(std::uint64_t) + sizeof lent;
  if (trailer > payload.size() - kHeader)
    throw ProtocolError("forkpool: a task message claims " + std::to_string(lent) + " lent storages in " +
                        std::to_string(payload.size()) + " bytes");
  std::size_t body_end = payload.size() - trailer;
  std::uint64_t count = 0;
  std::memcpy(&count, payload.data() + body_end, sizeof count);
  std::vector<std::uint64_t> lent_ids(lent);
  if (lent > 0) std::memcpy(lent_ids.data(), payload.data() + body_end + sizeof count, lent * sizeof(std::uint64_t));

  std::size_t taken = borrowed.begin_message(lent_ids, task.fds);
  Reader header(payload.first(kHeader));
  auto invoker = reinterpret_cast<Invoker>(static_cast<std::uintptr_t>(header.read<std::uint64_t>()));
  auto function = static_cast<std::uintptr_t>(header.read<std::uint64_t>());
  return {invoker, function, static_cast<std::size_t>(count),
          Reader(payload.subspan(kHeader, body_end - kHeader), std::span(task.fds).subspan(taken), &borrowed)};
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
