#pragma once
// System call failures as exceptions.

#include <cerrno>

namespace forkpool::detail {

// Throws std::system_error for errno value `error` (positive), naming what failed.
[[noreturn]] void throw_errno(int error, const char* what);
[[noreturn]] inline void throw_last_errno(const char* what) { throw_errno(errno, what); }

}  // namespace forkpool::detail
