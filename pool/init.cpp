#include <forkpool/pool/init.hpp>

#include <forkpool/pool/private/launcher.hpp>
#include <forkpool/runtime/private/spawned_worker.hpp>

namespace forkpool {

void init() {
  detail::serve_if_spawned_worker();
  detail::start_program_fork_server();
}

}  // namespace forkpool
