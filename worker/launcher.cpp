#include <forkpool/worker/private/launcher.hpp>

#include <poll.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <system_error>
#include <tuple>

#include <forkpool/worker/internal/protocol.hpp>
#include <forkpool/runtime/error.hpp>
#include <forkpool/shm/private/name_tracker.hpp>
#include <forkpool/shm/internal/slab.hpp>
#include <forkpool/runtime/private/errno.hpp>
#include <forkpool/runtime/private/loaded_objects.hpp>

namespace forkpool::detail {
namespace {

StartedWorker fork_worker(const WorkerSpec& spec, int index, UniqueFd channel) {
  auto objects = loaded_object_bases();
  pid_t parent = getpid();
  pid_t pid = fork_helper();
  if (pid < 0) throw_last_errno("forkpool: fork");
  if (pid == 0) worker_main(spec, WorkerStart::forked, index, parent, std::move(channel));
  return {pid, watch_child(pid), std::move(objects)};
}

// Forks a helper process (a fork server) that runs `serve(our pid, its end of the channel)`, which
// never returns; `ours` is closed in it. Returns its pid; throws std::system_error naming `what`.
template <class Serve>
pid_t fork_server_process(Channel& ours, Channel& theirs, const char* what, Serve serve) {
  pid_t parent = getpid();
  pid_t pid = fork_helper();
  if (pid < 0) throw_last_errno(what);
  if (pid == 0) {
    ours.release().reset();
    serve(parent, theirs.release());
  }
  return pid;
}

class ForkLauncher final : public Launcher {
 public:
  explicit ForkLauncher(WorkerSpec spec) : spec_(std::move(spec)) {}
  StartedWorker start(int index, UniqueFd channel) override { return fork_worker(spec_, index, std::move(channel)); }

 private:
  WorkerSpec spec_;
};

// The fork server's requests. A reply carries its request's kind and id.
enum ZygoteRequest : std::uint16_t {
  kSpawnRequest = 1,   // int index + the worker's channel end -> int64 pid (or -errno) + its pidfd
  kReapRequest = 2,    // int64 pid -> (exit code, signal)
  kForgetRequest = 3,  // the id of a spawn whose reply the parent could not take: kill that worker
};

// The fork server's children: each is reaped the moment it exits, whatever happens on the
// parent's side, and its status is kept until the parent asks for it.
class ZygoteChildren {
 public:
  // keep_status false: nobody will ask (the program's fork server's children, the pools' fork
  // servers): each is reaped and forgotten.
  explicit ZygoteChildren(bool keep_status = true) : keep_status_(keep_status) {}

  void add(std::uint64_t start_id, StartedWorker child) {
    last_start_ = {start_id, child.pid};
    running_.emplace(child.pid, std::move(child.pidfd));
  }

  // The parent never learnt of this worker: it is killed, and its status dropped.
  void forget(std::uint64_t start_id) {
    if (start_id != last_start_.first) return;
    auto it = running_.find(last_start_.second);
    if (it == running_.end()) {
      exited_.erase(last_start_.second);
      return;
    }
    forgotten_.insert(it->first);
    send_signal(it->second.get(), SIGKILL);
  }

  ExitStatus take_status(pid_t pid) {
    if (auto it = exited_.find(pid); it != exited_.end()) {
      ExitStatus status = it->second;
      exited_.erase(it);
      return status;
    }
    auto it = running_.find(pid);
    if (it == running_.end()) return {};                 // not ours: unknown
    ExitStatus status = detail::reap(it->second.get());  // the parent asks once it has exited
    running_.erase(it);
    return status;
  }

  // Waits for the next request on `control`, reaping children as they exit meanwhile.
  void wait_for_request(int control) {
    for (;;) {
      std::vector<pollfd> fds{{control, POLLIN, 0}};
      for (auto& [pid, pidfd] : running_) fds.push_back({pidfd.get(), POLLIN, 0});
      if (poll(fds.data(), fds.size(), -1) < 0) {
        if (errno == EINTR) continue;
        throw_last_errno("forkpool: fork server: poll");
      }
      for (std::size_t i = 1; i < fds.size(); ++i)
        if (fds[i].revents) reap_exited(fds[i].fd);
      if (fds[0].revents) return;
    }
  }

 private:
  void reap_exited(int pidfd) {
    auto it = std::find_if(running_.begin(), running_.end(), [&](auto& entry) { return entry.second.get() == pidfd; });
    ExitStatus status = detail::reap(pidfd);
    pid_t pid = it->first;
    running_.erase(it);
    if (!forgotten_.erase(pid) && keep_status_) exited_[pid] = status;
  }

