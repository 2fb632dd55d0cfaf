// A producer/consumer pipeline: producer processes make tensors and put them on a Queue; this
// process takes them, in whatever order they come, and checks each. Tensors cross as shared
// memory, their descriptors inside the queue's messages.
//
//   examples/pipeline [producers] [tensors per producer]

#include <cstdio>
#include <cstdlib>
#include <vector>

#include <forkpool/forkpool.hpp>

namespace fp = forkpool;

constexpr std::int64_t kFloats = 64 * 1024;  // 256 KiB per tensor

void produce(int producer, int count, fp::Queue<fp::Tensor> out) {
  for (int i = 0; i < count; ++i) {
    fp::Tensor t = fp::Tensor::empty({kFloats}, fp::DType::f32);
    std::fill_n(t.data<float>(), kFloats, static_cast<float>(producer * 1'000'000 + i));
    out.put(t);
  }
}

int main(int argc, char** argv) {
  fp::init();
  int producers = argc > 1 ? std::atoi(argv[1]) : 2;
  int per_producer = argc > 2 ? std::atoi(argv[2]) : 500;
  fp::Queue<fp::Tensor> queue(64);  // at most 64 tensors in flight
  std::vector<fp::Process> processes;
  for (int p = 0; p < producers; ++p) processes.push_back(fp::start_process(produce, p, per_producer, queue));
  long received = 0, whole = 0;
  auto started = std::chrono::steady_clock::now();
  for (; received < static_cast<long>(producers) * per_producer; ++received) {
    fp::Tensor t = queue.get();
    const float* v = t.data<float>();
    whole += t.numel() == kFloats && v[0] == v[kFloats - 1];
  }
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  for (auto& p : processes) p.join();
  std::printf("%ld tensors of %lld KiB from %d producers, %ld whole, %.0f tensors/s\n", received,
              static_cast<long long>(kFloats * 4 / 1024), producers, whole, received / seconds);
  return whole == received ? 0 : 1;
}
