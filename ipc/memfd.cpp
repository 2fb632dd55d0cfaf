#include <forkpool/ipc/private/memfd.hpp>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <string>

#include <forkpool/ipc/internal/mapping.hpp>
#include <forkpool/runtime/error.hpp>
#include <forkpool/runtime/private/errno.hpp>

#ifndef MFD_NOEXEC_SEAL
#define MFD_NOEXEC_SEAL 0x0008U
#endif

namespace forkpool {
namespace {
// MFD_NOEXEC_SEAL came with Linux 6.3; older kernels reject the flag, so learn once.
std::atomic<bool> g_noexec_seal_known_missing{false};
}  // namespace

UniqueFd create_memfd(const char* name, std::size_t size) {
  unsigned flags = MFD_CLOEXEC | MFD_ALLOW_SEALING;
  int fd = -1;
  if (!g_noexec_seal_known_missing.load(std::memory_order_relaxed)) {
    fd = memfd_create(name, flags | MFD_NOEXEC_SEAL);
    if (fd < 0 && errno == EINVAL) g_noexec_seal_known_missing.store(true, std::memory_order_relaxed);
  }
  if (fd < 0) fd = memfd_create(name, flags);
  if (fd < 0) detail::throw_last_errno("memfd_create");
  UniqueFd owned(fd);
  if (ftruncate(fd, static_cast<off_t>(size)) < 0) detail::throw_last_errno("ftruncate(memfd)");
  return owned;
}

void seal_size(int fd) {
  if (fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) < 0) detail::throw_last_errno("F_ADD_SEALS");
}

UniqueFd sealed_memfd_with(const char* name, std::span<const std::byte> bytes) {
  UniqueFd fd = create_memfd(name, bytes.size());
  // write(2) fills the pages in the kernel: no page fault per page, as a fresh mapping would take.
  for (std::size_t done = 0; done < bytes.size();) {
    ssize_t n = pwrite(fd.get(), bytes.data() + done, bytes.size() - done, static_cast<off_t>(done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) detail::throw_last_errno("forkpool: writing a payload memfd");
    done += static_cast<std::size_t>(n);
  }
  seal_size(fd.get());
  return fd;
}

std::size_t check_sealed_memfd(int fd, std::size_t min_size, const char* what) {
  struct stat st {};
  if (fstat(fd, &st) < 0) throw ProtocolError(std::string(what) + ": fstat failed: " + strerror(errno));
  return check_sealed_memfd(fd, st, min_size, what);
}

std::size_t check_sealed_memfd(int fd, const struct stat& st, std::size_t min_size, const char* what) {
  int seals = fcntl(fd, F_GET_SEALS);
  if (seals < 0)
    throw ProtocolError(std::string(what) + ": descriptor is not a memfd (F_GET_SEALS: " + strerror(errno) + ")");
  if ((seals & (F_SEAL_SHRINK | F_SEAL_GROW)) != (F_SEAL_SHRINK | F_SEAL_GROW))
    throw ProtocolError(std::string(what) + ": memfd is not sealed against shrinking and growing");
  auto size = static_cast<std::size_t>(st.st_size);
  if (size < min_size)
    throw ProtocolError(std::string(what) + ": memfd holds " + std::to_string(size) + " bytes, " +
                        std::to_string(min_size) + " were claimed");
  return size;
}

}  // namespace forkpool