  bool keep_status_;
  std::map<pid_t, UniqueFd> running_;  // by pid: its pidfd
  std::map<pid_t, ExitStatus> exited_;
  std::set<pid_t> forgotten_;
  std::pair<std::uint64_t, pid_t> last_start_{0, -1};
};

// A server's answer to a request to start a child: `start()` makes it (throwing std::system_error
// when it cannot), the reply is [int64 pid or -errno] with the child's pidfd, and `children`
// reaps it when it exits. A failed start (a transient EAGAIN) fails this request, not the server.
template <class Start>
void start_child_and_reply(Channel& control, const Message& request, ZygoteChildren& children, Start start) {
  std::int64_t pid_or_error;
  std::optional<StartedWorker> child;
  try {
    child.emplace(start());
    pid_or_error = child->pid;
  } catch (const std::system_error& e) {
    pid_or_error = -e.code().value();
  }
  int pidfd = child ? child->pidfd.get() : -1;
  control.send(request.kind, request.request_id, encode(pid_or_error).bytes(),
               child ? std::span(&pidfd, 1) : std::span<const int>());
  if (child) children.add(request.request_id, std::move(*child));
}

[[noreturn]] void zygote_main(const WorkerSpec& spec, pid_t parent, UniqueFd control_fd) noexcept {
  int fd = become_helper_process("forkpool-zygote", parent, control_fd.release());
  Slab::unmap_inherited();  // the workers it forks must not keep the parent's freed slabs alive
  Channel control{UniqueFd(fd)};
  ZygoteChildren children;
  try {
    for (;;) {
      children.wait_for_request(control.fd());
      Message request = control.receive();
      Reader in = request.reader();
      if (request.kind == kSpawnRequest && request.fds.size() == 1) {
        int index = in.read<int>();
        start_child_and_reply(control, request, children,
                              [&] { return fork_worker(spec, index, std::move(request.fds[0])); });
      } else if (request.kind == kReapRequest) {
        ExitStatus status = children.take_status(static_cast<pid_t>(in.read<std::int64_t>()));
        control.send(kReapRequest, request.request_id,
                     encode(std::pair<int, int>(status.exit_code, status.signal)).bytes());
      } else if (request.kind == kForgetRequest) {
        children.forget(in.read<std::uint64_t>());
      } else {
        exit_helper(kExitBadMessage);
      }
    }
  } catch (const ChannelClosed&) {
    exit_helper(0);  // the pool is gone; our children die with us (PR_SET_PDEATHSIG)
  } catch (const std::exception& e) {
    std::fprintf(stderr, "forkpool: fork server: %s\n", e.what());
    exit_helper(kExitBadMessage);
  }
}

// The program's fork server (forkpool::init()): forked before the program has threads, it
// forks a fork server for each pool made later, so that no worker inherits a lock some thread
// of the program held. Its one request:
//   start (the pool -> it): [maxtasksperchild][initializer address][process name]
//                           [the initializer's object]
//                           and descriptors: the new fork server's control end, and the pool's
//                           /dev/shm name tracker socket if it has one
//           reply:          [int64 pid or -errno] and that fork server's pidfd
enum ProgramServerRequest : std::uint16_t { kStartForkServer = 1 };

using StartForkServer = std::tuple<int, std::uint64_t, std::string, ObjectRecord>;

[[noreturn]] void program_server_main(pid_t parent, UniqueFd control_fd,
                                      const std::shared_ptr<const std::set<std::uintptr_t>>& own) noexcept {
  int fd = become_helper_process("forkpool-server", parent, control_fd.release());
  Channel control{UniqueFd(fd)};
  ZygoteChildren children(/*keep_status=*/false);
  try {
    for (;;) {
      children.wait_for_request(control.fd());
      Message request = control.receive();
      if (request.kind != kStartForkServer || request.fds.empty() || request.fds.size() > 2)
        exit_helper(kExitBadMessage);
      auto [maxtasksperchild, initializer, process_name, record] = decode<StartForkServer>(request.payload.bytes());
      pid_t pid = fork_helper();
      int fork_error = errno;
      if (pid == 0) {
        UniqueFd pool_control = std::move(request.fds[0]);
        control.release().reset();
        ObjectTranslation objects;  // an initializer in an object loaded after init()
        LoadedObject object = object_of(std::move(record));
        if (initializer != 0 && !own->contains(object.base)) objects.load(object);
        WorkerSpec spec{maxtasksperchild, {}, std::move(process_name)};
        try {
          if (initializer != 0) spec.initializer = reinterpret_cast<void (*)()>(objects.translate(initializer));
          if (request.fds.size() == 2) adopt_name_tracker(std::move(request.fds[1]));
        } catch (const std::exception& e) {
          std::fprintf(stderr, "forkpool: fork server: %s\n", e.what());
          exit_helper(kExitBadMessage);
        }
        // Not bound to us: the pool's socket is its lifeline (end-of-file when the pool's process
        // dies), so the pool's workers run on if we are killed; only new pools need a new server.
        zygote_main(spec, /*parent=*/0, std::move(pool_control));
      }
      start_child_and_reply(control, request, children, [&] {
        if (pid < 0) throw std::system_error(fork_error, std::generic_category(), "fork");
        return StartedWorker{pid, watch_child(pid), nullptr};
      });
    }
  } catch (const ChannelClosed&) {
    exit_helper(0);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "forkpool: the program's fork server: %s\n", e.what());
    exit_helper(kExitBadMessage);
  }
}

class ProgramForkServer {
 public:
  // The one init() started, for use by the process that called init() (a process forked from
  // it would share its socket, and their replies would cross): null elsewhere.
  static ProgramForkServer* get() {
    ProgramForkServer* server = instance().get();
    return server && !server->gone_ && server->owner_ == current_pid() ? server : nullptr;
  }

