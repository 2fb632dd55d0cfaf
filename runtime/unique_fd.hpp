#pragma once
// UniqueFd: sole owner of one file descriptor; closes it exactly once.

#include <errno.h>
#include <fcntl.h>
#include <unistd.h>

#include <system_error>
#include <utility>

namespace forkpool {

class UniqueFd {
 public:
  UniqueFd() noexcept = default;
  explicit UniqueFd(int fd) noexcept : fd_(fd) {}
  UniqueFd(UniqueFd&& other) noexcept : fd_(other.release()) {}
  UniqueFd& operator=(UniqueFd&& other) noexcept {
    if (this != &other) reset(other.release());
    return *this;
  }
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  ~UniqueFd() { reset(); }

  int get() const noexcept { return fd_; }
  explicit operator bool() const noexcept { return fd_ >= 0; }

  // Gives up ownership without closing.
  int release() noexcept { return std::exchange(fd_, -1); }

  // Closes the held descriptor (if any) and takes `fd`.
  void reset(int fd = -1) noexcept {
    int old = std::exchange(fd_, fd);
    if (old >= 0) ::close(old);
  }

 private:
  int fd_ = -1;
};

// A close-on-exec duplicate of `fd`. Throws std::system_error (EMFILE, say).
inline UniqueFd duplicate_fd(int fd) {
  int copy = ::fcntl(fd, F_DUPFD_CLOEXEC, 0);
  if (copy < 0) throw std::system_error(errno, std::generic_category(), "forkpool: duplicating a descriptor");
  return UniqueFd(copy);
}

}  // namespace forkpool
