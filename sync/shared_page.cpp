#include <forkpool/sync/private/shared_page.hpp>

#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <system_error>

#include <forkpool/ipc/private/memfd.hpp>
#include <forkpool/runtime/private/errno.hpp>

namespace forkpool::detail {

ino_t SharedPage::inode() const {
  // Threads that race here each read the same number.
  if (ino_t known = inode_.load(std::memory_order_relaxed); known != 0) return known;
  struct stat st {};
  if (fstat(fd_.get(), &st) != 0) throw_last_errno("forkpool: fstat of a shared page");
  inode_.store(st.st_ino, std::memory_order_relaxed);
  return st.st_ino;
}

std::shared_ptr<SharedPage> SharedPage::create(const char* name) {
  UniqueFd fd = create_memfd(name, kSize);
  seal_size(fd.get());
  Mapping mapping = Mapping::map(fd.get(), kSize, PROT_READ | PROT_WRITE);
  return std::shared_ptr<SharedPage>(new SharedPage(std::move(fd), std::move(mapping)));
}

std::shared_ptr<SharedPage> SharedPage::adopt(UniqueFd fd) {
  check_sealed_memfd(fd.get(), kSize, "forkpool: a lock's, barrier's or queue's page");
  Mapping mapping = Mapping::map(fd.get(), kSize, PROT_READ | PROT_WRITE);
  return std::shared_ptr<SharedPage>(new SharedPage(std::move(fd), std::move(mapping)));
}

void write_page(Writer& w, const std::shared_ptr<SharedPage>& page) { w.write_fd(page->fd(), page); }

std::shared_ptr<SharedPage> read_page(Reader& r) { return SharedPage::adopt(r.read_fd()); }

void futex_wait(const void* word, std::uint32_t expected, const timespec* timeout) noexcept {
  syscall(SYS_futex, word, FUTEX_WAIT, expected, timeout, nullptr, 0);
}

void futex_wake_all(const void* word) noexcept { futex_wake(word, INT_MAX); }

void futex_wake(const void* word, int count) noexcept {
  syscall(SYS_futex, word, FUTEX_WAKE, count, nullptr, nullptr, 0);
}

void futex_wait_for(const void* word, std::uint32_t expected, std::chrono::nanoseconds timeout) noexcept {
  auto seconds = std::chrono::duration_cast<std::chrono::seconds>(timeout);
  timespec relative{static_cast<time_t>(seconds.count()), static_cast<long>((timeout - seconds).count())};
  futex_wait(word, expected, &relative);
}

void init_robust_mutex(pthread_mutex_t& mutex, const char* who, bool recursive) {
  pthread_mutexattr_t attributes;
  pthread_mutexattr_init(&attributes);
  if (recursive) pthread_mutexattr_settype(&attributes, PTHREAD_MUTEX_RECURSIVE);
  pthread_mutexattr_setpshared(&attributes, PTHREAD_PROCESS_SHARED);
  pthread_mutexattr_setrobust(&attributes, PTHREAD_MUTEX_ROBUST);
  int rc = pthread_mutex_init(&mutex, &attributes);
  pthread_mutexattr_destroy(&attributes);
  if (rc != 0) throw std::system_error(rc, std::generic_category(), who);
}

bool robust_lock_taken(pthread_mutex_t& mutex, int result, bool& holder_died, const char* who) {
  if (result == 0 || result == EOWNERDEAD) {
    if (result == EOWNERDEAD) pthread_mutex_consistent(&mutex);
    holder_died = result == EOWNERDEAD;
    return true;
  }
  if (result == EBUSY || result == ETIMEDOUT) return false;
  throw std::system_error(result, std::generic_category(), who);
}

}  // namespace forkpool::detail
