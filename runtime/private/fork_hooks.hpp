#pragma once
// What a host runtime must do around each fork() forkpool makes (a worker, a fork server, a
// helper): an embedding interpreter (the Python package) takes its lock and readies its state
// before, and repairs it after, as its own fork does. One set of hooks per process, set once
// before the first pool; any thread. Each hook runs on the forking thread; `child` in the new
// process, before anything of forkpool's runs there.
//
//   detail::set_fork_hooks({.prepare = take_interpreter, .parent = give_back, .child = reinit});

namespace forkpool::detail {

struct ForkHooks {
  void (*prepare)() noexcept = nullptr;
  void (*parent)() noexcept = nullptr;
  void (*child)() noexcept = nullptr;
};

void set_fork_hooks(ForkHooks hooks) noexcept;

}  // namespace forkpool::detail
