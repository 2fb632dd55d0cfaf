#include <forkpool/pool/pool.hpp>

#include <mutex>
#include <vector>

namespace forkpool {

Pool::Pool(PoolOptions options) : core_(detail::PoolCore::create(std::move(options))) {}
Pool::Pool(PoolOptions options, std::string process_name)
    : core_(detail::PoolCore::create(std::move(options), std::move(process_name))) {}
Pool::Pool(PoolOptions options, detail::JobsDieWithWorker)
    : core_(detail::PoolCore::create(std::move(options), {}, /*jobs_die_with_worker=*/true)) {}

Pool::~Pool() {
  if (!core_->in_owner_process()) {
    // A forked child's copy: its workers, fork server and descriptors are the parent's. Kept
    // reachable, never run, so that nothing of the parent's is killed or closed from here. (Out
    // of memory in a destructor ends the program.)
    static std::mutex mutex;
    static auto* inherited =
        new std::vector<std::shared_ptr<detail::PoolCore>>;  // NOLINT(bugprone-unhandled-exception-at-new)
    std::lock_guard lock(mutex);
    inherited->push_back(std::move(core_));
    return;
  }
  core_->shut_down();
}

void Pool::close() {
  core_->check_owner("Pool::close");
  core_->close();
}
void Pool::terminate() {
  core_->check_owner("Pool::terminate");
  core_->terminate();
}
Task<void> Pool::join() {
  core_->check_owner("Pool::join");
  return core_->join();
}
int Pool::processes() const { return core_->processes(); }
std::vector<pid_t> Pool::worker_pids() const {
  core_->check_owner("Pool::worker_pids");
  return core_->worker_pids();
}

}  // namespace forkpool