  static void start() {
    if (instance()) return;
    auto [ours, theirs] = Channel::make_pair();
    auto own = loaded_object_bases();
    pid_t pid =
        fork_server_process(ours, theirs, "forkpool: fork (the program's fork server)",
                            [&](pid_t parent, UniqueFd end) { program_server_main(parent, std::move(end), own); });
    instance().reset(new ProgramForkServer(pid, std::move(ours), std::move(own)));  // it dies with us
  }

  // Forks a fork server for a pool, serving `control` (its end), whose workers run `spec`;
  // `spec.initializer` is plain. Throws ChannelClosed when this server is gone.
  StartedWorker start_fork_server(const WorkerSpec& spec, int control) {
    std::lock_guard lock(mutex_);  // pools on several threads share the socket
    auto initializer = reinterpret_cast<std::uintptr_t>(spec.initializer.plain());
    ObjectRecord record;
    if (initializer != 0)
      if (auto object = object_at(initializer)) record = record_of(*object);
    std::vector<int> fds{control};
    if (int tracker = name_tracker_socket(); tracker >= 0) fds.push_back(tracker);
    Message reply;
    try {
      channel_.send(kStartForkServer, ++next_id_,
                    encode(StartForkServer(spec.maxtasksperchild, initializer, spec.process_name, record)).bytes(),
                    fds);
      reply = channel_.receive();
    } catch (const ChannelClosed&) {
      // It was killed: reaped here (our child, or a zombie for ever), and never asked again.
      gone_ = true;
      waitpid(pid_, nullptr, 0);
      throw;
    }
    if (reply.kind != kStartForkServer || reply.request_id != next_id_)
      throw ProtocolError("forkpool: the program's fork server replied out of turn");
    auto pid = decode<std::int64_t>(reply.payload.bytes());
    if (pid < 0)
      throw std::system_error(static_cast<int>(-pid), std::generic_category(),
                              "forkpool: fork (in the program's fork server)");
    if (reply.fds.size() != 1) throw ProtocolError("forkpool: the program's fork server replied without a pidfd");
    return {static_cast<pid_t>(pid), std::move(reply.fds[0]), objects_};
  }

 private:
  ProgramForkServer(pid_t pid, Channel channel, std::shared_ptr<const std::set<std::uintptr_t>> objects)
      : owner_(current_pid()), pid_(pid), channel_(std::move(channel)), objects_(std::move(objects)) {}

  static std::unique_ptr<ProgramForkServer>& instance() {
    static std::unique_ptr<ProgramForkServer> server;  // lives (and runs) as long as the program
    return server;
  }

  pid_t owner_;
  pid_t pid_;          // the server: our child
  bool gone_ = false;  // it was found dead
  Channel channel_;
  std::shared_ptr<const std::set<std::uintptr_t>> objects_;  // what it and its children have
  std::mutex mutex_;
  std::uint64_t next_id_ = 0;
};

class ForkServerLauncher final : public Launcher {
 public:
  explicit ForkServerLauncher(WorkerSpec spec) : spec_(std::move(spec)) { start_zygote(); }

  ~ForkServerLauncher() override { stop_zygote(); }

