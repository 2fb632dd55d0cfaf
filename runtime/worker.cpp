#include "runtime/worker.hpp"

#include <cxxabi.h>

#include <cstdio>
#include <exception>
#include <string>
#include <typeinfo>

#include "ipc/channel.hpp"
#include "runtime/error.hpp"
#include "runtime/process.hpp"
#include "runtime/wire.hpp"

namespace forkpool::detail {
namespace {

// The readable type name and message of the exception being handled.
std::pair<std::string, std::string> describe_current_exception() {
  std::type_info* type = abi::__cxa_current_exception_type();
  std::string name = type ? demangle(type->name()) : "unknown";
  try {
    throw;
  } catch (const std::exception& e) {
    return {name, e.what()};
  } catch (...) {
    return {name, ""};
  }
}

// Throws ProtocolError when the message's lent storages are not valid: the conversation is broken.
void serve_task(Channel& channel, Message& task, BorrowedStorages& borrowed) {
  TaskParts parts = split_task(task.payload.bytes());
  std::size_t lent_fds = borrowed.begin_message(parts.lent_ids, task.fds);
  Writer out(&borrowed);  // a result may be a storage the task lent: it goes back by id
  try {
    Reader in(parts.body, std::span(task.fds).subspan(lent_fds), &borrowed);
    auto invoker = reinterpret_cast<Invoker>(static_cast<std::uintptr_t>(in.read<std::uint64_t>()));
    auto function = static_cast<std::uintptr_t>(in.read<std::uint64_t>());
    invoker(function, in, out);
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
