#pragma once
// Sealed memfds: anonymous shared memory whose size cannot change once sealed, so a process that
// maps one it received can never be made to fault (SIGBUS) by the sender shrinking it.

#include <sys/stat.h>

#include <cstddef>
#include <cstdint>
#include <span>

#include <forkpool/runtime/unique_fd.hpp>

namespace forkpool {

// A new memfd of `size` bytes (close-on-exec, sealable, not executable where the kernel knows how).
UniqueFd create_memfd(const char* name, std::size_t size);

// Seals `fd` against shrinking and growing (and against further sealing).
void seal_size(int fd);

// A sealed memfd holding a copy of `bytes`.
UniqueFd sealed_memfd_with(const char* name, std::span<const std::byte> bytes);

// Validates a descriptor received from another process before it is mapped: a memfd sealed
// against shrinking and growing whose size is at least `min_size`. Returns its size. Throws
// ProtocolError naming `what` otherwise.
std::size_t check_sealed_memfd(int fd, std::size_t min_size, const char* what);
// The same, for a caller that has fstat()ed `fd` already.
std::size_t check_sealed_memfd(int fd, const struct stat& st, std::size_t min_size, const char* what);

// Bytes of the file that are backed by memory (not holes): what a sender really wrote or
// reserved, however large it says the file is.
inline std::uint64_t allocated_bytes(const struct stat& st) { return static_cast<std::uint64_t>(st.st_blocks) * 512; }

}  // namespace forkpool
