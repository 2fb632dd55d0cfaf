#pragma once
// show_progress(result, label): draws a map's progress on stderr until it is ready. On a
// terminal, one line redrawn in place (a bar, done/total, items per second, time left);
// otherwise a line at every 10%. Run it beside the work with when_all: it ends when the result is
// ready, and also when the tasks beside it have ended or one of them failed (a consumer that
// stopped early). Resumes on the result's loop; `result` must outlive it.
//
//   auto squares = pool.map_async(square, inputs);
//   co_await fp::show_progress(squares, "squares");

#include <string>

#include <forkpool/runtime/async_result.hpp>
#include <forkpool/runtime/internal/progress_line.hpp>
#include <forkpool/runtime/task.hpp>

namespace forkpool {

template <class R>
Task<void> show_progress(const AsyncResult<R>& result, std::string label = {}) {
  detail::ProgressLine line(std::move(label));
  // NOLINTNEXTLINE(bugprone-use-after-move): clang-tidy 14 takes a co_await for a use of `label`
  const detail::Company* company = co_await detail::current_company{};
  while (!co_await result.async_wait(line.interval())) {
    if (company && company->work_over()) break;
    line.draw(result.progress());
  }
  line.finish(result.progress());
}

}  // namespace forkpool
