#pragma once
// The worker side of a pool: a forked process that runs tasks until its channel closes.

#include <sys/types.h>

#include <string>

#include <forkpool/worker/start_method.hpp>
#include <forkpool/runtime/private/loaded_objects.hpp>
#include <forkpool/runtime/unique_fd.hpp>

namespace forkpool::detail {

struct WorkerSpec {
  int maxtasksperchild = 0;
  Initializer initializer;
  // Non-empty: the worker is a Process (start_process), named so; an exception escaping its task
  // is printed (type and message) and ends it with exit code 1, as Python's.
  std::string process_name;
};

// How a worker came to be: forked from the parent or a fork server (it has their libraries'
// state, without their threads), or spawned (a fresh run of the program).
enum class WorkerStart { forked, spawned };

// Runs in a freshly forked (or spawned) process: sets it up (a forked one runs OpenMP on one
// thread), runs the initializer, then serves tasks from `channel` until it closes (or
// maxtasksperchild is reached). `objects` translates the parent's code addresses where this
// process does not have them at the same place. Never returns.
[[noreturn]] void worker_main(const WorkerSpec& spec, WorkerStart start, int index, pid_t parent, UniqueFd channel,
                              ObjectTranslation objects = {}) noexcept;

}  // namespace forkpool::detail
