#include <forkpool/sync/sync.hpp>

#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <string>
#include <string_view>
#include <system_error>

#include <forkpool/runtime/internal/io.hpp>
#include <forkpool/runtime/private/errno.hpp>
#include <forkpool/sync/private/waits.hpp>

namespace forkpool {

// Event: an eventfd whose count is non-zero while set. poll() says readable while it is, so
// waiting (blocking, or on the loop) never consumes it; clear() reads the count back to zero.
struct Event::State {
  UniqueFd fd;
};

Event::Event() : state_(std::make_shared<State>()) {
  int fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (fd < 0) detail::throw_last_errno("forkpool: Event: eventfd");
  state_->fd = UniqueFd(fd);
}

int Event::fd() const { return state_->fd.get(); }

void Event::set() {
  std::uint64_t one = 1;
  if (write(fd(), &one, sizeof one) < 0 && errno != EAGAIN) detail::throw_last_errno("forkpool: Event::set");
}

void Event::clear() {
  std::uint64_t count;
  if (read(fd(), &count, sizeof count) < 0 && errno != EAGAIN) detail::throw_last_errno("forkpool: Event::clear");
}

bool Event::is_set() const { return wait(std::chrono::nanoseconds::zero()); }

bool Event::wait(std::chrono::nanoseconds timeout) const {
  return detail::wait_for_fd(fd(), POLLIN, detail::deadline_unless_forever(timeout), "forkpool: Event::wait");
}

Task<void> Event::async_wait() const {
  auto state = state_;  // the event outlives the wait
  int rc = co_await detail::wait_readable(state->fd.get());
  if (rc < 0) throw std::system_error(-rc, std::generic_category(), "forkpool: Event::async_wait");
  co_return;
}

void codec<Event>::encode(Writer& w, const Event& event) { w.write_fd(event.fd(), event.state_.shared()); }

Event codec<Event>::decode(Reader& r) {
  UniqueFd fd = r.read_fd();
  // An eventfd's link reads "anon_inode:[eventfd]": anything else is not an event.
  char link[64] = {};
  std::string path = "/proc/self/fd/" + std::to_string(fd.get());
  if (readlink(path.c_str(), link, sizeof link - 1) < 0 || std::string_view(link) != "anon_inode:[eventfd]")
    r.fail("an Event's descriptor is not an eventfd");
  auto state = std::make_shared<Event::State>();
  state->fd = std::move(fd);
  return Event(std::move(state));
}

}  // namespace forkpool
