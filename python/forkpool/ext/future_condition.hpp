#pragma once
// FutureCondition: the condition of forkpool.Executor's futures. concurrent.futures.Future uses
// its threading.Condition (over an RLock) as a lock (with, acquire, release) and to wait for and
// announce its end (wait, notify_all). That Condition is eight objects the cyclic collector
// tracks (itself, its deque, five bound methods of its lock), so a Future is ten; with 100,000
// futures alive, the collector's passes over them were most of a submit's time, and making one
// (its __init__ in Python) a third of the rest. This is one untracked object that does the same.
//
// Threads: any, with the GIL. A wait (for the lock, or for a notification) releases the GIL and
// looks for signals between slices, so Ctrl-C ends it as it ends a wait on a threading.Condition.

#include <Python.h>
#include <pybind11/pybind11.h>

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <optional>

#include "plain_type.hpp"
#include "waits.hpp"

namespace forkpool_python {

class FutureCondition {
 public:
  // RLock.acquire: reentrant; false when not blocking (or after `timeout`) and another holds it.
  bool acquire(bool blocking, std::optional<double> timeout) {
    unsigned long me = PyThread_get_thread_ident();
    {
      std::lock_guard lock(mutex_);
      if (try_take(me, 1)) return true;
    }
    if (!blocking) return false;
    return in_slices(timeout, [&](std::chrono::nanoseconds slice) {
      std::unique_lock lock(mutex_);
      return freed_.wait_for(lock, slice, [&] { return try_take(me, 1); });
    });
  }

  // RLock.release: RuntimeError when this thread does not hold it.
  void release() {
    std::lock_guard lock(mutex_);
    check_held("release");
    if (--depth_ == 0) freed_.notify_one();
  }

  // Condition.wait: lets the lock go (however deep it is held), waits for a notify_all() or
  // `timeout`, takes the lock back as deep; true when notified. RuntimeError when not held.
  bool wait(std::optional<double> timeout) {
    unsigned long me = PyThread_get_thread_ident();
    std::size_t depth;
    std::uint64_t seen;
    {
      std::lock_guard lock(mutex_);
      check_held("wait on");
      depth = std::exchange(depth_, 0);
      seen = notifications_;
      freed_.notify_one();
    }
    bool notified = false;
    try {
      notified = in_slices(timeout, [&](std::chrono::nanoseconds slice) {
        std::unique_lock lock(mutex_);
        return notified_.wait_for(lock, slice, [&] { return notifications_ != seen; });
      });
    } catch (...) {  // Ctrl-C: the lock is held again when it propagates, as Condition.wait does
      take_back(me, depth);
      throw;
    }
    take_back(me, depth);
    return notified;
  }

  // Condition.notify_all (notify(n) too: every waiter rechecks what it waits for).
  void notify_all() {
    std::lock_guard lock(mutex_);
    check_held("notify on");
    ++notifications_;
    notified_.notify_all();
  }

 private:
  // Under mutex_.
  bool try_take(unsigned long me, std::size_t depth) {
    if (depth_ == 0) {
      owner_ = me;
      depth_ = depth;
      return true;
    }
    if (owner_ != me) return false;
    depth_ += depth;
    return true;
  }
  void check_held(const char* what) const {
    if (depth_ == 0 || owner_ != PyThread_get_thread_ident()) {
      PyErr_Format(PyExc_RuntimeError, "cannot %s un-acquired lock", what);
      throw py::error_already_set();
    }
  }
  // Takes the lock back `depth` deep, however long it waits (without the GIL, seeing no signal).
  void take_back(unsigned long me, std::size_t depth) {
    py::gil_scoped_release nogil;
    std::unique_lock lock(mutex_);
    freed_.wait(lock, [&] { return try_take(me, depth); });
  }

