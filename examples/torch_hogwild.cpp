// Hogwild with libtorch, as pytorch's mnist_hogwild: a torch::nn model whose parameters live in
// shared memory, trained by N processes at once without locks, each on its own shard of a
// synthetic regression set. The parent evaluates the shared model before and after: the loss
// falls, and no process copied a parameter.
//
//   torch_hogwild [processes] [steps]

#include <torch/torch.h>

#include <cstdio>
#include <cstdlib>
#include <vector>

#include <forkpool/torch.hpp>

namespace fp = forkpool;

constexpr std::int64_t kFeatures = 16, kSamples = 4096;

// The data set: y = x · w* + 0.5 + noise, the same in every process (a fixed seed).
std::pair<at::Tensor, at::Tensor> dataset() {
  ::torch::manual_seed(0);
  at::Tensor x = ::torch::randn({kSamples, kFeatures});
  at::Tensor true_w = ::torch::linspace(-1, 1, kFeatures).unsqueeze(1);
  at::Tensor y = x.mm(true_w) + 0.5 + 0.01 * ::torch::randn({kSamples, 1});
  return {x, y};
}

// One process: a model on the shared parameters (set_data: no copy), SGD on its shard.
void train(int rank, int world_size, std::vector<at::Tensor> shared, int steps) {
  ::torch::nn::Linear model(kFeatures, 1);
  std::vector<at::Tensor> parameters = model->parameters();
  for (std::size_t i = 0; i < parameters.size(); ++i) parameters[i].set_data(shared[i]);
  auto [x, y] = dataset();
  at::Tensor my_x = x.slice(0, rank, kSamples, world_size), my_y = y.slice(0, rank, kSamples, world_size);
  ::torch::optim::SGD optimizer(model->parameters(), ::torch::optim::SGDOptions(0.05));
  for (int step = 0; step < steps; ++step) {
    std::int64_t first = (step * 32) % my_x.size(0);
    at::Tensor batch_x = my_x.slice(0, first, first + 32), batch_y = my_y.slice(0, first, first + 32);
    optimizer.zero_grad();
    at::Tensor loss = ::torch::mse_loss(model->forward(batch_x), batch_y);
    loss.backward();
    optimizer.step();  // writes the shared parameters, as every other process does
  }
}

double loss_of(::torch::nn::Linear& model) {
  ::torch::NoGradGuard no_grad;
  auto [x, y] = dataset();
  return ::torch::mse_loss(model->forward(x), y).item<double>();
}

int main(int argc, char** argv) {
  fp::init();
  int processes = argc > 1 ? std::atoi(argv[1]) : 4;
  int steps = argc > 2 ? std::atoi(argv[2]) : 400;
  ::torch::nn::Linear model(kFeatures, 1);
  std::vector<at::Tensor> shared;
  for (at::Tensor& parameter : model->parameters()) shared.push_back(fp::torch::share_memory(parameter).detach());
  double before = loss_of(model);
  fp::spawn(train, processes, processes, shared, steps);
  double after = loss_of(model);
  bool all_shared = true;
  for (const at::Tensor& parameter : model->parameters()) all_shared = all_shared && fp::torch::is_shared(parameter);
  std::printf("hogwild: %d processes x %d steps: loss %.4f -> %.4f (parameters in shared memory: %s)\n", processes,
              steps, before, after, all_shared ? "yes" : "no");
  return after < before / 10 && all_shared ? 0 : 1;
}
