// Hogwild with libtorch, as pytorch's mnist_hogwild: a torch::nn model whose parameters live in
// shared memory, trained by N processes at once without locks, each on its own shard of a
// synthetic classification set (4 classes). The parent evaluates the shared model before and
// after: the loss falls, the accuracy rises, and no process copied a parameter.
//
//   torch_hogwild [processes] [steps per process]

// The parts of <torch/torch.h> used here: it compiles in a third of the time.
#include <ATen/ATen.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include <forkpool/torch.hpp>

namespace fp = forkpool;

constexpr std::int64_t kFeatures = 16, kClasses = 4, kSamples = 8192, kBatch = 32;

// The data set, the same in every process (a fixed seed): the class of x is the largest of
// x · w* over 4 fixed directions w*, so a linear model can learn it.
std::pair<at::Tensor, at::Tensor> dataset() {
  ::torch::manual_seed(0);
  at::Tensor x = ::torch::randn({kSamples, kFeatures});
  at::Tensor directions = ::torch::randn({kFeatures, kClasses});
  return {x, x.mm(directions).argmax(1)};
}

// One process: a model on the shared parameters (set_data: no copy), SGD on its shard.
void train(int rank, int world_size, std::vector<at::Tensor> shared, int steps) {
  ::torch::nn::Linear model(kFeatures, kClasses);
  std::vector<at::Tensor> parameters = model->parameters();
  for (std::size_t i = 0; i < parameters.size(); ++i) parameters[i].set_data(shared[i]);
  auto [x, y] = dataset();
  at::Tensor my_x = x.slice(0, rank, kSamples, world_size), my_y = y.slice(0, rank, kSamples, world_size);
  ::torch::optim::SGD optimizer(model->parameters(), ::torch::optim::SGDOptions(0.1));
  for (int step = 0; step < steps; ++step) {
    std::int64_t first = (step * kBatch) % (my_x.size(0) - kBatch);
    at::Tensor batch_x = my_x.slice(0, first, first + kBatch), batch_y = my_y.slice(0, first, first + kBatch);
    optimizer.zero_grad();
    at::Tensor loss = ::torch::nn::functional::cross_entropy(model->forward(batch_x), batch_y);
    loss.backward();
    optimizer.step();  // writes the shared parameters, as every other process does
  }
}

struct Evaluation {
  double loss, accuracy;
};
Evaluation evaluate(::torch::nn::Linear& model) {
  ::torch::NoGradGuard no_grad;
  auto [x, y] = dataset();
  at::Tensor logits = model->forward(x);
  return {::torch::nn::functional::cross_entropy(logits, y).item<double>(),
          logits.argmax(1).eq(y).to(at::kDouble).mean().item<double>()};
}

int main(int argc, char** argv) {
  fp::init();
  int processes = argc > 1 ? std::atoi(argv[1]) : 4;
  int steps = argc > 2 ? std::atoi(argv[2]) : 400;
  ::torch::nn::Linear model(kFeatures, kClasses);
  fp::torch::share_memory(*model);  // as model.share_memory() in Python
  std::vector<at::Tensor> shared;
  for (const at::Tensor& parameter : model->parameters()) shared.push_back(parameter.detach());
  Evaluation before = evaluate(model);
  auto started = std::chrono::steady_clock::now();
  fp::spawn(train, processes, processes, shared, steps);
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  Evaluation after = evaluate(model);
  bool all_shared = true;
  for (const at::Tensor& parameter : model->parameters()) all_shared = all_shared && fp::torch::is_shared(parameter);
  std::printf(
      "hogwild: %d processes x %d steps in %.3f s: loss %.4f -> %.4f, accuracy %.3f -> %.3f (parameters in shared "
      "memory: %s)\n",
      processes, steps, seconds, before.loss, after.loss, before.accuracy, after.accuracy, all_shared ? "yes" : "no");
  return after.loss < before.loss / 2 && after.accuracy > 0.8 && all_shared ? 0 : 1;
}
