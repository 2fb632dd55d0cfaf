#pragma once
// forkpool: the one header a program includes, for every public header of libforkpool (what
// API.md lists). forkpool-torch and forkpool-mpi have their own: <forkpool/torch.hpp>, <forkpool/mpi.hpp>.

#if __cplusplus < 202002L
#error "forkpool needs C++20 (-std=c++20)"
#else

#include <forkpool/runtime/async_result.hpp>
#include <forkpool/runtime/error.hpp>
#include <forkpool/runtime/loop.hpp>
#include <forkpool/runtime/scope.hpp>
#include <forkpool/runtime/show_progress.hpp>
#include <forkpool/runtime/task.hpp>
#include <forkpool/runtime/when_all.hpp>
#include <forkpool/ipc/codec.hpp>
#include <forkpool/shm/dlpack.hpp>
#include <forkpool/shm/named_memory.hpp>
#include <forkpool/shm/shared_memory.hpp>
#include <forkpool/shm/sharing.hpp>
#include <forkpool/shm/tensor.hpp>
#include <forkpool/shm/tensor_codec.hpp>
#include <forkpool/sync/pipe.hpp>
#include <forkpool/sync/queue.hpp>
#include <forkpool/sync/semaphore.hpp>
#include <forkpool/sync/shared_value.hpp>
#include <forkpool/sync/sync.hpp>
#include <forkpool/worker/init.hpp>
#include <forkpool/worker/start_method.hpp>
#include <forkpool/worker/worker_info.hpp>
#include <forkpool/pool/as_completed.hpp>
#include <forkpool/pool/pool.hpp>
#include <forkpool/pool/process.hpp>
#include <forkpool/pool/spawn.hpp>
#include <forkpool/pool/stream.hpp>
#include <forkpool/data/dataloader.hpp>

#endif  // C++20
