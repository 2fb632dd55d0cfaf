#pragma once
// SharedHandle<T, "Lock">: the shared state behind a public handle (Lock, Queue, Stream,
// AsyncResult...). Copies share it; a move leaves the source empty. Every use of an empty
// handle is std::logic_error naming the public type, as a moved-from std::future throws
// future_error(no_state): a handle used after `auto kept = std::move(handle)` is a bug the
// caller can catch, never a null dereference.

#include <algorithm>
#include <cstddef>
#include <memory>
#include <utility>

namespace forkpool::detail {

// The public type's name, as a template argument: SharedHandle<SharedPage, "Lock">.
template <std::size_t N>
struct HandleName {
  constexpr HandleName(const char (&text)[N]) { std::copy_n(text, N, name); }
  char name[N];
};

// std::logic_error: "forkpool: a <type> used after it was moved from".
[[noreturn]] void throw_moved_from(const char* type);

template <class T, HandleName Name>
class SharedHandle {
 public:
  explicit SharedHandle(std::shared_ptr<T> state) noexcept : state_(std::move(state)) {}

  T& operator*() const {
    if (!state_) throw_moved_from(Name.name);
    return *state_;
  }
  T* operator->() const { return &**this; }
  // The state itself, to keep it alive past this handle (a coroutine's frame, a callback).
  const std::shared_ptr<T>& shared() const {
    (void)**this;
    return state_;
  }
  // Only for a taking move out (`co_await std::move(result)`); checked as every use is.
  std::shared_ptr<T> take() {
    (void)**this;
    return std::move(state_);
  }

 private:
  std::shared_ptr<T> state_;
};

}  // namespace forkpool::detail
