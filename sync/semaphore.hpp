#pragma once
// Semaphore and BoundedSemaphore across processes, as multiprocessing's, and robust as Lock is:
// units acquired by a process that has ended come back to the semaphore (at most up to its start
// value, so a semaphore used to signal, released by one process and acquired by another, never
// grows by it). Handles: copies, and copies passed to other processes (as arguments of
// start_process, spawn and pool tasks), are the same semaphore. Any thread.
//
//   Semaphore slots(2);              // at most two processes in the section at once
//   slots.acquire();  ...  slots.release();
//
// Waits sleep on a futex, looking every 100 ms for holders that ended; async_acquire() sleeps on
// it through the loop (io_uring on Linux 6.7 and later; elsewhere the loop looks at it after
// pauses that grow from 50 µs to 10 ms).

#include <chrono>
#include <cstdint>
#include <memory>

#include <forkpool/ipc/codec.hpp>
#include <forkpool/runtime/internal/shared_handle.hpp>
#include <forkpool/runtime/task.hpp>

namespace forkpool {

namespace detail {
class SharedPage;
}

class Semaphore {
 public:
  // Throws std::invalid_argument for a value below 0; std::system_error.
  explicit Semaphore(int value = 1);

  void acquire();
  // False when no unit came within `timeout`.
  bool acquire(std::chrono::nanoseconds timeout);
  bool try_acquire();
  // On the calling thread's loop; resumes inside a turn of that loop.
  Task<void> async_acquire();
  // A BoundedSemaphore throws std::logic_error when this would go past its start value.
  void release();
  // The units free now.
  int value() const;

 protected:
  Semaphore(int value, bool bounded);

 private:
  friend struct codec<Semaphore>;
  friend struct codec<class BoundedSemaphore>;
  explicit Semaphore(std::shared_ptr<detail::SharedPage> page) : page_(std::move(page)) {}
  detail::SharedHandle<detail::SharedPage, "Semaphore"> page_;
};

// A Semaphore whose release() past its start value is an error (std::logic_error), as
// multiprocessing's BoundedSemaphore.
class BoundedSemaphore : public Semaphore {
 public:
  explicit BoundedSemaphore(int value = 1) : Semaphore(value, true) {}

 private:
  friend struct codec<BoundedSemaphore>;
  explicit BoundedSemaphore(Semaphore semaphore) : Semaphore(std::move(semaphore)) {}
};

template <>
struct codec<Semaphore> {
  static constexpr std::size_t min_size = sizeof(std::uint32_t);
  static void encode(Writer& w, const Semaphore& semaphore);
  static Semaphore decode(Reader& r);
};
template <>
struct codec<BoundedSemaphore> {
  static constexpr std::size_t min_size = sizeof(std::uint32_t);
  static void encode(Writer& w, const BoundedSemaphore& semaphore) { codec<Semaphore>::encode(w, semaphore); }
  static BoundedSemaphore decode(Reader& r);
};

}  // namespace forkpool
