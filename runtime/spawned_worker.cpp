#include <forkpool/runtime/internal/spawned_worker.hpp>

#include <stdlib.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <string_view>

#include <forkpool/runtime/internal/process.hpp>

extern char** environ;

namespace forkpool::detail {
namespace {

std::atomic<SpawnedWorkerEntry> registered_entry{nullptr};

}  // namespace

void set_spawned_worker_entry(SpawnedWorkerEntry entry) noexcept { registered_entry.store(entry); }

void serve_if_spawned_worker() {
  const char* mark = std::getenv(kSpawnMarker);
  if (!mark) return;
  int fd = std::atoi(mark);
  unsetenv(kSpawnMarker);
  SpawnedWorkerEntry entry = registered_entry.load();
  if (!entry || fd < 0) {
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
