#pragma once
// forkpool: the one header a program includes. It re-exports what the API lists, nothing else.

#if __cplusplus < 202002L
#error "forkpool needs C++20 (-std=c++20)"
#else

#include <forkpool/ipc/codec.hpp>
#include <forkpool/pool/as_completed.hpp>
#include <forkpool/pool/dataloader.hpp>
#include <forkpool/pool/init.hpp>
#include <forkpool/sync/pipe.hpp>
#include <forkpool/pool/pool.hpp>
#include <forkpool/pool/process.hpp>
#include <forkpool/sync/queue.hpp>
#include <forkpool/sync/semaphore.hpp>
#include <forkpool/sync/shared_value.hpp>
#include <forkpool/pool/spawn.hpp>
#include <forkpool/pool/stream.hpp>
#include <forkpool/sync/sync.hpp>
#include <forkpool/pool/worker_info.hpp>
#include <forkpool/runtime/async_result.hpp>
#include <forkpool/runtime/error.hpp>
#include <forkpool/runtime/loop.hpp>
#include <forkpool/runtime/scope.hpp>
#include <forkpool/runtime/show_progress.hpp>
#include <forkpool/runtime/task.hpp>
#include <forkpool/runtime/when_all.hpp>
#include <forkpool/shm/dlpack.hpp>
#include <forkpool/shm/named_memory.hpp>
#include <forkpool/shm/shared_memory.hpp>
#include <forkpool/shm/sharing.hpp>
#include <forkpool/shm/tensor.hpp>
#include <forkpool/shm/tensor_codec.hpp>

#endif  // C++20
