#pragma once
// forkpool.Queue's core: a forkpool::Queue of messages.

#include <Python.h>
#include <pybind11/pybind11.h>

#include <cstddef>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <forkpool/forkpool.hpp>

#include "calls.hpp"
#include "core_pool.hpp"
#include "waits.hpp"

namespace forkpool_python {

namespace py = pybind11;
namespace fp = forkpool;

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

}  // namespace forkpool_python
