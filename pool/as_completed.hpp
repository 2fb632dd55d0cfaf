#pragma once
// as_completed(results): a Stream of the indices of `results`, each once, in the order the
// results become ready (concurrent.futures.as_completed, by index).
//
// Call it, and take from the stream, on the thread of the pool(s) that made the results (elsewhere
// std::logic_error); next()'s awaiter resumes inside the loop's turn that completed the result it
// names.
//
//   std::vector<fp::AsyncResult<int>> results = ...;
//   fp::Stream<std::size_t> done = fp::as_completed(results);
//   while (auto i = co_await done.next()) use(results[*i].get());

#include <algorithm>
#include <cstddef>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <forkpool/pool/internal/stream_state.hpp>
#include <forkpool/pool/stream.hpp>
#include <forkpool/runtime/async_result.hpp>

namespace forkpool {
namespace detail {

// Every index is "submitted" at once as a chunk of one; a done-callback delivers it.
class CompletionOrder final : public StreamState<std::size_t> {
 public:
  explicit CompletionOrder(std::size_t count)
      : StreamState<std::size_t>(false, std::max<std::size_t>(count, 1)), count_(count) {}
  void completed(std::size_t index) { deliver(index, index); }
  // The results' callbacks deliver on the thread that made it.
  void check_consumer(const char* who) const override {
    if (std::this_thread::get_id() != owner_)
      throw std::logic_error(std::string("forkpool: ") + who +
                             " of as_completed called from another thread: its results arrive on the thread "
                             "that called as_completed; take them there, or hand the call to it with Loop::post");
  }

 private:
  bool submit_chunk(std::size_t index) override {
    if (index >= count_) return false;
    record_chunk_size(index, 1);
    return true;
  }
  std::size_t count_;
  std::thread::id owner_ = std::this_thread::get_id();
};

}  // namespace detail

template <class R>
Stream<std::size_t> as_completed(std::vector<AsyncResult<R>>& results) {
  auto order = std::make_shared<detail::CompletionOrder>(results.size());
  order->start();
  for (std::size_t i = 0; i < results.size(); ++i)
    results[i].add_done_callback([order, i](AsyncResult<R>&) { order->completed(i); });
  return Stream<std::size_t>(order);
}

}  // namespace forkpool
