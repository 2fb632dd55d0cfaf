#pragma once
// One page of shared memory (a sealed memfd, mapped read-write) that crosses to other processes
// with its descriptor: where Lock and Barrier keep their state.

#include <cstddef>
#include <memory>

#include <forkpool/ipc/internal/mapping.hpp>
#include <forkpool/runtime/internal/unique_fd.hpp>

namespace forkpool::detail {

class SharedPage {
 public:
  static constexpr std::size_t kSize = 4096;
  // A new zero-filled page. Throws std::system_error.
  static std::shared_ptr<SharedPage> create(const char* name);
  // Maps a page received from another process. Throws ProtocolError when `fd` is not a sealed
  // memfd of a page.
  static std::shared_ptr<SharedPage> adopt(UniqueFd fd);

  int fd() const noexcept { return fd_.get(); }
  template <class T>
  T* as() noexcept {
    static_assert(sizeof(T) <= kSize);
    return reinterpret_cast<T*>(mapping_.data());
  }

 private:
  SharedPage(UniqueFd fd, Mapping mapping) : fd_(std::move(fd)), mapping_(std::move(mapping)) {}
  UniqueFd fd_;
  Mapping mapping_;
};

// Futex wait/wake on a word of shared memory (not FUTEX_PRIVATE: other processes map it too).
// wait returns when woken, interrupted, when *word != expected, or after `timeout` (none: for ever).
void futex_wait(const void* word, std::uint32_t expected, const struct timespec* timeout) noexcept;
void futex_wake_all(const void* word) noexcept;

}  // namespace forkpool::detail
