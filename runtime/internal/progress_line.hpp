#pragma once
// ProgressLine: how show_progress draws on stderr. On a terminal, one line redrawn in place
// (label, bar, done/total, items per second, time left); otherwise a line at every 10%.

#include <chrono>
#include <string>

#include <forkpool/runtime/async_result.hpp>

namespace forkpool::detail {

class ProgressLine {
 public:
  explicit ProgressLine(std::string label);
  // How often to call draw().
  std::chrono::milliseconds interval() const noexcept;
  void draw(const Progress& progress);
  // The last state: on a terminal, drawn and ended with a newline.
  void finish(const Progress& progress);

 private:
  std::string label_;
  bool terminal_;
  std::chrono::steady_clock::time_point started_;
  int tenths_printed_ = 0;
};

}  // namespace forkpool::detail
