#include <forkpool/sync/private/holders.hpp>

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

namespace forkpool::detail {

bool process_ended(pid_t pid) noexcept {
  if (kill(pid, 0) != 0 && errno == ESRCH) return true;
  char path[64];
  std::snprintf(path, sizeof path, "/proc/%d/stat", static_cast<int>(pid));
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return errno == ENOENT;
  char stat[256];
  ssize_t n = read(fd, stat, sizeof stat - 1);
  close(fd);
  if (n <= 0) return false;
  stat[n] = '\0';
  const char* after_name = std::strrchr(stat, ')');  // the name may hold spaces and parentheses
  return after_name && after_name[1] == ' ' && (after_name[2] == 'Z' || after_name[2] == 'X');
}

void HolderTable::add(pid_t pid, std::int32_t delta) noexcept {
  Slot* free_slot = nullptr;
  for (Slot& slot : slots) {
    if (slot.pid == pid) {
      slot.count += delta;
      if (slot.count <= 0) slot = {};
      return;
    }
    if (slot.pid == 0 && !free_slot) free_slot = &slot;
  }
  if (delta > 0 && free_slot) *free_slot = {pid, delta};
}

std::int64_t HolderTable::take_ended() noexcept {
  std::int64_t held = 0;
  for (Slot& slot : slots) {
    if (slot.pid == 0 || !process_ended(slot.pid)) continue;
    held += slot.count;
    slot = {};
  }
  return held;
}

bool HolderTable::any_ended() const noexcept {
  for (const Slot& slot : slots)
    if (slot.pid != 0 && process_ended(slot.pid)) return true;
  return false;
}

void HolderTable::clear() noexcept {
  for (Slot& slot : slots) slot = {};
}

}  // namespace forkpool::detail
