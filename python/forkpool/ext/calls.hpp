#pragma once
// A Python call as it crosses: the pickles and tensors of a call and of its answer, the helpers
// that pickle plain values in C++, and run_call, the task every call is in a worker.

#include <Python.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <forkpool/torch.hpp>

namespace forkpool_python {

namespace py = pybind11;
namespace fp = forkpool;

// An answer (or a queue's item): the pickle, and the tensors it names by place.
using Message = std::pair<std::string, std::vector<at::Tensor>>;

// A call: how it runs (forkpool._worker's CALL, MAP, STARMAP), its function's pickle (empty when
// the function is pickled with the argument), the argument's pickle and the tensors it names.
using Call = std::tuple<int, std::string, std::string, std::vector<at::Tensor>>;

// `module`.`name`, for a caller that looks it up once per process (a forked worker inherits it):
// kept for ever, since no destructor runs at a worker's exit.
inline py::handle kept_attribute(const char* module, const char* name) {
  return py::object(py::module_::import(module).attr(name)).release();
}

// forkpool._worker's function `name` (kept_attribute).
py::handle worker_function(const char* name) { return kept_attribute("forkpool._worker", name); }

// Raises `exception` (an exception object) in Python.
[[noreturn]] void raise_object(const py::handle& exception) {
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exception.ptr())), exception.ptr());
  throw py::error_already_set();
}

// An answer unpickled: the value, or the exception (its __cause__ the worker's traceback).
struct Outcome {
  bool ok;
  py::object value;
};
// forkpool._worker.outcome_of, in C++ for an answer without tensors that says "ok" (most): no
// Python frame per result.
inline Outcome outcome_of(Message answer) {
  static py::handle loads = kept_attribute("pickle", "loads");
  static py::handle loads_with_tensors = kept_attribute("forkpool._pickling", "loads");
  static py::handle settle = worker_function("settle");
  py::bytes data(answer.first);
  py::object outcome = answer.second.empty() ? loads(data) : loads_with_tensors(data, std::move(answer.second));
  if (PyTuple_CheckExact(outcome.ptr()) && PyTuple_GET_SIZE(outcome.ptr()) == 2) {
    PyObject* tag = PyTuple_GET_ITEM(outcome.ptr(), 0);
    if (PyUnicode_CheckExact(tag) && PyUnicode_CompareWithASCIIString(tag, "ok") == 0)
      return {true, py::reinterpret_borrow<py::object>(PyTuple_GET_ITEM(outcome.ptr(), 1))};
  }
  auto settled = py::reinterpret_steal<py::tuple>(settle(outcome).release());
  return {settled[0].cast<bool>(), settled[1]};
}

// Raises multiprocessing.TimeoutError: a wait's `timeout` passed first.
[[noreturn]] void raise_timeout() {
  static py::handle timeout_error = kept_attribute("multiprocessing", "TimeoutError");
  PyErr_SetNone(timeout_error.ptr());
  throw py::error_already_set();
}

inline Message to_message(const py::handle& answer) {
  auto pair = answer.cast<py::tuple>();
  return {pair[0].cast<std::string>(), pair[1].cast<std::vector<at::Tensor>>()};
}

// Whether pickle.dumps alone may pickle `values` (a list or a tuple): its items are all int,
// float, str, bytes, bool or None, whose pickles never hold a tensor or a buffer
// (forkpool._pickling.is_plain).
template <class Sequence>
inline bool is_plain_sequence(const Sequence& values) {
  for (py::handle item : values) {
    PyObject* o = item.ptr();
    if (!(PyLong_CheckExact(o) || PyFloat_CheckExact(o) || PyUnicode_CheckExact(o) || PyBytes_CheckExact(o) ||
          PyBool_Check(o) || o == Py_None))
      return false;
  }
  return true;
}

// pickle.dumps(obj, 5).
inline std::string pickle_plain(const py::handle& obj) {
  static py::handle dumps = kept_attribute("pickle", "dumps");
  return dumps(obj, 5).cast<std::string>();
}

