#include <forkpool/runtime/private/spawned_worker.hpp>

#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <string_view>

#include <forkpool/runtime/private/process.hpp>

extern char** environ;

namespace forkpool::detail {
namespace {

std::atomic<SpawnedWorkerEntry> registered_entry{nullptr};

}  // namespace

void set_spawned_worker_entry(SpawnedWorkerEntry entry) noexcept { registered_entry.store(entry); }

std::string spawn_marker(int bootstrap_fd) {
  return std::string(kSpawnMarker) + "=" + std::to_string(bootstrap_fd) + ":" + std::to_string(getpid());
}

void serve_if_spawned_worker() {
  const char* mark = std::getenv(kSpawnMarker);
  if (!mark) return;
  int fd = -1;
  long parent = -1;
  int parsed = std::sscanf(mark, "%d:%ld", &fd, &parent);
  unsetenv(kSpawnMarker);
  // Only a mark our parent set for us makes us a worker: one left in the environment (a shell
  // that exported it, a program started by a worker) is ignored, and the program runs as itself.
  struct stat st {};
  if (parsed != 2 || parent != static_cast<long>(getppid()) || fd < 0 || fstat(fd, &st) != 0 || !S_ISSOCK(st.st_mode))
    return;
  SpawnedWorkerEntry entry = registered_entry.load();
  if (!entry) {
    std::fprintf(stderr, "forkpool: started as a spawned worker, but this program has no pool to serve\n");
    exit_helper(kExitBadMessage);
  }
  entry(fd);
  exit_helper(kExitBadMessage);  // entries never return
}

std::vector<std::string> environment_for_child(const std::vector<std::string>& extra) {
  std::vector<std::string> environment;
  for (char** variable = environ; variable && *variable; ++variable) {
    std::string_view entry(*variable);
    bool mpi = false;
    for (std::string_view prefix : {"OMPI_", "PMIX_", "PMI_", "HYDRA_"}) mpi = mpi || entry.starts_with(prefix);
    if (!mpi && !entry.starts_with(std::string(kSpawnMarker) + "=")) environment.emplace_back(entry);
  }
  environment.insert(environment.end(), extra.begin(), extra.end());
  return environment;
}

}  // namespace forkpool::detail
