#pragma once
// What a Lock's shared page holds: a robust, process-shared pthread mutex (Condition reads its
// recursion depth to release an RLock fully while it waits).

#include <pthread.h>

namespace forkpool::detail {

struct LockState {
  pthread_mutex_t mutex;
};

}  // namespace forkpool::detail
