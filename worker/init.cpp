#include <forkpool/worker/init.hpp>

#include <forkpool/worker/private/launcher.hpp>
#include <forkpool/runtime/private/spawned_worker.hpp>

namespace forkpool {

void init() {
  detail::serve_if_spawned_worker();
  detail::start_program_fork_server();
}

}  // namespace forkpool
