#include <forkpool/runtime/error.hpp>
#include <forkpool/runtime/internal/shared_handle.hpp>

#include <string.h>

#include <string_view>

namespace forkpool {
namespace {

std::string signal_name_of(int signal) {
  std::string name;
  if (const char* abbrev = sigabbrev_np(signal)) {
    name = "SIG";
    name += abbrev;
  } else {
    name = "signal " + std::to_string(signal);
  }
  return name;
}

std::string describe_end(int exit_code, int signal) {
  if (signal) return "killed by " + signal_name_of(signal);
  if (exit_code < 0) return "how it ended is unknown";  // reaped by someone else, or its server died
  return "exited with code " + std::to_string(exit_code);
}

}  // namespace

RemoteError::RemoteError(const std::string& type_name, const std::string& message, pid_t worker_pid)
    : RaisedInWorker("forkpool: worker " + std::to_string(worker_pid) + " raised " + type_name + ": " + message,
                     type_name, message, worker_pid) {}

InitializerError::InitializerError(const std::string& type_name, const std::string& message, pid_t worker_pid)
    : RaisedInWorker("forkpool: the pool's initializer raised " + type_name + ": " + message + " (in worker " +
                         std::to_string(worker_pid) + ")",
                     type_name, message, worker_pid) {}

WorkerLost::WorkerLost(pid_t pid, int exit_code, int signal) : WorkerLost(pid, exit_code, signal, "the task") {}

WorkerLost::WorkerLost(pid_t pid, int exit_code, int signal, const std::string& running)
    : Error("forkpool: worker " + std::to_string(pid) + " died while running " + running + " (" +
            describe_end(exit_code, signal) + ")"),
      pid_(pid),
      exit_code_(exit_code),
      signal_(signal) {}

ProcessRaisedException::ProcessRaisedException(int rank, pid_t pid, std::string type_name, const std::string& message)
    : Error("forkpool: process " + std::to_string(rank) + " (pid " + std::to_string(pid) + ") raised " + type_name +
            ": " + message),
      rank_(rank),
      pid_(pid),
      type_name_(std::move(type_name)) {}

ProcessExitedException::ProcessExitedException(int rank, pid_t pid, int exit_code, int signal)
    : Error("forkpool: process " + std::to_string(rank) + " (pid " + std::to_string(pid) + ") " +
            describe_end(exit_code, signal)),
      rank_(rank),
      pid_(pid),
      exit_code_(exit_code),
      signal_(signal) {}

std::string ProcessExitedException::signal_name() const { return signal_ ? signal_name_of(signal_) : std::string(); }

namespace detail {

void throw_moved_from(const char* type) {
  const bool vowel = std::string_view("AEIOU").find(type[0]) != std::string_view::npos;
  throw std::logic_error(std::string(vowel ? "forkpool: an " : "forkpool: a ") + type +
                         " used after it was moved from: it holds nothing");
}

}  // namespace detail
}  // namespace forkpool
