#pragma once
// Stream<R>: results that arrive one by one (Pool::imap, imap_unordered). co_await next() gives
// the next result, or an empty optional at the end. The input is read lazily, with a bounded
// number of chunks in flight, so an endless input works and memory stays flat.
//
// A Stream is used on the thread of the pool that made it; next()'s awaiter resumes inside the
// loop's turn that received the result it returns.

#include <memory>
#include <optional>

#include <forkpool/pool/internal/stream_state.hpp>
#include <forkpool/runtime/task.hpp>

namespace forkpool {

template <class R>
class Stream {
 public:
  explicit Stream(std::shared_ptr<detail::StreamState<R>> state) : state_(std::move(state)) {}

  // The next result (in input order for imap, as finished for imap_unordered); empty at the
  // end. A task that threw rethrows here, at its place; the stream goes on after it.
  Task<std::optional<R>> next() { return detail::StreamState<R>::next(state_); }

 private:
  std::shared_ptr<detail::StreamState<R>> state_;
};

}  // namespace forkpool
