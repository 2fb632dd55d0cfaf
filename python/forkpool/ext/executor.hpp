#pragma once
// forkpool.Executor's core: a pool on a C++ thread of its own.

#include <Python.h>
#include <pybind11/pybind11.h>

#include <cstddef>
#include <optional>
#include <string>
#include <utility>
#include <vector>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>

#include <forkpool/forkpool.hpp>

#include "calls.hpp"
#include "core_pool.hpp"
#include "waits.hpp"

namespace forkpool_python {

namespace py = pybind11;
namespace fp = forkpool;

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

}  // namespace forkpool_python
