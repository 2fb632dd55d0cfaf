#pragma once
// forkpool's libtorch part: library and pkg-config name forkpool-torch (docs/torch.md).
#include <forkpool/forkpool.hpp>
#include <forkpool/torch/tensors.hpp>
