#include <forkpool/runtime/async_result.hpp>

#include <cstdio>
#include <stdexcept>
#include <string>

#include <forkpool/runtime/private/describe_exception.hpp>

namespace forkpool::detail {

void report_callback_failure(const char* whose) noexcept {
  try {
    auto [type, message] = describe_current_exception();
    std::fprintf(stderr, "forkpool: %s threw %s: %s\n", whose, type.c_str(), message.c_str());
  } catch (...) {
    std::fprintf(stderr, "forkpool: %s threw\n", whose);
  }
}

void check_waiter(const Canceller& owner, const char* who) {
  try {
    owner.check_cancel();
  } catch (const std::logic_error&) {
    throw std::logic_error(std::string("forkpool: ") + who +
                           " called on another thread (or process) than its pool's, before the result is ready: "
                           "only the loop of the thread that made the pool completes it; wait there, or hand the "
                           "wait to that thread with Loop::post (a ready result may be read anywhere)");
  }
}

}  // namespace forkpool::detail
