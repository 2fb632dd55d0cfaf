#pragma once
// Event, Lock, RLock, Condition and Barrier across processes, as multiprocessing's. Each is a handle: copies, and
// copies passed to other processes (as arguments of start_process, spawn and pool tasks, under
// every start method: their descriptors travel with the message), are the same object. Waiting
// never spins: a descriptor the kernel wakes, or a futex.

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>

#include <forkpool/ipc/codec.hpp>
#include <forkpool/runtime/error.hpp>
#include <forkpool/runtime/internal/deadline.hpp>
#include <forkpool/runtime/internal/shared_handle.hpp>
#include <forkpool/runtime/task.hpp>

namespace forkpool {

namespace detail {
class SharedPage;
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

  int fd() const;  // for codec<Event>

 private:
  friend struct codec<Event>;
  struct State;
  explicit Event(std::shared_ptr<State> state) : state_(std::move(state)) {}
  detail::SharedHandle<State, "Event"> state_;
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
  // On the calling thread's loop (whose thread then holds it), resuming there when the holder
  // unlocks (the loop sleeps on the mutex's futex; without io_uring's futex wait it looks after
  // pauses growing from 50 µs to 10 ms). This handle must outlive it.
  Task<void> async_lock();
  void unlock();
  // Whether some thread of some process holds it now (a holder that died does not), as
  // Python's Lock.locked(): a glance, stale as soon as it returns.
  bool locked() const;
  // Whether the last lock()/try_lock() through this handle took the lock from a holder that died.
  // What that holder guarded may be half-updated.
  bool previous_owner_died() const noexcept { return previous_owner_died_; }

 private:
  friend struct codec<Lock>;
  friend class RLock;
  friend class Condition;
  struct Recursive {};
  explicit Lock(Recursive);
  explicit Lock(std::shared_ptr<detail::SharedPage> page) : page_(std::move(page)) {}
  bool took(int result);
  // Whether `other` is this lock: a copy of it, or the same lock received on its own.
  bool is(const Lock& other) const;
  // async_lock(), and lock()/try_lock_for() while they keep the thread's loop going.
  Task<bool> lock_on_loop(detail::Deadline deadline);
  detail::SharedHandle<detail::SharedPage, "Lock"> page_;
  bool previous_owner_died_ = false;
};

// A Lock its holder may take again (and then releases as many times), as multiprocessing's
// RLock: robust in the same way. Any thread; unlock() from the thread that locked.
class RLock {
 public:
  friend class Condition;
  RLock() : lock_(Lock::Recursive{}) {}  // Throws std::system_error.
  void lock() { lock_.lock(); }
  bool try_lock() { return lock_.try_lock(); }
  bool try_lock_for(std::chrono::nanoseconds timeout) { return lock_.try_lock_for(timeout); }
  void unlock() { lock_.unlock(); }
  bool previous_owner_died() const noexcept { return lock_.previous_owner_died(); }

 private:
  friend struct codec<RLock>;
  explicit RLock(Lock lock) : lock_(std::move(lock)) {}
  Lock lock_;
};

// multiprocessing's Condition over a Lock: wait() lets the lock go, sleeps until notify(), and
// takes the lock back; `held` holds get_lock() (a copy of it, or the same lock received on its
// own), or the wait is std::logic_error. notify() is called with the lock held. As std::condition_variable, a
// wait may end without a notify (and notify(n) may wake more than n): wait in a loop on what
// you wait for, or use the predicate forms. The Lock is robust: a holder that died releases it.
// Any thread.
//   Condition ready;
//   std::unique_lock held(ready.get_lock());
//   ready.wait(held, [&] { return queue_has_work(); });
//
// Over an RLock (Python's default, and Value's get_lock()), a wait lets the lock go however many
// times its holder took it, and takes it back as many times:
//   Value<int> counter(0);
//   Condition changed(counter.get_lock());
//   std::unique_lock held(counter.get_lock());
//   changed.wait(held, [&] { return counter.load() > 0; });
class Condition {
 public:
  explicit Condition(Lock lock = {});  // Throws std::system_error.
  explicit Condition(RLock lock);      // Throws std::system_error.
  Lock& get_lock() noexcept { return lock_; }

