#pragma once
// CoreStream: a StreamState whose chunks run on a PoolCore. It keeps the core's count of open
// streams (opened when made, closed when its input ends or it is dropped) and sends a window's
// chunks as one batch. Subclasses say only how to make the next chunk (submit_chunk).

#include <memory>
#include <utility>

#include <forkpool/pool/internal/pool_core.hpp>
#include <forkpool/pool/internal/stream_state.hpp>

namespace forkpool::detail {

template <class R>
class CoreStream : public StreamState<R> {
 public:
  // Throws PoolClosed after the core's close() or terminate() (PoolCore::stream_opened).
  CoreStream(std::shared_ptr<PoolCore> core, bool ordered, std::size_t window, bool bound_unconsumed)
      : StreamState<R>(ordered, window, bound_unconsumed), core_(std::move(core)) {
    core_->stream_opened();
  }
  ~CoreStream() override { end_input(); }
  CoreStream(const CoreStream&) = delete;
  CoreStream& operator=(const CoreStream&) = delete;

  void hold_submits() override { core_->hold_sends(); }
  void release_submits() override { core_->release_sends(); }
  void check_consumer(const char* who) const override { core_->check_owner(who); }

 protected:
  PoolCore& core() const { return *core_; }
  // Nothing more will be submitted: the core may retire workers once no stream is open.
  void end_input() {
    if (std::exchange(open_, false)) core_->stream_closed();
  }

 private:
  std::shared_ptr<PoolCore> core_;
  bool open_ = true;
};

}  // namespace forkpool::detail
