#include <forkpool/sync/queue.hpp>

#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <string>
#include <system_error>

#include <forkpool/sync/private/waits.hpp>
#include <forkpool/sync/private/holders.hpp>
#include <forkpool/sync/private/journal.hpp>
#include <forkpool/shm/private/queue_memory.hpp>
#include <forkpool/sync/private/shared_page.hpp>
#include <forkpool/runtime/error.hpp>
#include <forkpool/runtime/private/errno.hpp>
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
  if (fstat(fd, &st) != 0 || !S_ISFIFO(st.st_mode))
    throw ProtocolError("forkpool: a Queue's token descriptor is not a pipe");
}

// An id for each item put, distinct in practice across processes (a forked child counts on from
// its parent's count, under its own pid): a consumer that finds a dead consumer's take compares
// it with the item now first in line.
std::uint64_t next_item_id() {
  static std::atomic<std::uint64_t> count{1};
  return (static_cast<std::uint64_t>(getpid()) << 40) |
         (count.fetch_add(1, std::memory_order_relaxed) & ((std::uint64_t{1} << 40) - 1));
}

}  // namespace

// What the queue's page holds: the consumers' turn, and how far the current take got.
enum class QueueCore::Stage : std::uint32_t { idle, taking, taken };

namespace {
struct QueueState {
  pthread_mutex_t turn;
  std::atomic<std::uint32_t> stage;    // a QueueCore::Stage
  std::atomic<std::uint64_t> item_id;  // the item being taken (its frame's request id)
  // Items put (by any process, without the turn) and got (under the turn): qsize() is their
  // difference, approximate (each is updated after the fact).
  std::atomic<std::int64_t> items_put;
  std::atomic<std::int64_t> items_got;
  // JoinableQueue: items put, and items done (task_done(), or got by a consumer that ended; the
  // futex word join() sleeps on); the difference is the unfinished items. And which consumers
  // got items they have not called task_done() for (under the turn).
  std::int32_t joinable;
  std::atomic<std::uint32_t> joinable_put;
  std::atomic<std::uint32_t> done;
  HolderTable unfinished_by;
  // Each change of several of these words is one commit: a consumer killed inside get() or
  // task_done() leaves them all as they were, or all changed (issue 58.2).
  Journal journal;
};
// Items put to a JoinableQueue and not yet done.
std::uint32_t unfinished_of(const QueueState& state) { return state.joinable_put.load() - state.done.load(); }
static_assert(sizeof(QueueState) <= SharedPage::kSize);
QueueState& state_of(SharedPage& page) { return *page.as<QueueState>(); }
}  // namespace

// Holds the consumers' turn for a scope.
class QueueCore::TakeTurn {
 public:
  TakeTurn(QueueCore& queue, bool wait) : queue_(queue), held_(queue.enter_turn(wait)) {}
  ~TakeTurn() {
    if (held_) queue_.leave_turn();
  }
  TakeTurn(const TakeTurn&) = delete;
  TakeTurn& operator=(const TakeTurn&) = delete;

 private:
  QueueCore& queue_;
  bool held_;
};

