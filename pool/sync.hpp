#pragma once
// Event, Lock and Barrier across processes, as multiprocessing's. Each is a handle: copies, and
// copies passed to other processes (as arguments of start_process, spawn and pool tasks, under
// every start method: their descriptors travel with the message), are the same object. Waiting
// never spins: a descriptor the kernel wakes, or a futex.

#include <chrono>
#include <cstdint>
#include <memory>

#include <forkpool/ipc/codec.hpp>
#include <forkpool/runtime/task.hpp>

namespace forkpool {

namespace detail {
class SharedPage;
inline constexpr std::chrono::nanoseconds kForever = std::chrono::nanoseconds::max();
}  // namespace detail

// A flag every process can set, clear and wait for. Any thread.
//   Event ready;                 // passed to the workers
//   ready.wait();                // in a worker: until some process calls ready.set()
class Event {
 public:
  Event();  // clear. Throws std::system_error.
  void set();
  void clear();
  bool is_set() const;
  // True once set; false if `timeout` passes first.
  bool wait(std::chrono::nanoseconds timeout = detail::kForever) const;
  // On the calling thread's loop; resumes inside the loop's turn that saw it set.
  Task<void> async_wait() const;

  int fd() const noexcept;  // for codec<Event>

 private:
  friend struct codec<Event>;
  struct State;
  explicit Event(std::shared_ptr<State> state) : state_(std::move(state)) {}
  std::shared_ptr<State> state_;
};

// A mutex held by one process (or thread) at a time. When its holder dies, the lock passes to
// the next lock(), which then sees previous_owner_died(): nothing waits for ever on a dead
// process (multiprocessing's Lock would). Any thread; unlock() from the thread that locked.
class Lock {
 public:
  Lock();  // Throws std::system_error.
  void lock();
  bool try_lock();
  // As lock(), but gives up after `timeout`: false, not held.
  bool try_lock_for(std::chrono::nanoseconds timeout);
  void unlock();
  // Whether the last lock()/try_lock() through this handle took the lock from a holder that died.
  // What that holder guarded may be half-updated.
  bool previous_owner_died() const noexcept { return previous_owner_died_; }

 private:
  friend struct codec<Lock>;
  explicit Lock(std::shared_ptr<detail::SharedPage> page) : page_(std::move(page)) {}
  bool took(int result);
  std::shared_ptr<detail::SharedPage> page_;
  bool previous_owner_died_ = false;
};

// `parties` processes (or threads) wait() until all have arrived; then all go on, and the
// barrier is ready for the next round. Any thread.
class Barrier {
 public:
  explicit Barrier(int parties);  // Throws std::invalid_argument for parties < 1.
  void wait();
  int parties() const noexcept;

 private:
  friend struct codec<Barrier>;
  explicit Barrier(std::shared_ptr<detail::SharedPage> page) : page_(std::move(page)) {}
  std::shared_ptr<detail::SharedPage> page_;
};

template <>
struct codec<Event> {
  static constexpr std::size_t min_size = sizeof(std::uint32_t);
  static void encode(Writer& w, const Event& event);
  static Event decode(Reader& r);
};
template <>
struct codec<Lock> {
  static constexpr std::size_t min_size = sizeof(std::uint32_t);
  static void encode(Writer& w, const Lock& lock);
  static Lock decode(Reader& r);
};
template <>
struct codec<Barrier> {
  static constexpr std::size_t min_size = sizeof(std::uint32_t);
  static void encode(Writer& w, const Barrier& barrier);
  static Barrier decode(Reader& r);
};

}  // namespace forkpool