// Whether `value` is one of is_plain_sequence's types, or a short tuple or list of them.
inline bool is_plain_value(const py::handle& value) {
  PyObject* o = value.ptr();
  if (PyTuple_CheckExact(o) || PyList_CheckExact(o))
    return PySequence_Fast_GET_SIZE(o) <= 8 && is_plain_sequence(py::reinterpret_borrow<py::sequence>(value));
  return is_plain_sequence(py::make_tuple(value));
}

// A worker's functions by their pickle, unpickled once (forkpool._worker._function, here for
// apply's calls).
inline py::handle function_of(const std::string& pickled) {
  static auto& kept = *new std::unordered_map<std::string, py::object>;  // (never destroyed: see register_error)
  if (auto found = kept.find(pickled); found != kept.end()) return found->second;
  static py::handle loads = kept_attribute("pickle", "loads");
  py::object function = loads(py::bytes(pickled));
  if (kept.size() >= 4096) kept.clear();
  return kept.emplace(pickled, std::move(function)).first->second;
}

// How a call runs its function (forkpool._worker's CALL, MAP, STARMAP).
enum CallKind { kCall = 0, kMap = 1, kStarmap = 2 };

// Runs `function` on `argument` as `kind` says (forkpool._worker._RUNNERS), with the GIL.
inline py::object run_kind(int kind, const py::handle& function, const py::object& argument) {
  auto checked = [](PyObject* result) {
    if (!result) throw py::error_already_set();
    return py::reinterpret_steal<py::object>(result);
  };
  if (kind == kCall) {  // (args, kwds)
    py::tuple job = argument;
    py::object args = job[0], kwds = job[1];
    if (!PyTuple_Check(args.ptr())) args = py::tuple(args);
    return checked(PyObject_Call(function.ptr(), args.ptr(), kwds.ptr()));
  }
  py::sequence chunk = argument;  // a chunk of map (items) or of starmap (argument tuples)
  py::list results(py::len(chunk));
  for (std::size_t i = 0; i < results.size(); ++i) {
    py::object item = chunk[i];
    if (kind == kStarmap && !PyTuple_Check(item.ptr())) item = py::tuple(item);
    PyObject* result = kind == kMap ? PyObject_CallOneArg(function.ptr(), item.ptr())
                                    : PyObject_Call(function.ptr(), item.ptr(), nullptr);
    PyList_SET_ITEM(results.ptr(), static_cast<Py_ssize_t>(i), checked(result).release().ptr());
  }
  return results;
}

// A call of a function pickled by reference, with no tensors: run without a Python frame of
// ours. Its outcome as forkpool._worker.run gives it; a value that is not plain (it may hold
// tensors) and an exception are answered by forkpool._worker.
inline Message run_plain_call(int kind, const std::string& function, const std::string& argument) {
  static py::handle loads = kept_attribute("pickle", "loads");
  static py::handle answer = worker_function("answer");
  py::object value;
  try {
    value = run_kind(kind, function_of(function), loads(py::bytes(argument)));
  } catch (py::error_already_set& error) {  // its traceback too: the text the caller sees
    py::object exception = error.value();
    if (error.trace()) PyException_SetTraceback(exception.ptr(), error.trace().ptr());
    return to_message(answer(exception, true));
  }
  bool plain = kind == kCall ? is_plain_value(value) : is_plain_sequence(py::reinterpret_borrow<py::list>(value));
  if (plain) return {pickle_plain(py::make_tuple("ok", value)), {}};
  return to_message(answer(value, false));
}

// The task every Python call is: runs in the worker, with the GIL.
inline Message run_call(Call call) {
  py::gil_scoped_acquire gil;
  static py::handle run = worker_function("run");
  auto& [kind, function, argument, tensors] = call;
  try {
    if (!function.empty() && tensors.empty() && kind >= kCall && kind <= kStarmap)
      return run_plain_call(kind, function, argument);
    return to_message(run(kind, py::bytes(function), py::bytes(argument), std::move(tensors)));
  } catch (py::error_already_set& error) {  // forkpool._worker.run catches what a call raises
    throw std::runtime_error(std::string("forkpool._worker.run failed: ") + error.what());
  }
}

}  // namespace forkpool_python
