#include <forkpool/runtime/internal/progress_line.hpp>

#include <unistd.h>

#include <cstdio>
#include <cmath>
#include <string>

namespace forkpool::detail {
namespace {

// Before this much time has passed a rate says nothing (2 items in 3 µs is not 750,000 a second).
constexpr std::chrono::milliseconds kRateAfter{200};

// Items a second since `since`; 0 (shown as "?") before kRateAfter.
double items_per_second(std::size_t done, std::chrono::steady_clock::time_point since) {
  auto elapsed = std::chrono::steady_clock::now() - since;
  if (elapsed < kRateAfter) return 0.0;
  return static_cast<double>(done) / std::chrono::duration<double>(elapsed).count();
}

// The rate as shown: "?" while it is not known yet.
std::string rate_text(double rate) { return rate > 0 ? std::to_string(std::llround(rate)) : "?"; }

// Without a total there are no tenths: a line this often instead.
constexpr std::chrono::seconds kUnknownTotalEvery{5};

}  // namespace

ProgressLine::ProgressLine(std::string label)
    : label_(label.empty() ? "progress" : std::move(label)),
      terminal_(isatty(STDERR_FILENO) == 1),
      started_(std::chrono::steady_clock::now()),
      last_line_(started_) {}

std::chrono::milliseconds ProgressLine::interval() const noexcept {
  return terminal_ ? std::chrono::milliseconds(100) : std::chrono::milliseconds(250);
}

void ProgressLine::draw(const Progress& progress) {
  double rate = items_per_second(progress.done, started_);
  if (terminal_) {
    constexpr int kWidth = 24;
    std::string bar(kWidth, ' ');
    std::string total = progress.total ? std::to_string(*progress.total) : "?";
    if (progress.total && *progress.total > 0) {
      auto filled = static_cast<int>(kWidth * progress.done / *progress.total);
      bar.replace(0, static_cast<std::size_t>(filled), static_cast<std::size_t>(filled), '#');
    }
    std::string left = "?";
    if (progress.total && rate > 0) {
      auto seconds = static_cast<long>(static_cast<double>(*progress.total - progress.done) / rate);
      left = std::to_string(seconds / 60) + ":" + (seconds % 60 < 10 ? "0" : "") + std::to_string(seconds % 60);
    }
    std::fprintf(stderr, "\r\033[K%s [%s] %zu/%s  %s/s  left %s", label_.c_str(), bar.c_str(), progress.done,
                 total.c_str(), rate_text(rate).c_str(), left.c_str());
    std::fflush(stderr);
    return;
  }
  if (!progress.total) {
    if (std::chrono::steady_clock::now() - last_line_ >= kUnknownTotalEvery) print_line(progress, -1, rate);
    return;
  }
  if (*progress.total == 0) return;
  // A line for each tenth reached, as promised, also when several passed since the last draw:
  // each with the count that reached it (the last with the count of now), and the rate of now
  // (that count over the time of now would understate it).
  auto reached = static_cast<int>(10 * progress.done / *progress.total);
  while (tenths_printed_ < reached) {
    ++tenths_printed_;
    Progress at = progress;
    if (tenths_printed_ < reached)  // the first count that is this tenth
      at.done = (*progress.total * static_cast<std::size_t>(tenths_printed_) + 9) / 10;
    print_line(at, 10 * tenths_printed_, rate);
  }
}

void ProgressLine::print_line(const Progress& progress, int percent, double rate) {
  if (percent >= 0) {
    std::fprintf(stderr, "%s: %d%% (%zu/%zu items, %s items/s)\n", label_.c_str(), percent, progress.done,
                 *progress.total, rate_text(rate).c_str());
  } else if (progress.total) {
    std::fprintf(stderr, "%s: ended at %zu/%zu items (%s items/s)\n", label_.c_str(), progress.done, *progress.total,
                 rate_text(rate).c_str());
  } else {
    std::fprintf(stderr, "%s: %zu items (%s items/s)\n", label_.c_str(), progress.done, rate_text(rate).c_str());
  }
  last_line_ = std::chrono::steady_clock::now();
  done_printed_ = progress.done;
}

void ProgressLine::finish(const Progress& progress) {
  draw(progress);
  if (terminal_) {
    std::fputc('\n', stderr);
  } else if (done_printed_ != progress.done) {
    print_line(progress, -1, items_per_second(progress.done, started_));  // ended between tenths, or early
  }
}

}  // namespace forkpool::detail
