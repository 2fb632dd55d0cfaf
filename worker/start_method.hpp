#pragma once
// How a pool's workers come to be (StartMethod), and what each runs first (Initializer).

#include <cstddef>
#include <functional>
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

}  // namespace forkpool
