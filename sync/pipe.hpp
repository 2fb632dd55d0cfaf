#pragma once
// Pipe<T>(): two connected Connections, as multiprocessing.Pipe. Each send() is one message on
// an AF_UNIX SOCK_SEQPACKET socket (tensors ride as shared memory, their descriptors inside), so
// a receiver gets whole values only. A Connection is a handle: copies, and copies passed to
// other processes (as arguments of start_process, spawn and pool tasks, under every start
// method), are the same end.
//
//   auto [here, there] = forkpool::Pipe<std::string>();
//   forkpool::Process p = forkpool::start_process(echo, there);
//   here.send("ping");  here.recv();  // "pong"
//
// recv() throws ChannelClosed (Python's EOFError) once every copy of the other end, in every
// process, is closed or gone with its process, and nothing is left to read: close the ends a
// process does not use, as with Python's pipes. Any thread; one receiver at a time per process.

#include <poll.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include <forkpool/ipc/channel_closed.hpp>
#include <forkpool/ipc/codec.hpp>
#include <forkpool/ipc/internal/channel.hpp>
#include <forkpool/runtime/internal/shared_handle.hpp>
#include <forkpool/sync/queue.hpp>
#include <forkpool/runtime/task.hpp>

namespace forkpool {

// What recv() throws at the end (Python's EOFError), an Error: `catch (const forkpool::ChannelClosed&)`
// (ipc/channel_closed.hpp).

namespace detail {

// A Connection's end of the socket, shared by the copies of one process.
struct ConnectionEnd {
  ConnectionEnd(detail::Channel end, bool can_read, bool can_write)
      : channel(std::move(end)), readable(can_read), writable(can_write) {}
  detail::Channel channel;
  std::mutex receiving;  // the channel's receive buffer is one per channel
  bool readable, writable;
};

std::shared_ptr<ConnectionEnd> decode_connection(Reader& r);
void encode_connection(Writer& w, const std::shared_ptr<ConnectionEnd>& end);
void check_connection(const ConnectionEnd& end, bool for_sending);
// Whether a message (or the end of the other side) is waiting within `timeout`.
bool connection_poll(const ConnectionEnd& end, std::chrono::nanoseconds timeout);

}  // namespace detail

template <class T>
class Connection {
 public:
  void send(const T& value) {
    detail::check_connection(*end_, true);
    Writer item = detail::encode_item(value);
    end_->channel.send(kValue, 0, item.bytes(), item.fds());
  }
  // Blocks for the next value. Throws ChannelClosed at the end (see above). While it waits, the
  // thread's loop runs if it has work (a pool's tasks, one of which may be the sender).
  T recv() {
    detail::check_connection(*end_, false);
    for (;;) {
      {
        std::lock_guard turn(end_->receiving);
        if (std::optional<detail::Message> message = end_->channel.try_receive())
          return detail::decode_item<T>(*message);
      }
      detail::connection_poll(*end_, detail::kForever);  // unlocked: the loop may run a recv()
    }
  }
  // On the calling thread's loop; resumes inside the turn that received the value.
  Task<T> async_recv() {
    auto end = end_;
    detail::check_connection(*end, false);
    detail::Message message = co_await end->channel.async_receive();
    co_return detail::decode_item<T>(message);
  }
  // Whether recv() would return (or throw ChannelClosed) without waiting longer than `timeout`.
  bool poll(std::chrono::nanoseconds timeout = std::chrono::nanoseconds::zero()) const {
    return detail::connection_poll(*end_, timeout);
  }
  // This process's copies of this end stop: the other side reads to the end, then ChannelClosed.
  void close() { end_->channel = detail::Channel(UniqueFd()); }
  bool closed() const { return end_->channel.fd() < 0; }
  // Readable when a value (or the end) is waiting: for poll(2), or wait_ready() beside others.
  int fd() const { return end_->channel.fd(); }

 private:
  template <class U>
  friend std::pair<Connection<U>, Connection<U>> Pipe(bool duplex);
  friend struct codec<Connection<T>>;
  static constexpr std::uint16_t kValue = 1;
  explicit Connection(std::shared_ptr<detail::ConnectionEnd> end) : end_(std::move(end)) {}
  detail::SharedHandle<detail::ConnectionEnd, "Connection"> end_;
};

// Two connected ends. duplex false: the first only receives, the second only sends (Python's
// order); a call the end does not allow throws std::logic_error. Throws std::system_error.
template <class T>
std::pair<Connection<T>, Connection<T>> Pipe(bool duplex = true) {
  auto [first, second] = detail::Channel::make_pair();
  return {Connection<T>(std::make_shared<detail::ConnectionEnd>(std::move(first), true, duplex)),
          Connection<T>(std::make_shared<detail::ConnectionEnd>(std::move(second), duplex, true))};
}

// The descriptors of `fds` (Connection::fd(), Process::sentinel(), any other) that are
// readable, waiting up to `timeout` for one: multiprocessing.connection.wait.
std::vector<int> wait_ready(std::span<const int> fds,
                            std::chrono::nanoseconds timeout = std::chrono::nanoseconds::max());

template <class T>
struct codec<Connection<T>> {
  static constexpr std::size_t min_size = 2 + sizeof(std::uint32_t);
  static void encode(Writer& w, const Connection<T>& connection) {
    detail::encode_connection(w, connection.end_.shared());
  }
  static Connection<T> decode(Reader& r) { return Connection<T>(detail::decode_connection(r)); }
};

}  // namespace forkpool
