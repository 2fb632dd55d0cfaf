// StartMethod::spawn: each worker is a fresh run of the program's executable. The parent and the
// new process talk first over a bootstrap socket, the only descriptor the child inherits (its
// number is the spawn marker's value):
//
//   parent -> child   bootstrap: [worker index][parent pid][maxtasksperchild]
//                                [the initializer's address, 0 for none][process name]
//                                [a with_bytes initializer's address, 0 for none][its bytes]
//                                [every object the parent
//                                has loaded (ObjectRecord)...]; the worker's channel end and,
//                                if the parent has one, its /dev/shm name tracker's socket
//   child -> parent   ready:     empty; sent once the child has read the bootstrap, so the
//                                parent knows the program reached forkpool::init() (or run())
//
// The child then translates the parent's code addresses through the objects (it has them at
// other addresses: another run, ASLR) and serves as any worker.

#include <poll.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <set>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include <forkpool/ipc/internal/channel.hpp>
#include <forkpool/worker/private/launcher.hpp>
#include <forkpool/worker/internal/protocol.hpp>
#include <forkpool/runtime/error.hpp>
#include <forkpool/shm/private/name_tracker.hpp>
#include <forkpool/runtime/private/errno.hpp>
#include <forkpool/runtime/private/loaded_objects.hpp>
#include <forkpool/runtime/private/process.hpp>
#include <forkpool/runtime/private/spawned_worker.hpp>

namespace forkpool::detail {
namespace {

enum BootstrapMessage : std::uint16_t { kBootstrap = 1, kReady = 2 };

using Bootstrap = std::tuple<int, std::int64_t, int, std::uint64_t, std::string, std::uint64_t, std::string,
                             std::vector<ObjectRecord>>;

// How long a spawned program may take to reach forkpool::init(): its main may load a lot first.
constexpr auto kStartLimit = std::chrono::seconds(60);

const char* const kCallInitFirst =
    "call forkpool::init() first in main(), before anything that may exit or wait: under "
    "StartMethod::spawn every worker runs the program's main() from its start";

// Runs in the spawned program, from init(), run() or a Pool: never returns.
[[noreturn]] void serve_spawned(int bootstrap_fd) {
  int index = -1;
  try {
    Channel bootstrap{UniqueFd(bootstrap_fd)};
    Message message = bootstrap.receive();
    if (message.kind != kBootstrap || message.fds.empty() || message.fds.size() > 2)
      throw ProtocolError("forkpool: a spawned worker's first message is not its bootstrap");
    auto [worker_index, parent, maxtasksperchild, initializer, process_name, with_bytes, bytes, records] =
        decode<Bootstrap>(message.payload.bytes());
    index = worker_index;
    if (message.fds.size() == 2) adopt_name_tracker(std::move(message.fds[1]));
    ObjectTranslation objects;
    for (ObjectRecord& record : records) objects.load(object_of(std::move(record)));
    WorkerSpec spec{maxtasksperchild, {}, std::move(process_name)};
    if (initializer != 0) spec.initializer = reinterpret_cast<void (*)()>(objects.translate(initializer));
    if (with_bytes != 0)
      spec.initializer = Initializer::with_bytes(
          reinterpret_cast<void (*)(std::string_view)>(objects.translate(with_bytes)), std::move(bytes));
    bootstrap.send(kReady, 0, {});
    UniqueFd channel = std::move(message.fds[0]);
    message = {};
    worker_main(spec, WorkerStart::spawned, index, static_cast<pid_t>(parent), std::move(channel), std::move(objects));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "forkpool: spawned worker %d: %s\n", index, e.what());
  }
  exit_helper(kExitBadMessage);
}

[[maybe_unused]] const bool registered = (set_spawned_worker_entry(&serve_spawned), true);

class SpawnLauncher final : public Launcher {
 public:
  explicit SpawnLauncher(WorkerSpec spec) : spec_(std::move(spec)) {
    if (spec_.initializer && !spec_.initializer.plain() && !spec_.initializer.plain_with_bytes())
      throw std::invalid_argument(
          "forkpool: under StartMethod::spawn the initializer must be a plain function (a function pointer "
          "or a lambda without captures, or Initializer::with_bytes): a spawned worker is a fresh run of "
          "the program, where captured state does not exist");
  }

  StartedWorker start(int index, UniqueFd channel) override {
    Starting starting = begin(index, std::move(channel));
    finish(starting);
    return std::move(starting.worker);
  }

  // Each worker's run up to forkpool::init() overlaps the others'.
  void start_all(std::span<Launch> launches) override {
    std::vector<std::optional<Starting>> starting(launches.size());
    for (std::size_t i = 0; i < launches.size(); ++i) {
      try {
        starting[i].emplace(begin(launches[i].index, std::move(launches[i].channel)));
      } catch (...) {
        launches[i].error = std::current_exception();
      }
    }
    for (std::size_t i = 0; i < launches.size(); ++i) {
      if (!starting[i]) continue;
      try {
        finish(*starting[i]);
        launches[i].process = std::move(starting[i]->worker);
      } catch (...) {
        launches[i].error = std::current_exception();
      }
    }
  }

