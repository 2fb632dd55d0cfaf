#pragma once
// Descriptors that forkpool's helper processes (workers, the fork server) keep open at the same
// numbers, for facilities that span a whole process tree (the /dev/shm name tracker).

#include <vector>

namespace forkpool::detail {

void keep_in_helpers(int fd);
std::vector<int> kept_in_helpers();

}  // namespace forkpool::detail
