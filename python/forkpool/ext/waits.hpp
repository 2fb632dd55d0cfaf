#pragma once
// The waits of pools and queues: the GIL released, Ctrl-C seen.

#include <Python.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <optional>

#include <forkpool/runtime/internal/blocking_wait.hpp>

namespace forkpool_python {

namespace py = pybind11;
namespace fp = forkpool;

// How long a wait sleeps before it looks for a signal (Ctrl-C) with the GIL.
constexpr auto kSignalCheck = std::chrono::milliseconds(50);

inline std::chrono::nanoseconds seconds(double value) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::duration<double>(value));
}

// Calls `attempt(slice)` with the GIL released until it succeeds or `timeout` (seconds; None:
// for ever) passes, looking for signals between slices of at most kSignalCheck: Ctrl-C ends the
// wait at once (KeyboardInterrupt). The waits of pools and queues.
template <class Attempt>
inline bool in_slices(std::optional<double> timeout, Attempt attempt) {
  using Clock = std::chrono::steady_clock;
  // (At most a billion seconds: further is for ever, and would overflow the clock.)
  Clock::time_point deadline =
      timeout && *timeout < 1e9 ? Clock::now() + seconds(std::max(*timeout, 0.0)) : Clock::time_point::max();
  for (;;) {
    auto slice = std::min<Clock::duration>(deadline - Clock::now(), kSignalCheck);
    bool done;
    {
      py::gil_scoped_release nogil;
      done = attempt(std::max(std::chrono::nanoseconds(slice), std::chrono::nanoseconds::zero()));
    }
    if (done) return true;
    if (Clock::now() >= deadline) return false;
    if (PyErr_CheckSignals() != 0) throw py::error_already_set();
  }
}

// Drives the pool's loop until `ready()` or `timeout`.
inline bool wait_until_ready(const std::function<bool()>& ready, std::optional<double> timeout, const char* who) {
  if (ready()) return true;
  return in_slices(
      timeout, [&](std::chrono::nanoseconds slice) { return fp::detail::drive_owners_loop_until(ready, slice, who); });
}

// A Python object held by C++ that may let go of it without the GIL (the loop drops a callback
// after it ran, in a wait that released the GIL): it takes the GIL to let go.
struct HeldWithGil {
  explicit HeldWithGil(py::object held) : object(std::move(held)) {}
  HeldWithGil(const HeldWithGil&) = delete;
  HeldWithGil& operator=(const HeldWithGil&) = delete;
  ~HeldWithGil() {
    py::gil_scoped_acquire gil;
    object = py::object();
  }
  py::object object;
};

}  // namespace forkpool_python
