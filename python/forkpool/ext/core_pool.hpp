#pragma once
// CorePool: the C++ pool under forkpool.Pool, its options from Python's arguments, and the
// pickler of apply_async's calls.

#include <Python.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include <forkpool/forkpool.hpp>

#include "calls.hpp"
#include "results.hpp"
#include "waits.hpp"

namespace forkpool_python {

namespace py = pybind11;
namespace fp = forkpool;

inline fp::StartMethod start_method_of(const std::string& name) {
  if (name == "fork") return fp::StartMethod::fork;
  if (name == "forkserver") return fp::StartMethod::forkserver;
  if (name == "spawn") return fp::StartMethod::spawn;
  throw py::value_error("forkpool: unknown start method '" + name + "' (fork, forkserver, spawn)");
}

// A worker's setup (forkpool._worker.initialize): a plain function with its bytes, so that a
// spawned worker (a fresh interpreter) gets it too.
inline void run_python_initializer(std::string_view setup) {
  py::gil_scoped_acquire gil;
  static py::handle initialize = worker_function("initialize");
  initialize(py::bytes(setup.data(), setup.size()));
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

}  // namespace forkpool_python
