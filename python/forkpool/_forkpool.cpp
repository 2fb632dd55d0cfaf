// forkpool._forkpool: the C++ pool under Python's forkpool.Pool.
//
// A Python call crosses as one forkpool task, run_call(payload): its pickle bytes, and the CPU
// tensors it holds beside them, out of band (forkpool-torch's codec: blocks of shared slabs, never
// bytes). The worker runs it (in C++ when it is a plain call of a function named by reference,
// else in forkpool._worker), and its answer crosses back the same way. What is better written in
// Python (pickling, chunks, results, exceptions) is in forkpool/*.py; the C++ is in ext/, one
// header per concept; this file holds the interpreter's care around fork(), the errors and the
// bindings.
//
// Thread: a CorePool belongs to the thread that made it, as forkpool::Pool does; every call from
// another thread raises RuntimeError.

#include <Python.h>
#include <pybind11/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <tuple>

#include <forkpool/forkpool.hpp>
#include <forkpool/runtime/private/fork_hooks.hpp>
#include <forkpool/runtime/private/process.hpp>
#include <forkpool/torch.hpp>

#include "ext/calls.hpp"
#include "ext/core_pool.hpp"
#include "ext/executor.hpp"
#include "ext/future_condition.hpp"
#include "ext/imap.hpp"
#include "ext/queue.hpp"
#include "ext/results.hpp"
#include "ext/waits.hpp"

namespace py = pybind11;
namespace fp = forkpool;

namespace forkpool_python {
namespace {

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
}  // namespace forkpool_python

using namespace forkpool_python;  // (the module's bindings below name its classes)

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

  // The plain types (ext/plain_type.hpp), kept for ever.
  for (auto [type, spec, name] : {std::tuple{&apply_result_type, &apply_result_spec, "ApplyResult"},
                                  std::tuple{&future_condition_type, &future_condition_spec, "FutureCondition"}}) {
    *type = reinterpret_cast<PyTypeObject*>(PyType_FromSpec(spec));
    if (!*type) throw py::error_already_set();
    m.add_object(name, py::handle(reinterpret_cast<PyObject*>(*type)));
  }

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
