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

std::uint64_t HolderTable::pack(Slot slot) noexcept {
  std::uint64_t packed;
  std::memcpy(&packed, &slot, sizeof packed);
  return packed;
}

Journal::Write HolderTable::change(pid_t pid, std::int32_t delta) noexcept {
  Slot* free_slot = nullptr;
  for (Slot& slot : slots) {
    if (slot.pid == pid) {
      std::int32_t count = slot.count + delta;
      return {word(slot), pack(count <= 0 ? Slot{} : Slot{pid, count})};
    }
    if (slot.pid == 0 && !free_slot) free_slot = &slot;
  }
  if (delta > 0 && free_slot) return {word(*free_slot), pack({pid, delta})};
  return Journal::Write::nothing();
}

HolderTable::Slot* HolderTable::ended() noexcept {
  for (Slot& slot : slots)
    if (slot.pid != 0 && process_ended(slot.pid)) return &slot;
  return nullptr;
}

void HolderTable::clear() noexcept {
  for (Slot& slot : slots) slot = {};
}

}  // namespace forkpool::detail
