#pragma once
// The exceptions forkpool's public API throws (docs/pool.md, "Errors"). All derive from Error.

#include <sys/types.h>

#include <stdexcept>
#include <string>

namespace forkpool {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

namespace detail {
// What RemoteError and InitializerError share: an exception raised in a worker, as text.
class RaisedInWorker : public Error {
 public:
  const std::string& type_name() const noexcept { return type_name_; }
  const std::string& message() const noexcept { return message_; }
  pid_t worker_pid() const noexcept { return worker_pid_; }

 protected:
  RaisedInWorker(const std::string& what, const std::string& type_name, const std::string& message, pid_t worker_pid)
      : Error(what), type_name_(type_name), message_(message), worker_pid_(worker_pid) {}

 private:
  std::string type_name_;
  std::string message_;
  pid_t worker_pid_;
};
}  // namespace detail

// The task threw in the worker. what() says all three: "forkpool: worker 123 raised
// std::runtime_error: bad input"; message() is the remote what() alone.
class RemoteError : public detail::RaisedInWorker {
 public:
  RemoteError(const std::string& type_name, const std::string& message, pid_t worker_pid);
};

// The pool's initializer threw in a worker: its type and message, as RemoteError gives them.
class InitializerError : public detail::RaisedInWorker {
 public:
  InitializerError(const std::string& type_name, const std::string& message, pid_t worker_pid);
};

// The worker running the task died. Exactly one of exit_code() and signal() is meaningful:
// signal() is 0 when the worker exited, exit_code() is -1 when it was killed by a signal.
class WorkerLost : public Error {
 public:
  WorkerLost(pid_t pid, int exit_code, int signal);
  // What the worker ran, named in the message instead of "the task" ("batch 3 of the epoch").
  WorkerLost(pid_t pid, int exit_code, int signal, const std::string& running);
  pid_t pid() const noexcept { return pid_; }
  int exit_code() const noexcept { return exit_code_; }
  int signal() const noexcept { return signal_; }

 private:
  pid_t pid_;
  int exit_code_;
  int signal_;
};

class PoolClosed : public Error {
 public:
  PoolClosed() : Error("forkpool: work was given to a pool after close() or terminate()") {}
};

class PoolTerminated : public Error {
 public:
  PoolTerminated() : Error("forkpool: the work was pending when terminate() ran") {}
};

class TimeoutError : public Error {
 public:
  using Error::Error;
};

// AsyncResult::cancel() stopped the task.
class Cancelled : public Error {
 public:
  Cancelled() : Error("forkpool: the task was cancelled") {}
};

// A message or descriptor that came from another process failed validation.
class ProtocolError : public Error {
 public:
  using Error::Error;
};

// One of the processes started by spawn()/start_processes() threw.
class ProcessRaisedException : public Error {
 public:
  ProcessRaisedException(int rank, pid_t pid, std::string type_name, const std::string& message);
  int rank() const noexcept { return rank_; }
  pid_t pid() const noexcept { return pid_; }
  const std::string& type_name() const noexcept { return type_name_; }

 private:
  int rank_;
  pid_t pid_;
  std::string type_name_;
};

// One of the processes started by spawn()/start_processes() exited non-zero or was killed.
class ProcessExitedException : public Error {
 public:
  ProcessExitedException(int rank, pid_t pid, int exit_code, int signal);
  int rank() const noexcept { return rank_; }
  pid_t pid() const noexcept { return pid_; }
  int exit_code() const noexcept { return exit_code_; }
  int signal() const noexcept { return signal_; }
  // "SIGKILL" and the like; empty when the process exited.
  std::string signal_name() const;

 private:
  int rank_;
  pid_t pid_;
  int exit_code_;
  int signal_;
};

}  // namespace forkpool