  std::mutex mutex_;
  std::condition_variable freed_;     // depth_ fell to 0
  std::condition_variable notified_;  // notifications_ rose
  unsigned long owner_ = 0;           // PyThread_get_thread_ident() of the holder, while depth_ > 0
  std::size_t depth_ = 0;
  std::uint64_t notifications_ = 0;
};

inline PyTypeObject* future_condition_type = nullptr;

inline PyObject* future_condition_new(PyTypeObject* type, PyObject* args, PyObject* kwds) {
  if (PyTuple_GET_SIZE(args) != 0 || (kwds && PyDict_GET_SIZE(kwds) != 0)) {
    PyErr_SetString(PyExc_TypeError, "FutureCondition() takes no arguments");
    return nullptr;
  }
  return guarded([&] { return make_plain<FutureCondition>(type); });
}

// acquire(blocking=True, timeout=-1), as RLock's (a negative timeout: for ever).
inline PyObject* future_condition_acquire(PyObject* self, PyObject* const* args, Py_ssize_t count, PyObject* names) {
  return guarded([&] {
    bool blocking = true;
    std::optional<double> timeout;
    Py_ssize_t keywords = names ? PyTuple_GET_SIZE(names) : 0;
    for (Py_ssize_t i = 0; i < count + keywords; ++i) {
      bool is_timeout = i == 1;
      if (i >= count) {
        PyObject* name = PyTuple_GET_ITEM(names, i - count);
        is_timeout = PyUnicode_CompareWithASCIIString(name, "timeout") == 0;
        if (!is_timeout && PyUnicode_CompareWithASCIIString(name, "blocking") != 0) {
          PyErr_Format(PyExc_TypeError, "acquire() got an unexpected keyword argument '%U'", name);
          throw py::error_already_set();
        }
      }
      if (i > 1) {
        PyErr_SetString(PyExc_TypeError, "acquire() takes at most 2 arguments");
        throw py::error_already_set();
      }
      if (is_timeout) {
        double seconds = PyFloat_AsDouble(args[i]);
        if (seconds == -1.0 && PyErr_Occurred()) throw py::error_already_set();
        if (seconds >= 0) timeout = seconds;
      } else {
        int truth = PyObject_IsTrue(args[i]);
        if (truth < 0) throw py::error_already_set();
        blocking = truth != 0;
      }
    }
    return py::bool_(value_of<FutureCondition>(self).acquire(blocking, timeout));
  });
}
inline PyObject* future_condition_enter(PyObject* self, PyObject*) {
  return guarded([&] { return py::bool_(value_of<FutureCondition>(self).acquire(true, std::nullopt)); });
}
inline PyObject* future_condition_release(PyObject* self, PyObject*) {
  return guarded([&] {
    value_of<FutureCondition>(self).release();
    return py::none();
  });
}
inline PyObject* future_condition_exit(PyObject* self, PyObject* const*, Py_ssize_t) {
  return future_condition_release(self, nullptr);
}
inline PyObject* future_condition_wait(PyObject* self, PyObject* const* args, Py_ssize_t count, PyObject* names) {
  return guarded(
      [&] { return py::bool_(value_of<FutureCondition>(self).wait(timeout_argument(args, count, names, "wait"))); });
}
inline PyObject* future_condition_notify_all(PyObject* self, PyObject* const*, Py_ssize_t) {
  return guarded([&] {
    value_of<FutureCondition>(self).notify_all();
    return py::none();
  });
}

inline PyMethodDef future_condition_methods[] = {
    {"acquire", as_method(future_condition_acquire), METH_FASTCALL | METH_KEYWORDS,
     "acquire(blocking=True, timeout=-1), as RLock's."},
    {"release", future_condition_release, METH_NOARGS, "release(), as RLock's."},
    {"__enter__", future_condition_enter, METH_NOARGS, nullptr},
    {"__exit__", as_method(future_condition_exit), METH_FASTCALL, nullptr},
    {"wait", as_method(future_condition_wait), METH_FASTCALL | METH_KEYWORDS,
     "wait(timeout=None), as Condition's: True when notified."},
    {"notify_all", as_method(future_condition_notify_all), METH_FASTCALL, "notify_all(), as Condition's."},
    {"notify", as_method(future_condition_notify_all), METH_FASTCALL,
     "notify(n=1): wakes every waiter (each rechecks what it waits for)."},
    {nullptr, nullptr, 0, nullptr},
};

inline PyType_Slot future_condition_slots[] = {
    {Py_tp_new, reinterpret_cast<void*>(future_condition_new)},
    {Py_tp_dealloc, reinterpret_cast<void*>(&dealloc_plain<FutureCondition>)},
    {Py_tp_methods, future_condition_methods},
    {Py_tp_doc, const_cast<char*>("The condition of forkpool.Executor's futures (threading.Condition's use "
                                  "by concurrent.futures.Future), untracked by the cyclic collector.")},
    {0, nullptr},
};
inline PyType_Spec future_condition_spec = {"forkpool._forkpool.FutureCondition", sizeof(PlainObject<FutureCondition>),
                                            0, Py_TPFLAGS_DEFAULT, future_condition_slots};

}  // namespace forkpool_python