 private:
  // A worker on its way to forkpool::init(): its process and its end of the bootstrap socket.
  struct Starting {
    int index;
    StartedWorker worker;
    Channel bootstrap;
  };

  // Runs the program again and sends the worker its bootstrap. Throws std::system_error.
  Starting begin(int index, UniqueFd channel) {
    serve_if_spawned_worker();  // a spawned worker making a pool before init() serves instead
    auto [ours, theirs] = Channel::make_pair();
    std::vector<LoadedObject> objects = loaded_objects();
    std::vector<ObjectRecord> records;
    auto bases = std::make_shared<std::set<std::uintptr_t>>();
    for (const LoadedObject& object : objects) {
      records.push_back(record_of(object));
      bases->insert(object.base);
    }
    int bootstrap_fd = theirs.fd();
    pid_t pid = spawn_self(bootstrap_fd, environment_for_child({spawn_marker(bootstrap_fd)}));
    theirs.release();  // the child has it now
    StartedWorker worker{pid, watch_child(pid), std::move(bases)};
    try {
      auto initializer = reinterpret_cast<std::uintptr_t>(spec_.initializer.plain());
      auto with_bytes = reinterpret_cast<std::uintptr_t>(spec_.initializer.plain_with_bytes());
      std::vector<int> fds{channel.get()};
      if (int tracker = name_tracker_socket(); tracker >= 0) fds.push_back(tracker);
      ours.send(kBootstrap, 0,
                encode(Bootstrap(index, getpid(), spec_.maxtasksperchild, initializer, spec_.process_name, with_bytes,
                                 spec_.initializer.bytes(), std::move(records)))
                    .bytes(),
                fds);
    } catch (...) {
      send_signal(worker.pidfd.get(), SIGKILL);
      detail::reap(worker.pidfd.get());
      throw;
    }
    return Starting{index, std::move(worker), std::move(ours)};
  }

  // Returns once the worker read its bootstrap; throws Error when it exits (or closes the
  // socket, or stalls) first, having reaped it.
  void finish(Starting& starting) {
    bool reaped = false;  // wait_until_ready() reaps a worker that exited before it was ready
    try {
      wait_until_ready(starting.bootstrap, starting.worker, starting.index, reaped);
    } catch (...) {
      if (!reaped) {
        send_signal(starting.worker.pidfd.get(), SIGKILL);
        detail::reap(starting.worker.pidfd.get());
      }
      throw;
    }
  }

  // Returns once the worker read its bootstrap; throws Error when it exits (or closes the
  // socket, or stalls) first, having reaped it (`reaped`) if it exited.
  static void wait_until_ready(Channel& bootstrap, const StartedWorker& worker, int index, bool& reaped) {
    auto deadline = std::chrono::steady_clock::now() + kStartLimit;
    std::string prefix =
        "forkpool: spawned worker " + std::to_string(index) + " (pid " + std::to_string(worker.pid) + ") ";
    for (;;) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0)
        throw Error(prefix + "did not reach forkpool::init() within " + std::to_string(kStartLimit.count()) +
                    " s: " + kCallInitFirst);
      pollfd fds[2] = {{bootstrap.fd(), POLLIN, 0}, {worker.pidfd.get(), POLLIN, 0}};
      if (poll(fds, 2, static_cast<int>(left.count())) < 0) {
        if (errno == EINTR) continue;
        throw_last_errno("forkpool: poll (spawn)");
      }
      if (fds[0].revents) {
        try {
          Message reply = bootstrap.receive();
          if (reply.kind == kReady) return;
          throw ProtocolError(prefix + "answered its bootstrap out of turn");
        } catch (const ChannelClosed&) {
          // It exited, or closed the socket: its status says which.
        }
      } else if (!fds[1].revents) {
        continue;
      }
      pollfd exited{worker.pidfd.get(), POLLIN, 0};
      if (poll(&exited, 1, 2000) <= 0)
        throw Error(prefix + "closed its bootstrap socket before reaching forkpool::init(): " + kCallInitFirst);
      ExitStatus status = detail::reap(worker.pidfd.get());
      reaped = true;
      std::string how = status.signal ? "was killed by signal " + std::to_string(status.signal)
                                      : "exited with code " + std::to_string(status.exit_code);
      if (status.exit_code == 127) how += " (it could not be executed)";
      throw Error(prefix + how + " before it reached forkpool::init() or forkpool::run(): " + kCallInitFirst);
    }
  }

  WorkerSpec spec_;
};

}  // namespace

std::unique_ptr<Launcher> make_spawn_launcher(WorkerSpec spec) {
  return std::make_unique<SpawnLauncher>(std::move(spec));
}

}  // namespace forkpool::detail
