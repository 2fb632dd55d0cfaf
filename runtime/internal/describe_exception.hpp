#pragma once
// Exceptions as text, for reporting them across a process boundary or on stderr.

#include <string>
#include <utility>

namespace forkpool::detail {

// The readable, demangled name of a mangled type name.
std::string demangle(const char* mangled);
// The readable type name and the message (what(), or empty) of the exception being handled.
std::pair<std::string, std::string> describe_current_exception();

}  // namespace forkpool::detail
