#include <forkpool/runtime/private/errno.hpp>

#include <system_error>

namespace forkpool::detail {

void throw_errno(int error, const char* what) { throw std::system_error(error, std::generic_category(), what); }

}  // namespace forkpool::detail
