#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>

namespace forkpool {

enum class StartMethod {
  fork,        // each worker is forked from the parent
  forkserver,  // workers are forked from a fork server: the program's own (forkpool::init()), or
               // one forked when the pool is made
  spawn,       // each worker is a fresh run of the program's executable (forkpool::init())
};

// PoolOptions::initializer: a std::function<void()> that also remembers, when it is made from a
// function pointer or a lambda without captures, a plain function doing the same. A spawned
// worker (a fresh run of the program) can call only that: captured state does not exist there.
//   PoolOptions{.initializer = [] { seed_rng(); }}         // plain: every start method
//   PoolOptions{.initializer = [&config] { use(config); }} // fork and forkserver only
// A plain function with bytes to call it with (Python's initializer and initargs) crosses to a
// spawned worker too: the function by its address, the bytes beside it.
//   PoolOptions{.initializer = Initializer::with_bytes(+[](std::string_view s) { use(s); }, config)}
class Initializer : public std::function<void()> {
 public:
  Initializer() = default;
  Initializer(std::nullptr_t) {}
  template <class F>
  requires(std::is_invocable_v<F&> && !std::is_same_v<std::decay_t<F>, Initializer>) Initializer(F f)
      : std::function<void()>(f), plain_(plain_function_of(f)) {}

  // Calls `function(bytes)`; every start method can run it.
  static Initializer with_bytes(void (*function)(std::string_view), std::string bytes) {
    Initializer initializer;
    initializer.std::function<void()>::operator=([function, bytes] { function(bytes); });
    initializer.with_bytes_ = function;
    initializer.bytes_ = std::move(bytes);
    return initializer;
  }

  // The plain function, or null when this holds state (or nothing, or is with_bytes()'s).
  void (*plain() const)() { return plain_; }
  // with_bytes()'s function and bytes (null and empty otherwise).
  void (*plain_with_bytes() const)(std::string_view) { return with_bytes_; }
  const std::string& bytes() const { return bytes_; }

 private:
  template <class F>
  static void call_empty() {
    F{}();
  }
  template <class F>
  static auto plain_function_of(const F& f) -> void (*)() {
    if constexpr (std::is_same_v<F, std::function<void()>>) {
      auto* pointer = f.template target<void (*)()>();
      return pointer ? *pointer : nullptr;
    } else if constexpr (std::is_convertible_v<F, void (*)()>) {
      return f;  // a function pointer, or a lambda without captures returning void
    } else if constexpr (std::is_class_v<F> && std::is_empty_v<F> && std::is_default_constructible_v<F>) {
      return &call_empty<F>;
    } else {
      return nullptr;
    }
  }
  void (*plain_)() = nullptr;
  void (*with_bytes_)(std::string_view) = nullptr;
  std::string bytes_;
};

// Fields stay in this order: callers use designated initializers.
struct PoolOptions {
  int processes = 0;             // 0: one per online CPU
  int maxtasksperchild = 0;      // 0: a worker lives for ever; N: replaced after N tasks
  Initializer initializer = {};  // runs once in each worker before its first task
  StartMethod start_method = StartMethod::forkserver;
  int max_retries = 0;  // a task whose worker died is run again up to N times
  // 0: none. A task (a chunk, for maps) still running this long after its worker started it is
  // stopped (the worker is killed and replaced) and fails with TimeoutError; it is not retried.
  std::chrono::nanoseconds task_timeout = {};
  std::uint64_t seed = 0;  // base of every worker's seed (worker_info()); 0: random
  // How long the parent and a worker poll for the other's next message before sleeping in the
  // kernel (a wake-up across CPUs costs ~25 µs on VMs; a polled message ~0.1 µs). Empty:
  // adaptive, up to 50 µs, only while a message is expected, less when waits are long or the
  // machine is oversubscribed. Zero: never poll (shared machines: no CPU spent waiting).
  std::optional<std::chrono::nanoseconds> spin = {};
};

}  // namespace forkpool
