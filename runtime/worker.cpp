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

void serve_task(Channel& channel, Message& task) {
  Writer out;
  try {
    Reader in = task.reader();
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
  try {
    for (;;) {
      Message task = channel.receive();
      // Everything the task made is destroyed before the next one starts.
      serve_task(channel, task);
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
