#pragma once
// Exceptions as text, for reporting them across a process boundary or on stderr.

#include <exception>
#include <string>
#include <utility>

namespace forkpool::detail {

// The readable, demangled name of a mangled type name.
std::string demangle(const char* mangled);
// The readable type name and the message (what(), or empty) of the exception being handled.
// A DescribedException gives its own type name and message.
std::pair<std::string, std::string> describe_current_exception();

// Another exception as (type name, message), with context added to the message: thrown where a
// worker says more about what failed (the DataLoader, which sample), so that the parent's
// RemoteError still names the type that was thrown.
class DescribedException : public std::exception {
 public:
  DescribedException(std::string type_name, std::string message)
      : type_name_(std::move(type_name)), message_(std::move(message)) {}
  const char* what() const noexcept override { return message_.c_str(); }
  const std::string& type_name() const noexcept { return type_name_; }

 private:
  std::string type_name_, message_;
};

}  // namespace forkpool::detail
