#pragma once
// ProgressLine: how show_progress draws on stderr. On a terminal, one line redrawn in place
// (label, bar, done/total, items per second, time left); otherwise a line at every 10% (every
// few seconds while the total is unknown), each with the counts of that moment, and a last line
// for the state the work ended in.

#include <chrono>
#include <optional>
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
  // percent < 0: a line of counts alone (the total unknown, or the work ended between tenths).
  // `rate`: items a second, of the work as a whole up to now (0: not known yet).
  void print_line(const Progress& progress, int percent, double rate);

  std::string label_;
  bool terminal_;
  std::chrono::steady_clock::time_point started_;
  std::chrono::steady_clock::time_point last_line_;
  int tenths_printed_ = 0;
  std::optional<std::size_t> done_printed_;  // the count the last line showed
};

}  // namespace forkpool::detail