  // A fork server that died (killed, say) is replaced once per start; if the new one cannot be
  // started either, the start fails with an Error.
  StartedWorker start(int index, UniqueFd channel) override {
    try {
      return start_through_zygote(index, channel.get());
    } catch (const ChannelClosed&) {}
    try {
      stop_zygote();
      start_zygote();
      return start_through_zygote(index, channel.get());
    } catch (const ChannelClosed&) {
      throw Error("forkpool: the fork server died, and so did the one started to replace it");
    } catch (const std::system_error& e) {
      throw Error(std::string("forkpool: the fork server died and cannot be replaced: ") + e.what());
    }
  }

  ExitStatus reap(const StartedWorker& worker) override {
    try {
      Message reply = call(kReapRequest, encode(static_cast<std::int64_t>(worker.pid)), {});
      auto [code, signal] = decode<std::pair<int, int>>(reply.payload.bytes());
      return {code, signal};
    } catch (const ChannelClosed&) {
      return {};  // its fork server is gone, and with it the status
    }
  }

 private:
  void start_zygote() {
    auto [ours, theirs] = Channel::make_pair();
    // A plain initializer (or none) can be named to the program's fork server; one holding
    // state exists only here, so then the pool forks its own.
    ProgramForkServer* program = ProgramForkServer::get();
    if (program && (!spec_.initializer || spec_.initializer.plain())) {
      try {
        zygote_ = program->start_fork_server(spec_, theirs.fd());
        own_child_ = false;
        control_.emplace(ours.release());
        return;
      } catch (const ChannelClosed&) {
        // The program's fork server is gone (killed): the pool forks its own.
      }
    }
    own_child_ = true;
    pid_t pid = fork_server_process(ours, theirs, "forkpool: fork (fork server)",
                                    [&](pid_t parent, UniqueFd end) { zygote_main(spec_, parent, std::move(end)); });
    zygote_ = {pid, open_pidfd(pid), loaded_object_bases()};  // what every worker it forks has
    control_.emplace(ours.release());
  }

  void stop_zygote() {
    control_.reset();
    if (!zygote_.pidfd) return;
    send_signal(zygote_.pidfd.get(), SIGKILL);
    detail::reap(zygote_.pidfd.get());
    zygote_ = {};
  }

  StartedWorker start_through_zygote(int index, int channel_fd) {
    Message reply;
    try {
      reply = call(kSpawnRequest, encode(index), std::span(&channel_fd, 1));
    } catch (const ProtocolError&) {
      // Most likely our descriptor table is full and the pidfd was lost on the way (MSG_CTRUNC):
      // the worker must not run unwatched.
      std::uint64_t start_id = next_id_;
      try {
        control_->send(kForgetRequest, ++next_id_, encode(start_id).bytes());
      } catch (const std::exception&) {
        // The fork server is gone too, and its children with it.
      }
      throw;
    }
    auto pid = decode<std::int64_t>(reply.payload.bytes());
    if (pid < 0)
      throw std::system_error(static_cast<int>(-pid), std::generic_category(), "forkpool: fork (in the fork server)");
    if (reply.fds.size() != 1) throw ProtocolError("forkpool: the fork server replied without a pidfd");
    return {static_cast<pid_t>(pid), std::move(reply.fds[0]), zygote_.objects};
  }

  // One blocking round trip: the fork server answers at once. Throws ChannelClosed when the
  // fork server is gone.
  Message call(ZygoteRequest kind, const Writer& request, std::span<const int> fds) {
    if (!control_) throw ChannelClosed("forkpool: no fork server");
    control_->send(kind, ++next_id_, request.bytes(), fds);
    Message reply = control_->receive();
    if (reply.kind != kind || reply.request_id != next_id_)
      throw ProtocolError("forkpool: the fork server replied out of turn");
    return reply;
  }

  WorkerSpec spec_;
  StartedWorker zygote_;
  bool own_child_ = true;  // forked by us, not by the program's fork server
  std::optional<Channel> control_;
  std::uint64_t next_id_ = 0;
};

}  // namespace

void start_program_fork_server() { ProgramForkServer::start(); }

std::unique_ptr<Launcher> make_fork_launcher(WorkerSpec spec) {
  return std::make_unique<ForkLauncher>(std::move(spec));
}
std::unique_ptr<Launcher> make_fork_server_launcher(WorkerSpec spec) {
  return std::make_unique<ForkServerLauncher>(std::move(spec));
}

std::unique_ptr<Launcher> make_launcher(StartMethod method, WorkerSpec spec) {
  switch (method) {
    case StartMethod::fork: return make_fork_launcher(std::move(spec));
    case StartMethod::forkserver: return make_fork_server_launcher(std::move(spec));
    case StartMethod::spawn: return make_spawn_launcher(std::move(spec));
  }
  throw std::invalid_argument("forkpool: unknown start method");
}

}  // namespace forkpool::detail
