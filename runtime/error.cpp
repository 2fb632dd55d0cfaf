#include "runtime/error.hpp"

#include <cxxabi.h>
#include <string.h>

#include <cstdlib>
#include <memory>
#include <system_error>

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
  return signal ? "killed by " + signal_name_of(signal) : "exited with code " + std::to_string(exit_code);
}

}  // namespace

RemoteError::RemoteError(std::string type_name, const std::string& message, pid_t worker_pid)
    : Error(message), type_name_(std::move(type_name)), worker_pid_(worker_pid) {}

WorkerLost::WorkerLost(pid_t pid, int exit_code, int signal)
    : Error("forkpool: worker " + std::to_string(pid) + " died while running the task (" +
            describe_end(exit_code, signal) + ")"),
      pid_(pid), exit_code_(exit_code), signal_(signal) {}

ProcessRaisedException::ProcessRaisedException(int rank, pid_t pid, std::string type_name,
                                               const std::string& message)
    : Error("forkpool: process " + std::to_string(rank) + " (pid " + std::to_string(pid) +
            ") raised " + type_name + ": " + message),
      rank_(rank), pid_(pid), type_name_(std::move(type_name)) {}

ProcessExitedException::ProcessExitedException(int rank, pid_t pid, int exit_code, int signal)
    : Error("forkpool: process " + std::to_string(rank) + " (pid " + std::to_string(pid) + ") " +
            describe_end(exit_code, signal)),
      rank_(rank), pid_(pid), exit_code_(exit_code), signal_(signal) {}

std::string ProcessExitedException::signal_name() const {
  return signal_ ? signal_name_of(signal_) : std::string();
}

void throw_errno(int error, const char* what) {
  throw std::system_error(error, std::generic_category(), what);
}

std::string demangle(const char* mangled) {
  int status = 0;
  std::unique_ptr<char, decltype(&std::free)> readable(
      abi::__cxa_demangle(mangled, nullptr, nullptr, &status), &std::free);
  return status == 0 && readable ? std::string(readable.get()) : std::string(mangled);
}

}  // namespace forkpool
