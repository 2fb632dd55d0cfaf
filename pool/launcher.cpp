#include <forkpool/pool/internal/launcher.hpp>

#include <sys/wait.h>
#include <unistd.h>


#include <csignal>
#include <unordered_map>
#include <cstdio>

#include <forkpool/runtime/error.hpp>
#include <forkpool/runtime/internal/errno.hpp>

namespace forkpool::detail {
namespace {

SpawnedWorker fork_worker(const WorkerSpec& spec, int index, UniqueFd channel) {
  pid_t parent = getpid();
  pid_t pid = fork_flushed();
  if (pid < 0) throw_last_errno("forkpool: fork");
  if (pid == 0) worker_main(spec, index, parent, std::move(channel));
  try {
    return {pid, open_pidfd(pid)};  // our unreaped child: its pid cannot be recycled yet
  } catch (...) {
    kill(pid, SIGKILL);  // a worker we cannot watch must not run
    waitpid(pid, nullptr, 0);
    throw;
  }
}

class ForkLauncher final : public Launcher {
 public:
  explicit ForkLauncher(WorkerSpec spec) : spec_(std::move(spec)) {}
  SpawnedWorker spawn(int index, UniqueFd channel) override { return fork_worker(spec_, index, std::move(channel)); }
  ExitStatus reap(const SpawnedWorker& worker) override { return detail::reap(worker.pidfd.get()); }

 private:
  WorkerSpec spec_;
};

// The zygote's requests and replies.
enum ZygoteRequest : std::uint16_t { kSpawnRequest = 1, kReapRequest = 2 };

[[noreturn]] void zygote_main(const WorkerSpec& spec, pid_t parent, UniqueFd control_fd) noexcept {
  int fd = become_helper_process("forkpool-zygote", parent, control_fd.release());
  Channel control{UniqueFd(fd)};
  std::unordered_map<pid_t, SpawnedWorker> children;
  try {
    for (;;) {
      Message request = control.receive();
      Reader in = request.reader();
      if (request.kind == kSpawnRequest && request.fds.size() == 1) {
        int index = in.read<int>();
        SpawnedWorker child = fork_worker(spec, index, std::move(request.fds[0]));
        Writer reply = encode(static_cast<std::int64_t>(child.pid));
        int pidfd = child.pidfd.get();
        control.send(kSpawnRequest, request.request_id, reply.bytes(), std::span(&pidfd, 1));
        children.emplace(child.pid, std::move(child));
      } else if (request.kind == kReapRequest) {
        auto pid = static_cast<pid_t>(in.read<std::int64_t>());
        ExitStatus status;
        if (auto it = children.find(pid); it != children.end()) {
          status = detail::reap(it->second.pidfd.get());
          children.erase(it);
        }
        Writer reply = encode(std::pair<int, int>(status.exit_code, status.signal));
        control.send(kReapRequest, request.request_id, reply.bytes());
      } else {
        exit_helper(kExitBadMessage);
      }
    }
  } catch (const ChannelClosed&) {
    exit_helper(0);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "forkpool: fork server: %s\n", e.what());
    exit_helper(kExitBadMessage);
  }
}

class ForkServerLauncher final : public Launcher {
 public:
  explicit ForkServerLauncher(WorkerSpec spec) {
    auto [ours, theirs] = Channel::make_pair();
    pid_t parent = getpid();
    pid_t pid = fork_flushed();
    if (pid < 0) throw_last_errno("forkpool: fork (fork server)");
    if (pid == 0) {
      ours.release().reset();
      zygote_main(spec, parent, theirs.release());
    }
    zygote_ = {pid, open_pidfd(pid)};
    control_.emplace(ours.release());
  }

  ~ForkServerLauncher() override {
    send_signal(zygote_.pidfd.get(), SIGKILL);
    detail::reap(zygote_.pidfd.get());
  }

  SpawnedWorker spawn(int index, UniqueFd channel) override {
    int fd = channel.get();
    Message reply = call(kSpawnRequest, encode(index), std::span(&fd, 1));
    if (reply.fds.size() != 1) throw ProtocolError("forkpool: fork server replied without a pidfd");
    auto pid = static_cast<pid_t>(decode<std::int64_t>(reply.payload.bytes()));
    return {pid, std::move(reply.fds[0])};
  }

  ExitStatus reap(const SpawnedWorker& worker) override {
    Message reply = call(kReapRequest, encode(static_cast<std::int64_t>(worker.pid)), {});
    auto [code, signal] = decode<std::pair<int, int>>(reply.payload.bytes());
    return {code, signal};
  }

 private:
  // One blocking round trip: the fork server answers at once.
  Message call(ZygoteRequest kind, const Writer& request, std::span<const int> fds) {
    try {
      control_->send(kind, ++next_id_, request.bytes(), fds);
      Message reply = control_->receive();
      if (reply.kind != kind || reply.request_id != next_id_) throw ProtocolError("forkpool: fork server replied out of turn");
      return reply;
    } catch (const ChannelClosed&) {
      throw Error("forkpool: the fork server is gone");
    }
  }

  SpawnedWorker zygote_;
  std::optional<Channel> control_;
  std::uint64_t next_id_ = 0;
};

}  // namespace

std::unique_ptr<Launcher> make_fork_launcher(WorkerSpec spec) { return std::make_unique<ForkLauncher>(std::move(spec)); }
std::unique_ptr<Launcher> make_fork_server_launcher(WorkerSpec spec) {
  return std::make_unique<ForkServerLauncher>(std::move(spec));
}

}  // namespace forkpool::detail
