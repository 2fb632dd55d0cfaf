#include <forkpool/shm/named_memory.hpp>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <stdexcept>

#include <forkpool/ipc/internal/mapping.hpp>
#include <forkpool/runtime/error.hpp>
#include <forkpool/runtime/private/errno.hpp>
#include <forkpool/runtime/private/memory_limit.hpp>
#include <forkpool/runtime/unique_fd.hpp>
#include <forkpool/shm/private/name_tracker.hpp>

namespace forkpool {

struct SharedMemory::Block {
  std::string name;
  UniqueFd fd;
  detail::Mapping mapping;
  std::size_t size;
};

namespace {

std::string fresh_name() {
  std::uint64_t bits = 0;
  if (getrandom(&bits, sizeof bits, 0) != static_cast<ssize_t>(sizeof bits))
    bits = static_cast<std::uint64_t>(getpid());
  char name[64];
  std::snprintf(name, sizeof name, "forkpool-shm-%d-%016llx", static_cast<int>(getpid()),
                static_cast<unsigned long long>(bits));
  return name;
}

void check_name(const std::string& name) {
  if (name.empty() || name.size() > 200 || name.find('/') != std::string::npos)
    throw std::invalid_argument("forkpool: SharedMemory: a name is 1 to 200 characters without '/': " + name);
}

}  // namespace

SharedMemory SharedMemory::map(std::string name, int fd, bool track) {
  UniqueFd owned(fd);
  struct stat st {};
  if (fstat(fd, &st) != 0) detail::throw_last_errno("forkpool: SharedMemory: fstat");
  if (!S_ISREG(st.st_mode)) throw ProtocolError("forkpool: SharedMemory: " + name + " is not a shared memory block");
  auto size = static_cast<std::size_t>(st.st_size);
  detail::Mapping mapping;
  if (size > 0) mapping = detail::Mapping::map(fd, size, PROT_READ | PROT_WRITE);
  // Tracked until this process ends: the block lives while a process that used it lives.
  if (track && detail::is_segment_name(name)) detail::track_segment_name(name);
  return SharedMemory(std::make_shared<Block>(Block{std::move(name), std::move(owned), std::move(mapping), size}));
}

SharedMemory SharedMemory::create(std::string name, std::size_t size, bool outlive) {
  if (size == 0) throw std::invalid_argument("forkpool: SharedMemory::create: the size must be at least one byte");
  detail::check_memory_could_hold(size, "forkpool: SharedMemory::create");
  if (name.empty()) name = fresh_name();
  check_name(name);
  if (!outlive && !detail::is_segment_name(name))
    throw std::invalid_argument("forkpool: SharedMemory::create: \"" + name +
                                "\" does not start with \"forkpool-\", the names forkpool cleans up after the last "
                                "user; give outlive = true to manage it yourself (unlink())");
  int fd = shm_open(("/" + name).c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) detail::throw_last_errno(("forkpool: SharedMemory::create " + name).c_str());
  // Reserved now, or an exception now: a sparse block larger than /dev/shm's free space would be
  // made, and the first write past the free space would be SIGBUS.
  int error = ftruncate(fd, static_cast<off_t>(size)) == 0 ? posix_fallocate(fd, 0, static_cast<off_t>(size)) : errno;
  if (error != 0) {
    close(fd);
    shm_unlink(("/" + name).c_str());
    errno = error;
    detail::throw_last_errno(("forkpool: SharedMemory::create " + name + " (is /dev/shm full?)").c_str());
  }
  try {
    return map(std::move(name), fd, !outlive);
  } catch (...) {
    shm_unlink(("/" + name).c_str());
    throw;
  }
}

SharedMemory SharedMemory::attach(std::string name) {
  check_name(name);
  int fd = shm_open(("/" + name).c_str(), O_RDWR | O_CLOEXEC, 0);
  if (fd < 0) detail::throw_last_errno(("forkpool: SharedMemory::attach " + name).c_str());
  return map(std::move(name), fd, true);
}

std::span<std::byte> SharedMemory::bytes() const {
  return {block_->mapping.data(), block_->mapping.data() ? block_->size : 0};
}
const std::string& SharedMemory::name() const { return block_->name; }

void SharedMemory::unlink() {
  if (shm_unlink(("/" + block_->name).c_str()) != 0 && errno != ENOENT)
    detail::throw_last_errno(("forkpool: SharedMemory::unlink " + block_->name).c_str());
  if (detail::is_segment_name(block_->name)) detail::untrack_segment_name(block_->name);
}

void codec<SharedMemory>::encode(Writer& w, const SharedMemory& memory) {
  w.write(memory.block_->name);
  w.write_fd(memory.block_->fd.get(), memory.block_.shared());
}

SharedMemory codec<SharedMemory>::decode(Reader& r) {
  auto name = r.read<std::string>();
  UniqueFd fd = r.read_fd();
  if (name.empty() || name.find('/') != std::string::npos) r.fail("a SharedMemory with no name, or one with '/'");
  return SharedMemory::map(std::move(name), fd.release(), true);
}

}  // namespace forkpool
