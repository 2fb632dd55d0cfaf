#pragma once
// How tensors' storage is shared between processes (as torch.multiprocessing):
//   file_descriptor (default): a sealed memfd, sent with SCM_RIGHTS;
//   file_system: a named segment under /dev/shm, sent by name.
// The strategy in force when a storage is made decides its kind.

#include <vector>

namespace forkpool {

enum class SharingStrategy { file_descriptor, file_system };

void set_sharing_strategy(SharingStrategy strategy);
SharingStrategy get_sharing_strategy();
std::vector<SharingStrategy> get_all_sharing_strategies();

}  // namespace forkpool
