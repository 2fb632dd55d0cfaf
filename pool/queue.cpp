#include <forkpool/pool/queue.hpp>

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <climits>
#include <string>
#include <system_error>

#include <forkpool/pool/internal/fd_wait.hpp>
#include <forkpool/pool/internal/queue_memory.hpp>
#include <forkpool/runtime/error.hpp>
#include <forkpool/runtime/internal/errno.hpp>
#include <forkpool/runtime/internal/io.hpp>

namespace forkpool::detail {
namespace {

enum : std::uint16_t { kItem = 1 };

void check_socket(int fd) {
  int type = 0;
  socklen_t size = sizeof type;
  if (getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &size) != 0 || type != SOCK_SEQPACKET)
    throw ProtocolError("forkpool: a Queue's descriptor is not a SOCK_SEQPACKET socket");
}

void check_pipe(int fd) {
  struct stat st {};
  if (fstat(fd, &st) != 0 || !S_ISFIFO(st.st_mode)) throw ProtocolError("forkpool: a Queue's token descriptor is not a pipe");
}

}  // namespace

QueueCore::QueueCore(std::size_t maxsize)
    : maxsize_(maxsize), put_end_(UniqueFd()), get_end_(UniqueFd()) {
  auto [put_end, get_end] = Channel::make_pair();
  put_end_ = std::move(put_end);
  get_end_ = std::move(get_end);
  if (maxsize == 0) return;
  int ends[2];
  if (pipe2(ends, O_CLOEXEC | O_NONBLOCK) != 0) throw_last_errno("forkpool: Queue: pipe");
  tokens_out_ = UniqueFd(ends[0]);
  tokens_in_ = UniqueFd(ends[1]);
  if (maxsize > static_cast<std::size_t>(fcntl(ends[1], F_GETPIPE_SZ)) &&
      fcntl(ends[1], F_SETPIPE_SZ, static_cast<int>(std::min<std::size_t>(maxsize, INT_MAX))) < 0)
    throw std::invalid_argument("forkpool: Queue maxsize " + std::to_string(maxsize) +
                                " is more than a pipe can hold tokens for (see /proc/sys/fs/pipe-max-size)");
  std::string tokens(maxsize, 't');
  if (write(ends[1], tokens.data(), tokens.size()) != static_cast<ssize_t>(tokens.size()))
    throw_last_errno("forkpool: Queue: tokens");
}

QueueCore::QueueCore(std::size_t maxsize, UniqueFd put_end, UniqueFd get_end, UniqueFd tokens_out, UniqueFd tokens_in)
    : maxsize_(maxsize), put_end_(std::move(put_end)), get_end_(std::move(get_end)),
      tokens_out_(std::move(tokens_out)), tokens_in_(std::move(tokens_in)) {
  check_socket(put_end_.fd());
  check_socket(get_end_.fd());
  if (maxsize_ > 0) {
    check_pipe(tokens_out_.get());
    check_pipe(tokens_in_.get());
  }
}

void QueueCore::check_open() const {
  if (closed_) throw std::logic_error("forkpool: Queue::put after close() in this process");
}

// A bounded queue's free place. The token pipe is non-blocking: another producer may take
// the token poll() saw.
bool QueueCore::take_token(Deadline deadline) {
  if (maxsize_ == 0) return true;
  for (;;) {
    char token;
    if (read(tokens_out_.get(), &token, 1) == 1) return true;
    if (errno != EAGAIN && errno != EINTR) throw_last_errno("forkpool: Queue: take a place");
    if (!wait_for_fd(tokens_out_.get(), POLLIN, deadline, "forkpool: Queue::put")) return false;
  }
}

void QueueCore::give_token() {
  if (maxsize_ == 0) return;
  char token = 't';
  while (write(tokens_in_.get(), &token, 1) < 0 && errno == EINTR) {
  }
}

bool QueueCore::put(const Writer& item, Deadline deadline) {
  check_open();
  if (!take_token(deadline)) return false;
  try {
    put_end_.send(kItem, 0, item.bytes(), item.fds());
  } catch (...) {
    give_token();
    throw;
  }
  return true;
}

Task<void> QueueCore::async_put(Writer item) {
  check_open();
  while (!take_token(std::chrono::steady_clock::now())) co_await wait_readable(tokens_out_.get());
  try {
    co_await put_end_.async_send(kItem, 0, item.bytes(), item.fds());
  } catch (...) {
    give_token();
    throw;
  }
}

std::optional<Message> QueueCore::try_take() {
  std::lock_guard turn(receiving_);
  std::optional<Message> item = get_end_.try_receive();
  if (item) give_token();
  return item;
}

std::optional<Message> QueueCore::get(Deadline deadline) {
  for (;;) {
    if (std::optional<Message> item = try_take()) return item;
    // Another consumer may take the item poll() saw: then wait again.
    if (!wait_for_fd(get_end_.fd(), POLLIN, deadline, "forkpool: Queue::get")) return std::nullopt;
  }
}

Task<Message> QueueCore::async_get() {
  for (;;) {
    if (std::optional<Message> item = try_take()) co_return std::move(*item);
    int rc = co_await wait_readable(get_end_.fd());
    if (rc < 0) throw std::system_error(-rc, std::generic_category(), "forkpool: Queue::async_get");
  }
}

void QueueCore::encode(Writer& w, const std::shared_ptr<const QueueCore>& self) const {
  w.write(static_cast<std::uint64_t>(maxsize_));
  w.write(w.attach_fd(put_end_.fd(), self));
  w.write(w.attach_fd(get_end_.fd(), self));
  if (maxsize_ > 0) {
    w.write(w.attach_fd(tokens_out_.get(), self));
    w.write(w.attach_fd(tokens_in_.get(), self));
  }
}

Writer encode_queue_item(const std::function<void(Writer&)>& write) {
  OutgoingBlocks blocks;
  Writer item(&blocks);
  write(item);
  QueueMemory::instance()->lend(item, blocks);
  return item;
}

void decode_queue_item(Message& message, const std::function<void(Reader&)>& read) {
  std::span<const std::byte> body = message.payload.bytes();
  IncomingBlocks blocks = QueueMemory::instance()->borrow(body, message.fds);
  Reader in(body, message.fds, &blocks);
  read(in);
}

std::shared_ptr<QueueCore> decode_queue(Reader& r) {
  auto maxsize = r.read<std::uint64_t>();
  UniqueFd put_end = r.take_fd(r.read<std::uint32_t>());
  UniqueFd get_end = r.take_fd(r.read<std::uint32_t>());
  UniqueFd tokens_out, tokens_in;
  if (maxsize > 0) {
    tokens_out = r.take_fd(r.read<std::uint32_t>());
    tokens_in = r.take_fd(r.read<std::uint32_t>());
  }
  return std::make_shared<QueueCore>(static_cast<std::size_t>(maxsize), std::move(put_end), std::move(get_end),
                                     std::move(tokens_out), std::move(tokens_in));
}

}  // namespace forkpool::detail
