// expect: this type has no forkpool::codec<T>
#include <forkpool/forkpool.hpp>

#include <string>

class Job {  // not an aggregate, and no codec
 public:
  explicit Job(std::string name) : name_(std::move(name)) {}

 private:
  std::string name_;
};
int run_job(Job) { return 0; }

int main() {
  forkpool::Pool pool({.processes = 1});
  return pool.apply_async(run_job, Job("x")).get();
}
