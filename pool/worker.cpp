#include <forkpool/pool/internal/worker.hpp>

#include <cstdio>
#include <exception>
#include <string>

#include <forkpool/ipc/internal/channel.hpp>
#include <forkpool/pool/internal/loans.hpp>
#include <forkpool/runtime/internal/describe_exception.hpp>
#include <forkpool/runtime/error.hpp>
#include <forkpool/runtime/internal/process.hpp>
#include <forkpool/pool/internal/task_message.hpp>

namespace forkpool::detail {
namespace {

// Throws ProtocolError when the message's lent storages are not valid: the conversation is broken.
void serve_task(Channel& channel, Message& task, BorrowedStorages& borrowed) {
  TaskCall call = read_task(task, borrowed);
  Writer out(&borrowed);  // a result may be a storage the task lent: it goes back by id
  try {
    call.invoker(call.function, call.count, call.arguments, out);
  } catch (...) {
    auto [type, message] = describe_current_exception();
    Writer error = encode(std::pair<std::string, std::string>(type, message));
    channel.send(kErrorMessage, task.request_id, error.bytes());
    return;
  }
  channel.send(kResultMessage, task.request_id, out.bytes(), out.fds());
}

}  // namespace

void worker_main(const WorkerSpec& spec, int index, pid_t parent, UniqueFd channel_fd) noexcept {
  int fd = become_helper_process("forkpool-worker-" + std::to_string(index), parent, channel_fd.release());
  Channel channel{UniqueFd(fd)};
  if (spec.initializer) {
    try {
      spec.initializer();
    } catch (...) {
      auto [type, message] = describe_current_exception();
      std::fprintf(stderr, "forkpool: worker %d: initializer threw %s: %s\n", index, type.c_str(), message.c_str());
      exit_helper(kExitInitializerFailed);
    }
  }
  int served = 0;
  BorrowedStorages borrowed;  // storages the parent lent, mapped until it releases them
  try {
    for (;;) {
      Message message = channel.receive();
      if (message.kind == kReleaseMessage) {
        borrowed.release(decode<std::vector<std::uint64_t>>(message.payload.bytes()));
        continue;
      }
      if (message.kind != kTaskMessage)
        throw ProtocolError("forkpool: the parent sent a message of unknown kind " + std::to_string(message.kind));
      // Everything the task made is destroyed before the next one starts.
      serve_task(channel, message, borrowed);
      if (spec.maxtasksperchild > 0 && ++served >= spec.maxtasksperchild) break;
    }
  } catch (const ChannelClosed&) {
    // The pool closed our channel: done.
  } catch (const std::exception& e) {
    std::fprintf(stderr, "forkpool: worker %d: %s\n", index, e.what());
    exit_helper(kExitBadMessage);
  }
  exit_helper(0);
}

}  // namespace forkpool::detail
