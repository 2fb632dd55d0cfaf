#pragma once
// One page of shared memory (a sealed memfd, mapped read-write) that crosses to other processes
// with its descriptor: where Lock, Barrier and bounded queues keep their state; and the waits and
// mutexes that live in such a page.

#include <pthread.h>
#include <sys/types.h>

#include <cstddef>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <utility>

#include <forkpool/ipc/codec.hpp>
#include <forkpool/ipc/internal/mapping.hpp>
#include <forkpool/runtime/unique_fd.hpp>

namespace forkpool::detail {

class SharedPage {
 public:
  static constexpr std::size_t kSize = 4096;
  // A new zero-filled page. Throws std::system_error.
  static std::shared_ptr<SharedPage> create(const char* name);
  // Maps a page received from another process. Throws ProtocolError when `fd` is not a sealed
  // memfd of a page.
  static std::shared_ptr<SharedPage> adopt(UniqueFd fd);

  // A page holding a robust mutex this process holds stays mapped after its last handle is
  // gone (until the process ends): the kernel releases a dead holder's mutexes through that
  // mapping, also when the holder simply returned without unlocking.
  ~SharedPage() {
    if (mutexes_held_.load() > 0) mapping_.leak();
  }
  void mutex_taken() noexcept { mutexes_held_.fetch_add(1); }
  void mutex_released() noexcept { mutexes_held_.fetch_sub(1); }

  int fd() const noexcept { return fd_.get(); }
  // Whether `other` is the same page, also when each was received on its own (two mappings of
  // one memfd): their inodes are equal. Throws std::system_error if fstat fails.
  bool same_as(const SharedPage& other) const { return inode() == other.inode(); }
  template <class T>
  T* as() noexcept {
    static_assert(sizeof(T) <= kSize);
    return reinterpret_cast<T*>(mapping_.data());
  }

 private:
  SharedPage(UniqueFd fd, Mapping mapping) noexcept : fd_(std::move(fd)), mapping_(std::move(mapping)) {}
  // Read on first use: only a Condition's wait asks, so other pages never pay the fstat.
  ino_t inode() const;
  UniqueFd fd_;
  Mapping mapping_;
  mutable std::atomic<ino_t> inode_{0};  // 0: not read yet (no file has inode 0)
  std::atomic<int> mutexes_held_{0};
};

// A page as a field of a message: its descriptor, which the message keeps (with the page) until
// it is sent; read_page maps it again on the receiving side (adopt's checks and errors).
void write_page(Writer& w, const std::shared_ptr<SharedPage>& page);
std::shared_ptr<SharedPage> read_page(Reader& r);

// Futex wait/wake on a word of shared memory (not FUTEX_PRIVATE: other processes map it too).
// wait returns when woken, interrupted, when *word != expected, or after `timeout` (none: for ever).
void futex_wait(const void* word, std::uint32_t expected, const struct timespec* timeout) noexcept;
void futex_wake_all(const void* word) noexcept;
void futex_wake(const void* word, int count) noexcept;
// A wait of at most `timeout` on a futex word, for waits cut into slices.
void futex_wait_for(const void* word, std::uint32_t expected, std::chrono::nanoseconds timeout) noexcept;

// A process-shared robust mutex: when its holder dies, the kernel hands it to the next locker
// with EOWNERDEAD. Recursive: its holder may lock it again (and unlocks as often). Throws
// std::system_error naming `who`.
void init_robust_mutex(pthread_mutex_t& mutex, const char* who, bool recursive = false);
// Reads the result of pthread_mutex_(try|clock)lock on such a mutex: true when taken, with
// `holder_died` set when it was taken from a holder that died (the mutex is made usable again;
// what it guarded may be half-updated); false when busy or timed out. Throws on anything else.
bool robust_lock_taken(pthread_mutex_t& mutex, int result, bool& holder_died, const char* who);

// Holds a primitive's own robust mutex (a few instructions' worth of bookkeeping) for a scope. A
// holder that died mid-update is survivable: each primitive says how.
class RobustGuard {
 public:
  RobustGuard(pthread_mutex_t& mutex, const char* who) : mutex_(mutex) {
    robust_lock_taken(mutex_, pthread_mutex_lock(&mutex_), holder_died_, who);
  }
  ~RobustGuard() { pthread_mutex_unlock(&mutex_); }
  RobustGuard(const RobustGuard&) = delete;
  RobustGuard& operator=(const RobustGuard&) = delete;
  // The mutex came from a holder that died holding it: what it guards may be half-updated
  // (a Journal's replay() completes it).
  bool holder_died() const noexcept { return holder_died_; }

 private:
  pthread_mutex_t& mutex_;
  bool holder_died_ = false;
};

}  // namespace forkpool::detail
