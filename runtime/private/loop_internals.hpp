#pragma once
// What forkpool's own awaitables and drivers need of the Loop beyond its public face.

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <stdexcept>

#include <forkpool/runtime/private/backend.hpp>
#include <forkpool/runtime/private/spin.hpp>
#include <forkpool/runtime/loop.hpp>

namespace forkpool::detail {

// Told when a drive of its loop ends (run(), a blocking wait, run_ready()): the program goes
// back to its own code, and nothing turns the loop until it calls in again. Called on the
// loop's thread, with the loop no longer driven.
class LeaveListener {
 public:
  virtual void loop_left() noexcept = 0;
  // The loop itself ends (its thread exits): the last moment its work can be finished, by
  // finish_before_return, which ~Loop drives. On the loop's thread.
  virtual void loop_ending() noexcept {}

 protected:
  ~LeaveListener() = default;
};

struct LoopInternals {
  // Hands `op` to the kernel (queued if the ring is full); it completes through its callback.
  static void start(Loop& loop, Operation* op);
  // Asks `op` to complete early with -ECANCELED.
  static void cancel(Loop& loop, Operation* op) { loop.backend_->cancel(op); }
  // Whether the loop's kernel interface can wait on a futex word (OpKind::futex_wait).
  static bool waits_on_futexes(const Loop& loop) noexcept { return loop.backend_->waits_on_futexes(); }
  // True while run(), AsyncResult::get() or run_ready() drives the loop on this thread.
  static bool driving(const Loop& loop) noexcept { return loop.driving_; }
  // The calling thread's loop if it has one (Loop::current() would make it), else null.
  static Loop* existing() noexcept;
  // Operations started and not yet completed, not counting the door's read (Loop::post).
  static std::size_t outstanding(const Loop& loop) noexcept;
  // Starts the read that Loop::post's eventfd completes.
  static void open_door(Loop& loop);
  // Runs one turn: delivers completions, blocking for at least one first if `block`. A
  // blocking turn first polls the loop's spinners for as long as the longest of their budgets.
  static std::size_t turn(Loop& loop, bool block);
  // `spinner` is polled before every blocking turn sleeps, until removed. Loop thread only.
  static void add_spinner(Loop& loop, Spinner* spinner);
  static void remove_spinner(Loop& loop, Spinner* spinner) noexcept;
  // `listener` is told of each drive's end while it lives. Loop thread only.
  static void add_leave_listener(Loop& loop, std::weak_ptr<LeaveListener> listener);
  // run() and ~Loop drive the loop until `task` has ended: work that must not be cut short when
  // the program's main task ends (a destroyed pool's workers being reaped).
  static void finish_before_return(Loop& loop, Task<void> task) { loop.finishing_.start(std::move(task)); }
  static void finish(Loop& loop);
  // pthread_atfork's child handler: the inherited loop is dropped, its descriptors closed.
  static void abandon_after_fork();

  // Marks the loop as driven for the guard's lifetime; std::logic_error naming `who` if it already is.
  class DriveGuard {
   public:
    DriveGuard(Loop& loop, const char* who);
    ~DriveGuard();  // tells the leave listeners
    DriveGuard(const DriveGuard&) = delete;
    DriveGuard& operator=(const DriveGuard&) = delete;

   private:
    Loop& loop_;
  };

  // Turns until `done()`, waiting for posts (Loop::post) when nothing else is in flight.
  static void drive_until(Loop& loop, const std::function<bool()>& done);

  // Calls `event` on each leave listener still alive, forgetting the dead ones. By index: a
  // listener may add another (a pool made on the way) while it is told.
  static void tell_leave_listeners(Loop& loop, void (LeaveListener::*event)() noexcept);
};

}  // namespace forkpool::detail
