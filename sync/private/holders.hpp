#pragma once
// Which processes hold how much of a shared primitive (a Semaphore's units, a Barrier's
// arrivals), kept in the primitive's shared page, so that what a dead process held can be
// given back. The caller guards it with the page's robust mutex.

#include <sys/types.h>

#include <chrono>
#include <cstdint>

namespace forkpool::detail {

// How often a waiter looks for holders that ended (a wait no living process will end).
inline constexpr std::chrono::milliseconds kEndedHolderCheck{100};

// Whether process `pid` has ended (gone, or a zombie waiting to be reaped).
bool process_ended(pid_t pid) noexcept;

struct HolderTable {
  static constexpr int kSlots = 64;  // holders beyond it are not tracked (nothing given back)
  struct Slot {
    pid_t pid;
    std::int32_t count;
  };
  Slot slots[kSlots];

  // Adds `delta` to what `pid` holds; a holder's count never goes below 0 (releasing what
  // another process acquired is allowed and counts for nobody).
  void add(pid_t pid, std::int32_t delta) noexcept;
  // Forgets the holders that ended; returns what they held.
  std::int64_t take_ended() noexcept;
  // Whether a holder has ended (and forgets nothing).
  bool any_ended() const noexcept;
  void clear() noexcept;
};

}  // namespace forkpool::detail
