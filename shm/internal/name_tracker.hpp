#pragma once
// The /dev/shm name tracker: a small helper process, one per process tree, that unlinks forkpool
// segments nobody holds any more, even when their holders were SIGKILLed (torch leaks segments
// there). Each process says which names it holds and lets go of; the tracker watches every
// holder's pidfd. When the last holder of a name dies, the name is unlinked after a short grace
// (a message carrying it may still be on its way to a live process, which then registers);
// when the whole tree is gone (its pipe reaches end-of-file), every name left is unlinked.

#include <string>

namespace forkpool::detail {

// The path of segment `name` (a name without slashes) under /dev/shm.
inline std::string segment_path(const std::string& name) { return "/dev/shm/" + name; }

// This process holds / no longer holds `name`. Starts the tracker on first use; workers
// inherit their parent's.
void track_segment_name(const std::string& name);
void untrack_segment_name(const std::string& name);

}  // namespace forkpool::detail
