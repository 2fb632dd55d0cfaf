#include <forkpool/runtime/async_result.hpp>

#include <cstdio>

#include <forkpool/runtime/private/describe_exception.hpp>

namespace forkpool::detail {

void report_callback_failure() noexcept {
  try {
    auto [type, message] = describe_current_exception();
    std::fprintf(stderr, "forkpool: a done-callback threw %s: %s\n", type.c_str(), message.c_str());
  } catch (...) {
    std::fputs("forkpool: a done-callback threw\n", stderr);
  }
}

}  // namespace forkpool::detail
