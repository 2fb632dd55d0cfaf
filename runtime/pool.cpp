#include "runtime/pool.hpp"

#include "runtime/loop.hpp"

namespace forkpool {

Pool::Pool(PoolOptions options) : core_(detail::PoolCore::create(std::move(options))) {}

Pool::~Pool() {
  core_->terminate();
  Loop& loop = Loop::current();
  if (!loop.driving()) loop.finish_lingering();  // else run() finishes it when its task ends
}

void Pool::close() { core_->close(); }
void Pool::terminate() { core_->terminate(); }
Task<void> Pool::join() { return core_->join(); }
int Pool::processes() const { return core_->processes(); }
std::vector<pid_t> Pool::worker_pids() const { return core_->worker_pids(); }

}  // namespace forkpool
