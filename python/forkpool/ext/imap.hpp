#pragma once
// imap's and imap_unordered's iterator over a CorePool.

#include <Python.h>
#include <pybind11/pybind11.h>

#include <cstddef>
#include <optional>
#include <string>
#include <utility>
#include <vector>
#include <deque>
#include <memory>
#include <unordered_map>

#include <forkpool/forkpool.hpp>

#include "calls.hpp"
#include "core_pool.hpp"
#include "waits.hpp"

namespace forkpool_python {

namespace py = pybind11;
namespace fp = forkpool;

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

}  // namespace forkpool_python
