// The user's project has its own runtime/error.hpp on its include path: both it and forkpool's
// headers must be the ones meant.
#include <forkpool/forkpool.hpp>

#include "runtime/error.hpp"

static_assert(user_project::kOwnErrorHeader == 1);
static_assert(sizeof(forkpool::RemoteError) > 0);
