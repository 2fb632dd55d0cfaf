#pragma once
// What a submitted call gives back: CallResult (forkpool.pool's AsyncResult reads it) and
// ApplyResult, apply_async's result without callbacks, a plain CPython type.

#include <Python.h>
#include <pybind11/functional.h>
#include <pybind11/pybind11.h>

#include <exception>
#include <memory>
#include <optional>

#include <forkpool/forkpool.hpp>

#include "calls.hpp"
#include "plain_type.hpp"
#include "waits.hpp"

namespace forkpool_python {

namespace py = pybind11;
namespace fp = forkpool;

// One submitted call.
class CallResult {
 public:
  explicit CallResult(fp::AsyncResult<Message> result) : result_(std::move(result)) {}
  bool ready() const { return result_.ready(); }
  bool wait(std::optional<double> timeout) const {
    return wait_until_ready([this] { return result_.ready(); }, timeout, "forkpool AsyncResult.wait");
  }
  // The answer (pickle bytes, tensors); raises what the pool says went wrong (WorkerLost...).
  py::tuple get() const {
    Message answer = result_.get(std::chrono::nanoseconds::zero());
    return py::make_tuple(py::bytes(answer.first), std::move(answer.second));
  }
  void cancel() { result_.cancel(); }
  // Runs `callback()` on the pool's thread, inside the wait that sees it ready.
  void when_ready(py::function callback) {
    auto shared = std::make_shared<HeldWithGil>(std::move(callback));
    result_.add_done_callback([shared](fp::AsyncResult<Message>&) {
      py::gil_scoped_acquire gil;
      try {
        shared->object();
      } catch (py::error_already_set& error) {
        error.discard_as_unraisable("forkpool AsyncResult callback");
      }
    });
  }

 private:
  fp::AsyncResult<Message> result_;
};

// apply_async's result when it has no callbacks (forkpool.pool.ApplyResult's methods, in C++:
// no Python frame per call and no object for Python's collector to scan). The answer is
// unpickled once, by the first ready(), wait() or get() that finds it.
class ApplyResult {
 public:
  explicit ApplyResult(fp::AsyncResult<Message> result) : result_(std::move(result)) {}

  bool ready() { return settled(); }
  void wait(std::optional<double> timeout) {
    if (!settled() && wait_until_ready([this] { return result_.ready(); }, timeout, "forkpool AsyncResult.wait"))
      settled();
  }
  // The task's value; raises its exception, what the pool says went wrong (WorkerLost...), or
  // multiprocessing.TimeoutError when `timeout` passes first.
  py::object get(std::optional<double> timeout) {
    if (!settled()) {
      if (!wait_until_ready([this] { return result_.ready(); }, timeout, "forkpool AsyncResult.get")) raise_timeout();
      settled();
    }
    if (failure_) std::rethrow_exception(failure_);
    if (!ok_) raise_object(value_);
    return value_;
  }
  bool successful() {
    if (!settled()) throw py::value_error("<forkpool ApplyResult> not ready");
    return !failure_ && ok_;
  }
  void cancel() { result_.cancel(); }

 private:
  bool settled() {
    if (settled_) return true;
    if (!result_.ready()) return false;
    settled_ = true;
    Message answer;
    try {
      answer = result_.get(std::chrono::nanoseconds::zero());
    } catch (...) {
      failure_ = std::current_exception();
      return true;
    }
    try {
      Outcome outcome = outcome_of(std::move(answer));
      ok_ = outcome.ok;
      value_ = std::move(outcome.value);
    } catch (py::error_already_set& error) {  // the answer would not unpickle: get() raises that
      ok_ = false;
      value_ = error.value();
    }
    return true;
  }

  fp::AsyncResult<Message> result_;
  bool settled_ = false;
  bool ok_ = false;
  py::object value_;  // the value, or the exception (its __cause__ the worker's traceback)
  std::exception_ptr failure_;
};

// ApplyResult as Python sees it: a plain CPython type, not a pybind11 class. pybind11 registers
// each instance of its classes in a table, erases it at the end, and looks the class up by name
// on every return: a fifth of the parent's time in 100,000 apply_async calls (perf).
inline PyTypeObject* apply_result_type = nullptr;

// Calls `method` on the ApplyResult of `self`, turning what it throws into a Python exception.
template <class Method>
inline PyObject* call_on_apply_result(PyObject* self, Method method) {
  return guarded([&] { return method(value_of<ApplyResult>(self)); });
}

inline PyObject* apply_result_ready(PyObject* self, PyObject*) {
  return call_on_apply_result(self, [](ApplyResult& r) { return py::bool_(r.ready()); });
}
inline PyObject* apply_result_wait(PyObject* self, PyObject* const* args, Py_ssize_t count, PyObject* names) {
  return call_on_apply_result(self, [&](ApplyResult& r) {
    r.wait(timeout_argument(args, PyVectorcall_NARGS(count), names, "wait"));
    return py::none();
  });
}
inline PyObject* apply_result_get(PyObject* self, PyObject* const* args, Py_ssize_t count, PyObject* names) {
  return call_on_apply_result(
      self, [&](ApplyResult& r) { return r.get(timeout_argument(args, PyVectorcall_NARGS(count), names, "get")); });
}
inline PyObject* apply_result_successful(PyObject* self, PyObject*) {
  return call_on_apply_result(self, [](ApplyResult& r) { return py::bool_(r.successful()); });
}
inline PyObject* apply_result_cancel(PyObject* self, PyObject*) {
  return call_on_apply_result(self, [](ApplyResult& r) {
    r.cancel();
    return py::none();
  });
}

inline PyMethodDef apply_result_methods[] = {
    {"ready", apply_result_ready, METH_NOARGS, "True once the call has finished."},
    {"wait", as_method(apply_result_wait), METH_FASTCALL | METH_KEYWORDS,
     "wait(timeout=None): until the call has finished, or timeout seconds."},
    {"get", as_method(apply_result_get), METH_FASTCALL | METH_KEYWORDS,
     "get(timeout=None): the call's value; raises its exception, or multiprocessing.TimeoutError."},
    {"successful", apply_result_successful, METH_NOARGS,
     "Whether the call returned without raising; ValueError while not ready."},
    {"cancel", apply_result_cancel, METH_NOARGS, "Withdraws the call if it has not started (forkpool's own)."},
    {nullptr, nullptr, 0, nullptr},
};

inline PyType_Slot apply_result_slots[] = {
    {Py_tp_dealloc, reinterpret_cast<void*>(&dealloc_plain<ApplyResult>)},
    {Py_tp_methods, apply_result_methods},
    {Py_tp_doc, const_cast<char*>("The result of Pool.apply_async without callbacks.")},
    {0, nullptr},
};
inline PyType_Spec apply_result_spec = {"forkpool._forkpool.ApplyResult", sizeof(PlainObject<ApplyResult>), 0,
                                        Py_TPFLAGS_DEFAULT | Py_TPFLAGS_DISALLOW_INSTANTIATION, apply_result_slots};

// A new ApplyResult over `result`. With the GIL.
inline py::object make_apply_result(fp::AsyncResult<Message> result) {
  return make_plain<ApplyResult>(apply_result_type, std::move(result));
}

}  // namespace forkpool_python
