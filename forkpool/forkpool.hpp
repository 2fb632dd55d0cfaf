#pragma once
// forkpool: the one header a program includes. It only re-exports the layers.

#include "ipc/channel.hpp"
#include "ipc/codec.hpp"
#include "runtime/async_result.hpp"
#include "runtime/error.hpp"
#include "runtime/io.hpp"
#include "runtime/loop.hpp"
#include "runtime/pool.hpp"
#include "runtime/spawn.hpp"
#include "runtime/stream.hpp"
#include "runtime/task.hpp"
#include "runtime/when_all.hpp"
#include "shm/dlpack.hpp"
#include "shm/sharing.hpp"
#include "shm/tensor.hpp"
#include "shm/tensor_codec.hpp"
