#pragma once
// One page of shared memory (a sealed memfd, mapped read-write) that crosses to other processes
// with its descriptor: where Lock, Barrier and bounded queues keep their state; and the waits and
// mutexes that live in such a page.

#include <pthread.h>

#include <cstddef>
#include <cstdint>
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

// A process-shared robust mutex: when its holder dies, the kernel hands it to the next locker
// with EOWNERDEAD. Throws std::system_error naming `who`.
void init_robust_mutex(pthread_mutex_t& mutex, const char* who);
// Reads the result of pthread_mutex_(try|clock)lock on such a mutex: true when taken, with
// `holder_died` set when it was taken from a holder that died (the mutex is made usable again;
// what it guarded may be half-updated); false when busy or timed out. Throws on anything else.
bool robust_lock_taken(pthread_mutex_t& mutex, int result, bool& holder_died, const char* who);

}  // namespace forkpool::detail
