// forkpool._forkpool: the C++ pool under Python's forkpool.Pool.
//
// A Python call crosses as one forkpool task, run_call(payload): its pickle bytes, and the CPU
// tensors it holds beside them, out of band (forkpool-torch's codec: blocks of shared slabs, never
// bytes). The worker unpickles and runs it in forkpool._worker, and its answer crosses back the
// same way. What is better written in Python (pickling, chunks, results, exceptions) is in
// forkpool/*.py; this file holds the pool, the waits (the GIL released, Ctrl-C seen) and the
// interpreter's care around fork().
//
// Thread: a CorePool belongs to the thread that made it, as forkpool::Pool does; every call from
// another thread raises RuntimeError.

#include <Python.h>
#include <pybind11/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include <forkpool/forkpool.hpp>
#include <forkpool/runtime/internal/blocking_wait.hpp>
#include <forkpool/runtime/private/fork_hooks.hpp>
#include <forkpool/runtime/private/process.hpp>
#include <forkpool/torch.hpp>

namespace py = pybind11;
namespace fp = forkpool;

namespace {

// An answer (or a queue's item): the pickle, and the tensors it names by place.
using Message = std::pair<std::string, std::vector<at::Tensor>>;

// A call: how it runs (forkpool._worker's CALL, MAP, STARMAP), its function's pickle (empty when
// the function is pickled with the argument), the argument's pickle and the tensors it names.
using Call = std::tuple<int, std::string, std::string, std::vector<at::Tensor>>;

// How long a wait sleeps before it looks for a signal (Ctrl-C) with the GIL.
constexpr auto kSignalCheck = std::chrono::milliseconds(50);

// `module`.`name`, for a caller that looks it up once per process (a forked worker inherits it):
// kept for ever, since no destructor runs at a worker's exit.
py::handle kept_attribute(const char* module, const char* name) {
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
Outcome outcome_of(Message answer) {
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

Message to_message(const py::handle& answer) {
  auto pair = answer.cast<py::tuple>();
  return {pair[0].cast<std::string>(), pair[1].cast<std::vector<at::Tensor>>()};
}

// Whether pickle.dumps alone may pickle `values` (a list or a tuple): its items are all int,
// float, str, bytes, bool or None, whose pickles never hold a tensor or a buffer
// (forkpool._pickling.is_plain).
template <class Sequence>
bool is_plain_sequence(const Sequence& values) {
  for (py::handle item : values) {
    PyObject* o = item.ptr();
    if (!(PyLong_CheckExact(o) || PyFloat_CheckExact(o) || PyUnicode_CheckExact(o) || PyBytes_CheckExact(o) ||
          PyBool_Check(o) || o == Py_None))
      return false;
  }
  return true;
}

// pickle.dumps(obj, 5).
std::string pickle_plain(const py::handle& obj) {
  static py::handle dumps = kept_attribute("pickle", "dumps");
  return dumps(obj, 5).cast<std::string>();
}

// Whether `value` is one of is_plain_sequence's types, or a short tuple or list of them.
bool is_plain_value(const py::handle& value) {
  PyObject* o = value.ptr();
  if (PyTuple_CheckExact(o) || PyList_CheckExact(o))
    return PySequence_Fast_GET_SIZE(o) <= 8 && is_plain_sequence(py::reinterpret_borrow<py::sequence>(value));
  return is_plain_sequence(py::make_tuple(value));
}

// A worker's functions by their pickle, unpickled once (forkpool._worker._function, here for
// apply's calls).
py::handle function_of(const std::string& pickled) {
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
py::object run_kind(int kind, const py::handle& function, const py::object& argument) {
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
Message run_plain_call(int kind, const std::string& function, const std::string& argument) {
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
Message run_call(Call call) {
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

// The interpreter around forkpool's forks, as os.fork() does it: the forking thread takes the
// GIL and the interpreter's locks, and the child repairs its state (one thread, locks new).
PyGILState_STATE fork_gil_state;
void before_fork() noexcept {
  fork_gil_state = PyGILState_Ensure();
  PyOS_BeforeFork();
}
void after_fork_in_parent() noexcept {
  PyOS_AfterFork_Parent();
  PyGILState_Release(fork_gil_state);
}
void after_fork_in_child() noexcept {
  PyOS_AfterFork_Child();
  // Releases the GIL and keeps the thread state (a task takes it again: run_call). Releasing the
  // state would delete it when before_fork made it (a fork from a thread Python did not start:
  // the Executor's), and CPython 3.11 cannot make a new one in a child with none left.
  PyEval_SaveThread();
}

fp::StartMethod start_method_of(const std::string& name) {
  if (name == "fork") return fp::StartMethod::fork;
  if (name == "forkserver") return fp::StartMethod::forkserver;
  if (name == "spawn") return fp::StartMethod::spawn;
  throw py::value_error("forkpool: unknown start method '" + name + "' (fork, forkserver, spawn)");
}

// A worker's setup (forkpool._worker.initialize): a plain function with its bytes, so that a
// spawned worker (a fresh interpreter) gets it too.
void run_python_initializer(std::string_view setup) {
  py::gil_scoped_acquire gil;
  static py::handle initialize = worker_function("initialize");
  initialize(py::bytes(setup.data(), setup.size()));
}

std::chrono::nanoseconds seconds(double value) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::duration<double>(value));
}

// Calls `attempt(slice)` with the GIL released until it succeeds or `timeout` (seconds; None:
// for ever) passes, looking for signals between slices of at most kSignalCheck: Ctrl-C ends the
// wait at once (KeyboardInterrupt). The waits of pools and queues.
template <class Attempt>
bool in_slices(std::optional<double> timeout, Attempt attempt) {
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
bool wait_until_ready(const std::function<bool()>& ready, std::optional<double> timeout, const char* who) {
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
struct ApplyResultObject {
  PyObject_HEAD ApplyResult result;  // built in place (make_apply_result), destroyed in dealloc
};
PyTypeObject* apply_result_type = nullptr;

// Raises a C++ exception in Python as pybind11 would (its registered translators: WorkerLost,
// TimeoutError...), by calling a function pybind11 wraps that rethrows it. Returns null.
PyObject* raise_cpp_exception(std::exception_ptr error) {
  static py::handle rethrow = py::cpp_function([](std::uintptr_t error) {
                                std::rethrow_exception(*reinterpret_cast<std::exception_ptr*>(error));
                              }).release();
  py::object address = py::int_(reinterpret_cast<std::uintptr_t>(&error));
  PyObject* none = PyObject_CallOneArg(rethrow.ptr(), address.ptr());
  Py_XDECREF(none);  // (never: it always raises)
  return nullptr;
}

// Calls `method` on the ApplyResult of `self`, turning what it throws into a Python exception.
template <class Method>
PyObject* call_on_apply_result(PyObject* self, Method method) {
  try {
    return method(reinterpret_cast<ApplyResultObject*>(self)->result).release().ptr();
  } catch (py::error_already_set& error) {
    error.restore();
    return nullptr;
  } catch (...) {
    return raise_cpp_exception(std::current_exception());
  }
}

// The `timeout` of wait(timeout=None) and get(timeout=None), by place or keyword (METH_FASTCALL |
// METH_KEYWORDS); throws TypeError (error_already_set) for anything else.
std::optional<double> timeout_argument(PyObject* const* args, Py_ssize_t count, PyObject* names, const char* method) {
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

PyObject* apply_result_ready(PyObject* self, PyObject*) {
  return call_on_apply_result(self, [](ApplyResult& r) { return py::bool_(r.ready()); });
}
PyObject* apply_result_wait(PyObject* self, PyObject* const* args, Py_ssize_t count, PyObject* names) {
  return call_on_apply_result(self, [&](ApplyResult& r) {
    r.wait(timeout_argument(args, PyVectorcall_NARGS(count), names, "wait"));
    return py::none();
  });
}
PyObject* apply_result_get(PyObject* self, PyObject* const* args, Py_ssize_t count, PyObject* names) {
  return call_on_apply_result(
      self, [&](ApplyResult& r) { return r.get(timeout_argument(args, PyVectorcall_NARGS(count), names, "get")); });
}
PyObject* apply_result_successful(PyObject* self, PyObject*) {
  return call_on_apply_result(self, [](ApplyResult& r) { return py::bool_(r.successful()); });
}
PyObject* apply_result_cancel(PyObject* self, PyObject*) {
  return call_on_apply_result(self, [](ApplyResult& r) {
    r.cancel();
    return py::none();
  });
}

void apply_result_dealloc(PyObject* self) {
  PyTypeObject* type = Py_TYPE(self);
  reinterpret_cast<ApplyResultObject*>(self)->result.~ApplyResult();
  type->tp_free(self);
  Py_DECREF(type);  // a heap type: each instance holds a reference
}

PyMethodDef apply_result_methods[] = {
    {"ready", apply_result_ready, METH_NOARGS, "True once the call has finished."},
    {"wait", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(apply_result_wait)),
     METH_FASTCALL | METH_KEYWORDS, "wait(timeout=None): until the call has finished, or timeout seconds."},
    {"get", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(apply_result_get)),
     METH_FASTCALL | METH_KEYWORDS,
     "get(timeout=None): the call's value; raises its exception, or multiprocessing.TimeoutError."},
    {"successful", apply_result_successful, METH_NOARGS,
     "Whether the call returned without raising; ValueError while not ready."},
    {"cancel", apply_result_cancel, METH_NOARGS, "Withdraws the call if it has not started (forkpool's own)."},
    {nullptr, nullptr, 0, nullptr},
};

PyType_Slot apply_result_slots[] = {
    {Py_tp_dealloc, reinterpret_cast<void*>(apply_result_dealloc)},
    {Py_tp_methods, apply_result_methods},
    {Py_tp_doc, const_cast<char*>("The result of Pool.apply_async without callbacks.")},
    {0, nullptr},
};
PyType_Spec apply_result_spec = {"forkpool._forkpool.ApplyResult", sizeof(ApplyResultObject), 0,
                                 Py_TPFLAGS_DEFAULT | Py_TPFLAGS_DISALLOW_INSTANTIATION, apply_result_slots};

// A new ApplyResult over `result`. With the GIL.
py::object make_apply_result(fp::AsyncResult<Message> result) {
  PyObject* self = apply_result_type->tp_alloc(apply_result_type, 0);
  if (!self) throw py::error_already_set();
  new (&reinterpret_cast<ApplyResultObject*>(self)->result) ApplyResult(std::move(result));
  return py::reinterpret_steal<py::object>(self);
}

// A pool's options from Python's arguments (seconds as doubles; setup: the pickle
// forkpool._worker.initialize takes, whose exceptions fail the worker).
fp::PoolOptions pool_options(int processes, int maxtasksperchild, const std::optional<py::bytes>& setup,
                             const std::string& start_method, int max_retries, double task_timeout, std::uint64_t seed,
                             std::optional<double> spin) {
  fp::PoolOptions options;
  options.processes = processes;
  options.maxtasksperchild = maxtasksperchild;
  options.start_method = start_method_of(start_method);
  options.max_retries = max_retries;
  options.task_timeout = seconds(task_timeout);
  options.seed = seed;
  if (spin) options.spin = seconds(*spin);
  if (setup) options.initializer = fp::Initializer::with_bytes(&run_python_initializer, std::string(*setup));
  return options;
}

// Pickles apply_async's calls, func(*args, **kwds), as Pool._pickle_call does, in C++: a
// function pickled by reference as its kept pickle (kept here, by the function, held;
// forkpool._pickling says which functions those are), plain arguments by pickle.dumps, anything
// else by forkpool._pickling. With the GIL.
class ApplyCallPickler {
 public:
  Call pickle(const py::object& func, const py::object& args, const py::object& kwds) {
    static py::handle pickled_function = kept_attribute("forkpool._pickling", "pickled_function");
    static py::handle dumps = kept_attribute("forkpool._pickling", "dumps");
    std::string function;
    if (auto kept = function_pickles_.find(func.ptr()); kept != function_pickles_.end()) {
      function = kept->second.second;
    } else if (py::object pickled = pickled_function(func); !pickled.is_none()) {
      function = pickled.cast<std::string>();
      if (function_pickles_.size() >= kFunctionsKept) function_pickles_.clear();
      function_pickles_.emplace(func.ptr(), std::make_pair(func, function));
    }
    py::tuple argument = py::make_tuple(args, kwds);
    bool plain = PyTuple_CheckExact(args.ptr()) && is_plain_sequence(py::reinterpret_borrow<py::tuple>(args)) &&
                 (kwds.is_none() || (PyDict_CheckExact(kwds.ptr()) && PyDict_GET_SIZE(kwds.ptr()) == 0));
    if (!function.empty() && plain) return Call{kCall, std::move(function), pickle_plain(argument), {}};
    py::tuple pickled = dumps(function.empty() ? py::make_tuple(func, argument) : py::object(argument));
    return Call{kCall, std::move(function), pickled[0].cast<std::string>(), pickled[1].cast<std::vector<at::Tensor>>()};
  }

 private:
  static constexpr std::size_t kFunctionsKept = 4096;
  std::unordered_map<PyObject*, std::pair<py::object, std::string>> function_pickles_;
};

class CorePool {
 public:
  CorePool(int processes, int maxtasksperchild, std::optional<py::bytes> setup, const std::string& start_method,
           int max_retries, double task_timeout, std::uint64_t seed, std::optional<double> spin) {
    pool_.emplace(
        pool_options(processes, maxtasksperchild, setup, start_method, max_retries, task_timeout, seed, spin));
  }

  CallResult submit(int kind, const py::bytes& function, const py::bytes& argument, std::vector<at::Tensor> tensors) {
    return CallResult(send(kind, function, argument, std::move(tensors)));
  }
  // apply_async(func, args, kwds) without callbacks (ApplyCallPickler).
  py::object apply_call(const py::object& func, const py::object& args, const py::object& kwds) {
    return make_apply_result(send(pickler_.pickle(func, args, kwds)));
  }

  void close() { pool().close(); }
  void terminate() {
    py::gil_scoped_release nogil;  // (callbacks of failed results take it)
    pool().terminate();
  }
  // Waits until every worker has exited (after close() or terminate()). A wait that Ctrl-C ends
  // goes on at the next join().
  void join() {
    if (!joining_) {
      joining_.emplace(pool().join());
      joining_->handle().resume();
    }
    wait_until_ready([this] { return joining_->handle().done(); }, std::nullopt, "forkpool Pool.join");
    joining_->handle().promise().take();
  }
  int processes() { return pool().processes(); }
  std::vector<pid_t> worker_pids() { return pool().worker_pids(); }

  // Sends a call (see Call).
  fp::AsyncResult<Message> send(int kind, std::string function, std::string argument, std::vector<at::Tensor> tensors) {
    return send(Call{kind, std::move(function), std::move(argument), std::move(tensors)});
  }
  fp::AsyncResult<Message> send(Call call) { return pool().apply_async(run_call, std::move(call)); }

 private:
  fp::Pool& pool() { return *pool_; }
  ApplyCallPickler pickler_;
  std::optional<fp::Pool> pool_;
  std::optional<fp::Task<void>> joining_;  // declared after pool_: destroyed first
};

// imap's and imap_unordered's results (forkpool.IMapIterator): the input is read as the workers
// take it, at most `window` calls (chunks) ahead of what was handed out; CPython's reads it all
// at once. What the input raises is raised in its place: after the results before it (imap), or
// at once (imap_unordered, as CPython's). Pool thread only, as the pool.
class IMapIterator {
 public:
  IMapIterator(py::object core, int kind, std::string function, py::function pickle_chunk, py::iterator input,
               std::size_t chunksize, bool ordered, std::size_t window)
      : core_object_(std::move(core)),
        core_(core_object_.cast<CorePool*>()),
        kind_(kind),
        function_(std::move(function)),
        pickle_chunk_(std::move(pickle_chunk)),
        input_(std::move(input)),
        chunksize_(chunksize),
        ordered_(ordered),
        window_(window) {
    fill();
  }

  // The next value; StopIteration at the end, multiprocessing.TimeoutError when `timeout` passes
  // first, or what the call raised.
  py::object next(std::optional<double> timeout) {
    while (handed_out_ >= values_.size()) {
      fp::AsyncResult<Message> call = next_call(timeout);
      fill();
      Outcome outcome = outcome_of(call.get(std::chrono::nanoseconds::zero()));  // raises WorkerLost...
      if (!outcome.ok) raise_object(outcome.value);
      values_ = outcome.value.cast<py::list>();
      handed_out_ = 0;
    }
    return values_[handed_out_++];
  }

 private:
  std::size_t in_flight() const { return ordered_ ? pending_.size() : running_.size(); }

  void fill() {
    while (!exhausted_ && in_flight() < window_) {
      py::list chunk;
      for (std::size_t i = 0; i < chunksize_; ++i) {
        PyObject* item = PyIter_Next(input_.ptr());
        if (!item) break;
        chunk.append(py::reinterpret_steal<py::object>(item));
      }
      if (PyErr_Occurred()) {  // the input raised: its place is after the calls sent (a partial chunk is dropped)
        input_error_ = py::error_already_set().value();
        exhausted_ = true;
        return;
      }
      if (chunk.empty()) {
        exhausted_ = true;
        return;
      }
      std::string data;
      std::vector<at::Tensor> tensors;
      if (!function_.empty() && is_plain_sequence(chunk)) {
        data = pickle_plain(chunk);
      } else {
        py::tuple pickled = pickle_chunk_(chunk);
        data = pickled[0].cast<std::string>();
        tensors = pickled[1].cast<std::vector<at::Tensor>>();
      }
      fp::AsyncResult<Message> call = core_->send(kind_, function_, std::move(data), std::move(tensors));
      if (ordered_) {
        pending_.push_back(std::move(call));
      } else {
        std::uint64_t token = next_token_++;
        call.add_done_callback(
            [finished = finished_, token](fp::AsyncResult<Message>&) { finished->push_back(token); });
        running_.emplace(token, std::move(call));
      }
    }
  }

  fp::AsyncResult<Message> next_call(std::optional<double> timeout) {
    if (ordered_) {
      if (pending_.empty()) raise_input_error_or_stop();
      fp::AsyncResult<Message>& front = pending_.front();
      if (!wait_until_ready([&] { return front.ready(); }, timeout, "forkpool IMapIterator.next")) raise_timeout();
      fp::AsyncResult<Message> call = std::move(front);
      pending_.pop_front();
      return call;
    }
    if (input_error_ || running_.empty()) raise_input_error_or_stop();  // CPython's: the error comes first
    if (!wait_until_ready([&] { return !finished_->empty(); }, timeout, "forkpool IMapIterator.next")) raise_timeout();
    auto found = running_.find(finished_->front());
    finished_->pop_front();
    fp::AsyncResult<Message> call = std::move(found->second);
    running_.erase(found);
    return call;
  }

  [[noreturn]] void raise_input_error_or_stop() {
    py::object error = std::exchange(input_error_, py::object());
    if (error) raise_object(error);
    throw py::stop_iteration();
  }

  py::object core_object_;  // keeps the pool alive while its results are awaited
  CorePool* core_;
  int kind_;
  std::string function_;
  py::function pickle_chunk_;
  py::iterator input_;
  std::size_t chunksize_;
  bool ordered_;
  std::size_t window_;
  bool exhausted_ = false;
  py::object input_error_;
  std::deque<fp::AsyncResult<Message>> pending_;                         // imap: the calls, in input order
  std::unordered_map<std::uint64_t, fp::AsyncResult<Message>> running_;  // imap_unordered: by token
  std::shared_ptr<std::deque<std::uint64_t>> finished_ = std::make_shared<std::deque<std::uint64_t>>();
  std::uint64_t next_token_ = 0;
  py::list values_;  // the chunk being handed out
  std::size_t handed_out_ = 0;
};

// forkpool.Executor's core: a pool on a C++ thread of its own, whose loop runs there (the pool
// belongs to it), fed by the program's threads, settling their concurrent.futures.Future objects
// with the GIL taken once for each batch of finished calls. Its calls are pickled by the thread
// that submits them.
//
// Threads: submit() and shutdown() from any thread, with the GIL. A future is set running only
// when its result is there (set_running_or_notify_cancel then set_result): until then cancel()
// succeeds, and the call's result is dropped.
class CoreExecutor {
 public:
  CoreExecutor(int processes, std::optional<py::bytes> setup, const std::string& start_method,
               std::optional<double> spin)
      : options_(pool_options(processes, 0, setup, start_method, 0, 0.0, 0, spin)), owner_(getpid()) {
    thread_ = std::make_unique<std::thread>([this] { serve(); });
    py::gil_scoped_release nogil;
    std::unique_lock lock(mutex_);
    changed_.wait(lock, [this] { return started_; });
    if (start_error_) {
      lock.unlock();
      thread_->join();
      std::rethrow_exception(start_error_);
    }
  }
  CoreExecutor(const CoreExecutor&) = delete;
  CoreExecutor& operator=(const CoreExecutor&) = delete;
  ~CoreExecutor() {
    if (getpid() != owner_) {  // a forked child: the thread is the parent's
      (void)thread_.release();
      return;
    }
    shutdown(true, false);
  }

  // Sends fn(*args, **kwargs); its outcome settles `future`.
  void submit(py::object future, const py::object& fn, const py::object& args, const py::object& kwargs) {
    Call call = pickler_.pickle(fn, args, kwargs);
    bool wake;
    {
      std::lock_guard lock(mutex_);
      if (stopping_) throw std::runtime_error("cannot schedule new futures after shutdown");
      wake = submitted_.empty();
      submitted_.push_back({future.release().ptr(), std::move(call)});
    }
    if (wake) loop_->post([this] { send_submitted(); });
  }

  // Lets the calls sent run to their end (cancel_futures: cancels their futures, and stops their
  // work); wait: returns once they have, and the workers are gone.
  void shutdown(bool wait, bool cancel_futures) {
    {
      std::lock_guard lock(mutex_);
      if (!stopping_ && loop_) {
        stopping_ = true;
        loop_->post([this, cancel_futures] {
          stop_requested_ = true;
          if (cancel_futures) cancel_running();
        });
      }
    }
    // (Not from the executor's own thread: a future's done callback that shuts it down.)
    if (wait && thread_ && thread_->joinable() && thread_->get_id() != std::this_thread::get_id()) {
      py::gil_scoped_release nogil;
      thread_->join();
    }
  }

 private:
  struct Submitted {
    PyObject* future;  // a reference of ours, let go of with the GIL
    Call call;
  };
  struct Running {
    PyObject* future;
    fp::AsyncResult<Message> result;
    bool cancelled = false;
  };

  // The executor's thread: makes the pool, then sends and settles until shut down.
  void serve() {
    try {
      loop_ = &fp::Loop::current();
      pool_.emplace(options_);
    } catch (...) {
      std::lock_guard lock(mutex_);
      start_error_ = std::current_exception();
      started_ = true;
      changed_.notify_all();
      return;
    }
    {
      std::lock_guard lock(mutex_);
      started_ = true;
      changed_.notify_all();
    }
    for (;;) {
      fp::detail::drive_loop_until([this] { return !finished_.empty() || (stop_requested_ && running_.empty()); },
                                   std::nullopt, "forkpool Executor");
      if (!finished_.empty()) settle();
      if (stop_requested_ && running_.empty()) {
        std::lock_guard lock(mutex_);
        if (submitted_.empty()) break;
      }
    }
    pool_->close();
    fp::run(pool_->join());
    pool_.reset();
  }

  // On the executor's thread, in a turn of its loop: sends what was submitted.
  void send_submitted() {
    std::vector<Submitted> taken;
    {
      std::lock_guard lock(mutex_);
      taken.swap(submitted_);
    }
    for (Submitted& s : taken) {
      std::uint64_t token = next_token_++;
      fp::AsyncResult<Message> result = pool_->apply_async(run_call, std::move(s.call));
      result.add_done_callback([this, token](fp::AsyncResult<Message>&) { finished_.push_back(token); });
      running_.emplace(token, Running{s.future, std::move(result)});
    }
  }

  void cancel_running() {
    for (auto& [token, running] : running_) {
      running.cancelled = true;
      running.result.cancel();
    }
  }

  // Settles the futures of the calls finished, with the GIL.
  void settle() {
    std::vector<std::uint64_t> tokens = std::exchange(finished_, {});
    py::gil_scoped_acquire gil;
    for (std::uint64_t token : tokens) {
      auto found = running_.find(token);
      Running running = std::move(found->second);
      running_.erase(found);
      py::object future = py::reinterpret_steal<py::object>(running.future);
      try {
        if (running.cancelled) future.attr("cancel")();
        if (!future.attr("set_running_or_notify_cancel")().cast<bool>()) continue;  // cancelled
        py::object value;
        bool ok = false;
        try {
          Outcome outcome = outcome_of(running.result.get(std::chrono::nanoseconds::zero()));
          ok = outcome.ok;
          value = std::move(outcome.value);
        } catch (py::error_already_set& error) {
          value = error.value();
        } catch (...) {  // WorkerLost, PoolTerminated...: as Python raises them
          value = python_exception(std::current_exception());
        }
        future.attr(ok ? "set_result" : "set_exception")(value);
      } catch (py::error_already_set& error) {  // a done callback's, say: not ours to raise
        error.discard_as_unraisable("forkpool Executor");
      }
    }
  }

  // The Python exception pybind11's translators make of a C++ one.
  static py::object python_exception(std::exception_ptr error) {
    py::cpp_function thrower([error] { std::rethrow_exception(error); });
    try {
      thrower();
    } catch (py::error_already_set& raised) {
      return raised.value();
    }
    return py::none();
  }

  fp::PoolOptions options_;
  pid_t owner_;
  ApplyCallPickler pickler_;
  std::mutex mutex_;  // guards what other threads touch: submitted_, stopping_, started_, start_error_
  std::condition_variable changed_;
  bool started_ = false;
  std::exception_ptr start_error_;
  bool stopping_ = false;
  std::vector<Submitted> submitted_;
  fp::Loop* loop_ = nullptr;  // the executor thread's, once it runs
  // The executor thread's own:
  std::optional<fp::Pool> pool_;
  bool stop_requested_ = false;
  std::unordered_map<std::uint64_t, Running> running_;
  std::vector<std::uint64_t> finished_;
  std::uint64_t next_token_ = 0;
  std::unique_ptr<std::thread> thread_;  // last: started in the constructor, after the rest
};

// forkpool.Queue's core: a forkpool Queue of messages. A process forked after it was made (a
// Process, a pool's worker) has it too.
class CoreQueue {
 public:
  explicit CoreQueue(std::size_t maxsize) : queue_(maxsize) {}

  // False when the queue stayed full until `timeout` (None: for ever; 0: put_nowait).
  bool put(const py::bytes& payload, std::vector<at::Tensor> tensors, std::optional<double> timeout) {
    Message item{std::string(payload), std::move(tensors)};
    return in_slices(timeout, [&](std::chrono::nanoseconds slice) { return queue_.put(item, slice); });
  }
  // The item, or None when the queue stayed empty until `timeout` (None: for ever; 0: get_nowait).
  std::optional<py::tuple> get(std::optional<double> timeout) {
    std::optional<Message> item;
    in_slices(timeout, [&](std::chrono::nanoseconds slice) { return (item = queue_.get(slice)).has_value(); });
    if (!item) return std::nullopt;
    return py::make_tuple(py::bytes(item->first), std::move(item->second));
  }
  std::size_t qsize() const { return queue_.qsize(); }
  std::size_t maxsize() const { return queue_.maxsize(); }
  void close() { queue_.close(); }

 private:
  fp::Queue<Message> queue_;
};

// Raises C++'s `Error` in Python as forkpool.`name` (a new exception class of the module). The
// class is never destroyed: at exit the interpreter may be gone before static destructors run
// (pybind11's register_exception keeps a static one, which crashed there).
template <class Error>
void register_error(py::module_& m, const char* name) {
  static auto& type = *new py::exception<Error>(m, name);
  py::register_exception_translator([](std::exception_ptr error) {
    try {
      if (error) std::rethrow_exception(error);
    } catch (const Error& e) {
      type(e.what());
    }
  });
}

}  // namespace

PYBIND11_MODULE(_forkpool, m) {
  m.doc() = "forkpool's C++ pool, for forkpool.Pool";
  fp::detail::set_fork_hooks({.prepare = before_fork, .parent = after_fork_in_parent, .child = after_fork_in_child});

  register_error<fp::WorkerLost>(m, "WorkerLost");
  register_error<fp::PoolTerminated>(m, "PoolTerminated");
  register_error<fp::Cancelled>(m, "Cancelled");
  register_error<fp::InitializerError>(m, "InitializerError");
  register_error<fp::ProtocolError>(m, "ProtocolError");
  register_error<fp::PoolClosed>(m, "PoolClosed");
  py::register_exception_translator([](std::exception_ptr error) {
    try {
      if (error) std::rethrow_exception(error);
    } catch (const fp::TimeoutError& e) {  // task_timeout: the task ran too long
      static py::handle timeout_error = kept_attribute("multiprocessing", "TimeoutError");
      PyErr_SetString(timeout_error.ptr(), e.what());
    }
  });

  py::class_<CallResult>(m, "CallResult")
      .def("ready", &CallResult::ready)
      .def("wait", &CallResult::wait, py::arg("timeout") = py::none())
      .def("get", &CallResult::get)
      .def("cancel", &CallResult::cancel)
      .def("when_ready", &CallResult::when_ready);

  apply_result_type = reinterpret_cast<PyTypeObject*>(PyType_FromSpec(&apply_result_spec));
  if (!apply_result_type) throw py::error_already_set();
  m.add_object("ApplyResult", py::handle(reinterpret_cast<PyObject*>(apply_result_type)));  // (kept for ever)

  py::class_<IMapIterator>(m, "IMapIterator")
      .def("__iter__", [](py::object self) { return self; })
      .def("__next__", [](IMapIterator& self) { return self.next(std::nullopt); })
      .def("next", &IMapIterator::next, py::arg("timeout") = py::none());

  py::class_<CorePool>(m, "CorePool")
      .def(py::init<int, int, std::optional<py::bytes>, const std::string&, int, double, std::uint64_t,
                    std::optional<double>>(),
           py::arg("processes"), py::arg("maxtasksperchild"), py::arg("setup"), py::arg("start_method"),
           py::arg("max_retries"), py::arg("task_timeout"), py::arg("seed"), py::arg("spin"))
      .def("submit", &CorePool::submit)
      .def("apply_call", &CorePool::apply_call)
      .def(
          "imap",
          [](py::object core, int kind, std::string function, py::function pickle_chunk, py::iterator input,
             std::size_t chunksize, bool ordered, std::size_t window) {
            return IMapIterator(std::move(core), kind, std::move(function), std::move(pickle_chunk), std::move(input),
                                chunksize, ordered, window);
          },
          py::arg("kind"), py::arg("function"), py::arg("pickle_chunk"), py::arg("input"), py::arg("chunksize"),
          py::arg("ordered"), py::arg("window"))
      .def("close", &CorePool::close)
      .def("terminate", &CorePool::terminate)
      .def("join", &CorePool::join)
      .def_property_readonly("processes", &CorePool::processes)
      .def("worker_pids", &CorePool::worker_pids);

  py::class_<CoreExecutor>(m, "CoreExecutor")
      .def(py::init<int, std::optional<py::bytes>, const std::string&, std::optional<double>>(), py::arg("processes"),
           py::arg("setup"), py::arg("start_method"), py::arg("spin"))
      .def("submit", &CoreExecutor::submit)
      .def("shutdown", &CoreExecutor::shutdown, py::arg("wait"), py::arg("cancel_futures"));

  py::class_<CoreQueue>(m, "CoreQueue")
      .def(py::init<std::size_t>(), py::arg("maxsize"))
      .def("put", &CoreQueue::put, py::arg("payload"), py::arg("tensors"), py::arg("timeout"))
      .def("get", &CoreQueue::get, py::arg("timeout"))
      .def("qsize", &CoreQueue::qsize)
      .def_property_readonly("maxsize", &CoreQueue::maxsize)
      .def("close", &CoreQueue::close);

  m.def(
      "set_spawn_program", [](std::vector<std::string> command) { fp::detail::set_spawn_program(std::move(command)); },
      "The command (executable first) a pool's spawned worker runs: forkpool._spawn.spawn_command().");
  m.def(
      "serve_spawned",
      [] {
        {
          py::gil_scoped_release nogil;  // tasks and the initializer take it
          fp::init();                    // a spawned worker serves here and never returns
        }
        throw std::runtime_error("forkpool: this process is not a spawned worker (forkpool._spawn.serve)");
      },
      "In a spawned worker: serves its pool's tasks and never returns.");
  m.def(
      "share_memory_",
      [](at::Tensor tensor) {
        fp::torch::share_memory(tensor);
        return tensor;
      },
      "Moves a CPU tensor's storage into forkpool's shared memory in place (as Tensor.share_memory_()).");
  m.def(
      "in_pool_worker", [] { return fp::worker_info().has_value(); },
      "Whether this process is a pool's worker (it closed the descriptors it inherited).");
  m.def(
      "worker_info",
      []() -> std::optional<py::tuple> {
        std::optional<fp::WorkerInfo> info = fp::worker_info();
        if (!info) return std::nullopt;
        return py::make_tuple(info->id, info->num_workers, info->seed);
      },
      "In a pool's worker: (id, num_workers, seed); else None.");
  m.def("is_shared", [](const at::Tensor& tensor) { return fp::torch::is_shared(tensor); });
  m.def(
      "empty_bytes", [](std::int64_t bytes) { return fp::torch::empty({bytes}, at::TensorOptions().dtype(at::kByte)); },
      "A new uint8 tensor of `bytes` in forkpool's shared memory (its contents are whatever was there).");
}
