#pragma once
// Plain CPython types over a C++ value (ApplyResult, FutureCondition): no pybind11 class, whose
// instances pybind11 registers in a table and looks up by name on every return (a fifth of the
// parent's time in 100,000 apply_async calls), and no object the cyclic collector tracks.

#include <Python.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <exception>
#include <new>
#include <optional>
#include <utility>

namespace forkpool_python {

namespace py = pybind11;

// A Python object holding a T in place: made by make_plain, destroyed by dealloc_plain.
template <class T>
struct PlainObject {
  PyObject_HEAD T value;
};
template <class T>
T& value_of(PyObject* self) {
  return reinterpret_cast<PlainObject<T>*>(self)->value;
}

// A new object of `type` (a heap type of PlainObject<T>) holding T(arguments...). With the GIL.
template <class T, class... Arguments>
py::object make_plain(PyTypeObject* type, Arguments&&... arguments) {
  PyObject* self = type->tp_alloc(type, 0);
  if (!self) throw py::error_already_set();
  try {
    new (&value_of<T>(self)) T(std::forward<Arguments>(arguments)...);
  } catch (...) {
    type->tp_free(self);
    Py_DECREF(type);
    throw;
  }
  return py::reinterpret_steal<py::object>(self);
}

template <class T>
void dealloc_plain(PyObject* self) {
  PyTypeObject* type = Py_TYPE(self);
  value_of<T>(self).~T();
  type->tp_free(self);
  Py_DECREF(type);  // a heap type: each instance holds a reference
}

// Raises a C++ exception in Python as pybind11 would (its registered translators: WorkerLost,
// TimeoutError...), by calling a function pybind11 wraps that rethrows it. Returns null.
inline PyObject* raise_cpp_exception(std::exception_ptr error) {
  static py::handle rethrow = py::cpp_function([](std::uintptr_t error) {
                                std::rethrow_exception(*reinterpret_cast<std::exception_ptr*>(error));
                              }).release();
  py::object address = py::int_(reinterpret_cast<std::uintptr_t>(&error));
  PyObject* none = PyObject_CallOneArg(rethrow.ptr(), address.ptr());
  Py_XDECREF(none);  // (never: it always raises)
  return nullptr;
}

// A METH_FASTCALL function as the PyCFunction a PyMethodDef holds.
template <class Function>
PyCFunction as_method(Function function) {
  return reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(function));
}

// Runs `body` (which returns a py::object) for a method of a plain type: what it throws becomes
// a Python exception and the method returns null.
template <class Body>
PyObject* guarded(Body body) {
  try {
    return body().release().ptr();
  } catch (py::error_already_set& error) {
    error.restore();
    return nullptr;
  } catch (...) {
    return raise_cpp_exception(std::current_exception());
  }
}

// The `timeout` of wait(timeout=None) and get(timeout=None), by place or keyword (METH_FASTCALL |
// METH_KEYWORDS); throws TypeError (error_already_set) for anything else.
inline std::optional<double> timeout_argument(PyObject* const* args, Py_ssize_t count, PyObject* names,
                                              const char* method) {
  Py_ssize_t keywords = names ? PyTuple_GET_SIZE(names) : 0;
  PyObject* timeout = nullptr;
  if (count + keywords > 1) {
    PyErr_Format(PyExc_TypeError, "%s() takes at most 1 argument (%zd given)", method, count + keywords);
    throw py::error_already_set();
  }
  if (count == 1) timeout = args[0];
  if (keywords == 1) {
    if (PyUnicode_CompareWithASCIIString(PyTuple_GET_ITEM(names, 0), "timeout") != 0) {
      PyErr_Format(PyExc_TypeError, "%s() got an unexpected keyword argument '%U'", method, PyTuple_GET_ITEM(names, 0));
      throw py::error_already_set();
    }
    timeout = args[0];
  }
  if (!timeout || timeout == Py_None) return std::nullopt;
  double seconds = PyFloat_AsDouble(timeout);
  if (seconds == -1.0 && PyErr_Occurred()) throw py::error_already_set();
  return seconds;
}

}  // namespace forkpool_python
