#pragma once
// The /dev/shm name tracker: a small helper process, one per process tree, that unlinks forkpool
// segments nobody holds any more, even when their holders were SIGKILLed (torch leaks segments
// there). Each process says which names it holds and lets go of; the tracker watches every
// holder's pidfd. When the last holder of a name dies, the name is unlinked after a short grace
// (a message carrying it may still be on its way to a live process, which then registers);
// when the whole tree is gone (its socket reaches end-of-file), every name left is unlinked.
// Messages are datagrams and the sender's pid is the kernel's (SCM_CREDENTIALS): junk a task
// writes to the socket is dropped and spoils nobody else's message.

#include <string>
#include <string_view>

#include <forkpool/runtime/unique_fd.hpp>

namespace forkpool::detail {

// Every forkpool segment's name starts with this.
inline constexpr std::string_view kSegmentPrefix = "forkpool-";

// Whether `name` can be one of ours: the prefix, no slash, not absurdly long.
inline bool is_segment_name(std::string_view name) {
  return name.starts_with(kSegmentPrefix) && name.find('/') == std::string_view::npos && name.size() <= 200;
}

// The path of segment `name` (a name without slashes) under /dev/shm.
inline std::string segment_path(const std::string& name) { return "/dev/shm/" + name; }

// Starts this process tree's tracker if it has none yet. A pool calls it before it forks, so
// that its workers use their parent's tracker rather than start their own (whose end, with the
// worker's, would unlink names the parent still holds). Throws std::system_error.
void start_name_tracker();

// This process's tracker socket, or -1 when it has not started one. A spawned worker (a fresh
// program, which inherits nothing) is handed it and adopts it.
int name_tracker_socket() noexcept;
// Makes `socket` (the parent's tracker socket) this process's tracker, instead of starting one.
// Before anything else here runs. Throws std::system_error.
void adopt_name_tracker(UniqueFd socket);

// This process holds / no longer holds `name`. Starts the tracker on first use; workers
// inherit their parent's.
void track_segment_name(const std::string& name);
void untrack_segment_name(const std::string& name);

}  // namespace forkpool::detail