QueueCore::QueueCore(std::size_t maxsize, bool joinable)
    : maxsize_(maxsize), put_end_(UniqueFd()), get_end_(UniqueFd()), page_(SharedPage::create("forkpool-queue")) {
  init_robust_mutex(state_of(*page_).turn, "forkpool: Queue");
  state_of(*page_).joinable = joinable;
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

QueueCore::QueueCore(std::size_t maxsize, UniqueFd put_end, UniqueFd get_end, UniqueFd page, UniqueFd tokens_out,
                     UniqueFd tokens_in)
    : maxsize_(maxsize),
      put_end_(std::move(put_end)),
      get_end_(std::move(get_end)),
      page_(SharedPage::adopt(std::move(page))),
      tokens_out_(std::move(tokens_out)),
      tokens_in_(std::move(tokens_in)) {
  check_socket(put_end_.fd());
  check_socket(get_end_.fd());
  if (maxsize_ > 0) {
    check_pipe(tokens_out_.get());
    check_pipe(tokens_in_.get());
  }
}

QueueCore::~QueueCore() = default;

void QueueCore::check_open() const {
  if (closed_) throw std::logic_error("forkpool: Queue::put after close() in this process");
}

// A bounded queue's free place. The token pipe is non-blocking: another producer may take
// the token poll() saw.
bool QueueCore::try_take_token() {
  if (maxsize_ == 0) return true;
  char token;
  while (read(tokens_out_.get(), &token, 1) != 1) {
    if (errno == EAGAIN) return false;
    if (errno != EINTR) throw_last_errno("forkpool: Queue: take a place");
  }
  return true;
}

void QueueCore::give_token() {
  if (maxsize_ == 0) return;
  char token = 't';
  while (write(tokens_in_.get(), &token, 1) < 0 && errno == EINTR) {}
}

bool QueueCore::put(const Writer& item, Deadline deadline) {
  check_open();
  while (!try_take_token()) {
    auto now = std::chrono::steady_clock::now();
    if (deadline && now >= *deadline) {
      recover_abandoned_take();
      if (try_take_token()) break;
      return false;
    }
    auto until = now + kEndedHolderCheck;
    if (!wait_for_fd(tokens_out_.get(), POLLIN, deadline ? std::min(until, *deadline) : until, "forkpool: Queue::put"))
      recover_abandoned_take();
  }
  item_coming();
  try {
    put_end_.send(kItem, next_item_id(), item.bytes(), item.fds());
  } catch (...) {
    item_not_sent();
    throw;
  }
  state_of(*page_).items_put.fetch_add(1);
  return true;
}

Task<void> QueueCore::async_put(Writer item) {
  check_open();
  while (!try_take_token()) {
    IoOptions options{.deadline = Clock::now() + kEndedHolderCheck};
    int rc = co_await wait_readable(tokens_out_.get(), options);
    if (rc == -ETIMEDOUT)
      recover_abandoned_take();
    else if (rc < 0)
      throw std::system_error(-rc, std::generic_category(), "forkpool: Queue::async_put");
  }
  item_coming();
  try {
    co_await put_end_.async_send(kItem, next_item_id(), item.bytes(), item.fds());
  } catch (...) {
    item_not_sent();
    throw;
  }
  state_of(*page_).items_put.fetch_add(1);
}

void QueueCore::item_coming() {
  QueueState& state = state_of(*page_);
  if (state.joinable) state.joinable_put.fetch_add(1);
}

void QueueCore::item_not_sent() {
  give_token();
  QueueState& state = state_of(*page_);
  if (state.joinable && state.joinable_put.fetch_sub(1) - 1 == state.done.load()) futex_wake_all(&state.done);
}

std::size_t QueueCore::qsize() const {
  QueueState& state = state_of(*page_);
  return static_cast<std::size_t>(std::max<std::int64_t>(0, state.items_put.load() - state.items_got.load()));
}

void QueueCore::task_done() {
  QueueState& state = state_of(*page_);
  TakeTurn turn(*this, /*wait=*/true);
  std::uint32_t done = state.done.load();
  if (unfinished_of(state) == 0)
    throw std::logic_error("forkpool: JoinableQueue::task_done() called more times than items were put");
  state.journal.commit(&state, {{&state.done, done + 1}, state.unfinished_by.change(getpid(), -1)});
  if (unfinished_of(state) == 0) futex_wake_all(&state.done);
}

// Items got by consumers that ended without task_done() are done: nobody else will say so.
void QueueCore::settle_ended_consumers() {
  QueueState& state = state_of(*page_);
  TakeTurn turn(*this, /*wait=*/true);
  bool woke = false;
  while (HolderTable::Slot* slot = state.unfinished_by.ended()) {
    std::uint32_t abandoned = std::min(static_cast<std::uint32_t>(std::max(slot->count, 0)), unfinished_of(state));
    state.journal.commit(&state, {{&state.done, state.done.load() + abandoned}, {HolderTable::word(*slot), 0}});
    woke = woke || (abandoned > 0 && unfinished_of(state) == 0);
  }
  if (woke) futex_wake_all(&state.done);
}

bool QueueCore::join_tasks(Deadline deadline) {
  QueueState& state = state_of(*page_);
  for (;;) {
    std::uint32_t done = state.done.load();
    if (unfinished_of(state) == 0) return true;
    auto now = std::chrono::steady_clock::now();
    if (deadline && now >= *deadline) return false;
    auto slice = deadline ? std::min<std::chrono::nanoseconds>(kEndedHolderCheck, *deadline - now) : kEndedHolderCheck;
    wait_for_word(&state.done, done, slice, "forkpool: JoinableQueue::join");
    if (unfinished_of(state) != 0) settle_ended_consumers();
  }
}

bool QueueCore::enter_turn(bool wait) {
  pthread_mutex_t& turn = state_of(*page_).turn;
  bool holder_died = false;
  bool held = robust_lock_taken(turn, wait ? pthread_mutex_lock(&turn) : pthread_mutex_trylock(&turn), holder_died,
                                "forkpool: Queue::get");
  if (holder_died) {
    state_of(*page_).journal.replay(&state_of(*page_));
    settle_abandoned_take();
  }
  return held;
}

void QueueCore::leave_turn() noexcept { pthread_mutex_unlock(&state_of(*page_).turn); }

std::optional<Message> QueueCore::try_take() {
  TakeTurn turn(*this, /*wait=*/true);
  if (!begin_take()) return std::nullopt;
  std::optional<Message> item;
  try {
    item = receive_taken();
  } catch (...) {  // a malformed item: received, and refused
    settle_abandoned_take();
    throw;
  }
  end_take();
  return item;
}

std::optional<std::uint64_t> QueueCore::begin_take() {
  std::optional<std::uint64_t> id = get_end_.peek_request_id();
  if (!id) return std::nullopt;
  QueueState& state = state_of(*page_);
  state.item_id.store(*id);
  state.stage.store(static_cast<std::uint32_t>(Stage::taking));
  return id;
}

std::optional<Message> QueueCore::receive_taken() {
  std::optional<Message> item = get_end_.try_receive();
  QueueState& state = state_of(*page_);
  if (!item) {
    state.stage.store(static_cast<std::uint32_t>(Stage::idle));
    return item;
  }
  // Taken, counted and (for join()) recorded as ours in one commit. A kill before it is a take
  // settle_abandoned_take() finishes; after it, the item is ours until task_done() or our end.
  auto taken = static_cast<std::uint32_t>(Stage::taken);
  auto got = static_cast<std::uint64_t>(state.items_got.load() + 1);
  Journal::Write held = state.joinable ? state.unfinished_by.change(getpid(), 1) : Journal::Write::nothing();
  state.journal.commit(&state, {{&state.stage, taken}, {&state.items_got, got}, held});
  return item;
}

void QueueCore::end_take() {
  QueueState& state = state_of(*page_);
  if (state.stage.load() == static_cast<std::uint32_t>(Stage::taken)) give_token();
  state.stage.store(static_cast<std::uint32_t>(Stage::idle));
}

void QueueCore::settle_abandoned_take() {
  QueueState& state = state_of(*page_);
  auto stage = static_cast<Stage>(state.stage.load());
  // Taking: whether the item left depends on whether it is still first in line.
  bool item_left =
      stage == Stage::taken || (stage == Stage::taking && get_end_.peek_request_id() != state.item_id.load());
  if (item_left) give_token();
  auto idle = static_cast<std::uint32_t>(Stage::idle);
  if (stage == Stage::taking && item_left) {
    // The item reached a consumer that died before it counted it: it is gone from the queue,
    // and done (nobody can call task_done() for it).
    auto got = static_cast<std::uint64_t>(state.items_got.load() + 1);
    bool done = state.joinable && unfinished_of(state) > 0;
    state.journal.commit(
        &state, {{&state.stage, idle}, {&state.items_got, got}, {&state.done, state.done.load() + (done ? 1 : 0)}});
    if (done && unfinished_of(state) == 0) futex_wake_all(&state.done);
    return;
  }
  state.stage.store(idle);
}

void QueueCore::recover_abandoned_take() { TakeTurn turn(*this, /*wait=*/false); }

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
  w.write_fd(put_end_.fd(), self);
  w.write_fd(get_end_.fd(), self);
  w.write_fd(page_->fd(), self);
  if (maxsize_ > 0) {
    w.write_fd(tokens_out_.get(), self);
    w.write_fd(tokens_in_.get(), self);
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
  UniqueFd put_end = r.read_fd();
  UniqueFd get_end = r.read_fd();
  UniqueFd page = r.read_fd();
  UniqueFd tokens_out, tokens_in;
  if (maxsize > 0) {
    tokens_out = r.read_fd();
    tokens_in = r.read_fd();
  }
  return std::make_shared<QueueCore>(static_cast<std::size_t>(maxsize), std::move(put_end), std::move(get_end),
                                     std::move(page), std::move(tokens_out), std::move(tokens_in));
}

}  // namespace forkpool::detail
