#include <forkpool/runtime/private/describe_exception.hpp>

#include <cxxabi.h>

#include <cstdlib>
#include <exception>
#include <memory>
#include <typeinfo>

namespace forkpool::detail {

std::string demangle(const char* mangled) {
  int status = 0;
  std::unique_ptr<char, decltype(&std::free)> readable(abi::__cxa_demangle(mangled, nullptr, nullptr, &status),
                                                       &std::free);
  return status == 0 && readable ? std::string(readable.get()) : std::string(mangled);
}

std::pair<std::string, std::string> describe_current_exception() {
  std::type_info* type = abi::__cxa_current_exception_type();
  std::string name = type ? demangle(type->name()) : "unknown";
  try {
    throw;
  } catch (const DescribedException& e) {
    return {e.type_name(), e.what()};
  } catch (const std::exception& e) {
    return {name, e.what()};
  } catch (...) {
    return {name, ""};
  }
}

}  // namespace forkpool::detail