  void wait(std::unique_lock<Lock>& held);
  void wait(std::unique_lock<RLock>& held);
  // False when `timeout` passed without a notify.
  bool wait_for(std::unique_lock<Lock>& held, std::chrono::nanoseconds timeout);
  bool wait_for(std::unique_lock<RLock>& held, std::chrono::nanoseconds timeout);
  template <class Held, class Predicate>
  void wait(std::unique_lock<Held>& held, Predicate ready) {
    while (!ready()) wait(held);
  }
  // ready()'s last value: false when `timeout` passed first.
  template <class Held, class Predicate>
  bool wait_for(std::unique_lock<Held>& held, std::chrono::nanoseconds timeout, Predicate ready) {
    auto deadline = detail::deadline_after(timeout);
    while (!ready()) {
      auto left = deadline - std::chrono::steady_clock::now();
      if (left <= std::chrono::nanoseconds::zero()) return ready();
      wait_for(held, left);
    }
    return true;
  }
  // On the calling thread's loop: as wait(), resuming there when notified (the loop sleeps on the
  // futex; without io_uring's futex wait it looks after pauses growing from 50 µs to 10 ms);
  // `held` must stay alive until it completes.
  Task<void> async_wait(std::unique_lock<Lock>& held);
  void notify(int n = 1);
  void notify_all();

 private:
  friend struct codec<Condition>;
  Condition(Lock lock, std::shared_ptr<detail::SharedPage> page) : lock_(std::move(lock)), page_(std::move(page)) {}
  // Throws std::logic_error unless `held` (null: not held) is lock_.
  void check_held(const Lock* held, const char* who) const;
  void check_held(const std::unique_lock<Lock>& held, const char* who) const;
  void check_held(const std::unique_lock<RLock>& held, const char* who) const;
  // Lets go of lock_, taken `depth` times, until a notify or `timeout`; then takes it as often.
  bool release_and_wait(int depth, std::chrono::nanoseconds timeout);
  Lock lock_;
  detail::SharedHandle<detail::SharedPage, "Condition"> page_;
};

// A Barrier that can no longer be passed: abort()ed, reset() while parties waited, a wait that
// timed out, or a party that died while the others waited.
class BrokenBarrierError : public Error {
 public:
  using Error::Error;
};

// `parties` processes (or threads) wait() until all have arrived; then all go on, and the
// barrier is ready for the next round, as multiprocessing's Barrier. Any thread.
class Barrier {
 public:
  // Run by the last party to arrive, before the others are released (Python's `action`). If it
  // throws, the barrier breaks (the others get BrokenBarrierError) and the last party gets the
  // exception. A function pointer (or a lambda without captures): sent to another process it is
  // found again in the same program or shared object there, never loaded from what was sent.
  using Action = void (*)();
  explicit Barrier(int parties, Action action = nullptr);  // Throws std::invalid_argument for parties < 1.
  // The arrival index, 0 to parties - 1 (parties - 1: the last to arrive). Throws
  // BrokenBarrierError when the barrier is or becomes broken while waiting; a wait that times out
  // breaks it (as Python's).
  int wait(std::chrono::nanoseconds timeout = detail::kForever);
  // On the calling thread's loop: as wait(), resuming there when the round ends (the loop sleeps
  // on the futex; without io_uring's futex wait it looks after pauses growing from 50 µs to 10 ms).
  Task<int> async_wait();
  // Breaks the barrier: waiting parties and later waits throw BrokenBarrierError until reset().
  void abort();
  // Back to empty and not broken; parties waiting now throw BrokenBarrierError.
  void reset();
  bool broken() const;
  int parties() const;
  int n_waiting() const;

 private:
  friend struct codec<Barrier>;
  Barrier(std::shared_ptr<detail::SharedPage> page, Action action) : page_(std::move(page)), action_(action) {}
  struct Arrival {
    std::uint32_t generation;
    int index;
    bool last;
  };
  Arrival arrive();
  std::optional<int> round_over(const Arrival& arrival, std::chrono::steady_clock::time_point deadline,
                                bool look_for_ended);
  detail::SharedHandle<detail::SharedPage, "Barrier"> page_;
  Action action_ = nullptr;  // in this process's addresses
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
struct codec<RLock> {
  static constexpr std::size_t min_size = sizeof(std::uint32_t);
  static void encode(Writer& w, const RLock& lock) { codec<Lock>::encode(w, lock.lock_); }
  static RLock decode(Reader& r) { return RLock(codec<Lock>::decode(r)); }
};
template <>
struct codec<Condition> {
  static constexpr std::size_t min_size = 2 * sizeof(std::uint32_t);
  static void encode(Writer& w, const Condition& condition);
  static Condition decode(Reader& r);
};
template <>
struct codec<Barrier> {
  static constexpr std::size_t min_size = sizeof(std::uint32_t);
  static void encode(Writer& w, const Barrier& barrier);
  static Barrier decode(Reader& r);
};

}  // namespace forkpool
