#include <forkpool/runtime/async_result.hpp>

#include <cstdio>

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

}  // namespace forkpool::detail
