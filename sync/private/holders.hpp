#pragma once
// Which processes hold how much of a shared primitive (a Semaphore's units, a Barrier's
// arrivals), kept in the primitive's shared page, so that what a dead process held can be
// given back. The caller guards it with the page's robust mutex.

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <cstring>

#include <forkpool/sync/private/journal.hpp>

namespace forkpool::detail {

// How often a waiter looks for holders that ended (a wait no living process will end).
inline constexpr std::chrono::milliseconds kEndedHolderCheck{100};

// Whether process `pid` has ended (gone, or a zombie waiting to be reaped).
bool process_ended(pid_t pid) noexcept;

struct HolderTable {
  static constexpr int kSlots = 64;  // holders beyond it are not tracked (nothing given back)
  struct alignas(8) Slot {
    pid_t pid;
    std::int32_t count;
  };
  Slot slots[kSlots];

  // What adding `delta` to `pid`'s count sets, as one word of a Journal's commit: a null write
  // when it sets nothing (a count never goes below 0: releasing what another process acquired is
  // allowed and counts for nobody; a full table tracks no more holders).
  Journal::Write change(pid_t pid, std::int32_t delta) noexcept;
  // The first slot of a holder that ended, or null.
  Slot* ended() noexcept;
  static std::uint64_t* word(Slot& slot) noexcept { return reinterpret_cast<std::uint64_t*>(&slot); }
  static std::uint64_t pack(Slot slot) noexcept;

  void clear() noexcept;
};

}  // namespace forkpool::detail
