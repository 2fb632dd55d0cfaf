#include <forkpool/pool/internal/task_encoding.hpp>

namespace forkpool::detail {

std::shared_ptr<Job> job_part(const std::shared_ptr<Job>& job, std::uint64_t first, std::uint64_t end) {
  std::shared_ptr<Job> root = job->whole ? job->whole : job;
  auto part = std::make_shared<Job>();
  part->sink = root->sink;
  part->chunk = root->chunk;
  part->payload = root->payload;
  part->range = {root->range.count, first, end};
  part->attempts = job->attempts;
  rewrite_task_range({part->payload.data(), part->payload.size()}, root->blocks.table_bytes(), part->range);
  part->whole = std::move(root);
  return part;
}

}  // namespace forkpool::detail
