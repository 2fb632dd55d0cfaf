#pragma once
// The parent's side of a task message (worker/internal/protocol.hpp): a job's chunk encoded, and
// a part of it to send again.

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <memory>
#include <type_traits>

#include <forkpool/ipc/codec.hpp>
#include <forkpool/ipc/internal/spare_buffers.hpp>
#include <forkpool/pool/internal/job.hpp>
#include <forkpool/worker/internal/protocol.hpp>

namespace forkpool::detail {

// A copy of `job` that runs elements [first, end) of its chunk: the same payload, with the
// range in its trailer patched, sharing the job's blocks.
std::shared_ptr<Job> job_part(const std::shared_ptr<Job>& job, std::uint64_t first, std::uint64_t end);

// What a task of a few plain arguments takes: head, elements, range and an empty block table
// (held inline in its job).
inline constexpr std::size_t kSmallTaskBytes = JobPayload::kInlineBytes;

// Encodes up to `limit` elements from [it, end) as one task message into `job` (payload, loan,
// attachments); returns how many it took.
template <class F, class Element, bool Spread, class It, class End>
std::size_t encode_task(Job& job, F f, It& it, const End& end, std::size_t limit) {
  Writer w(&job.blocks);  // tensors name their blocks in the job's table
  w.buffer() = take_spare_buffer();
  // A small task in one allocation: the vector's growth from empty would make several.
  w.buffer().reserve(kSmallTaskBytes);
  write_task_head(w, reinterpret_cast<std::uintptr_t>(&Call<F, Element, Spread>::invoke), function_bits(f));
  std::size_t count = 0;
  if constexpr (Bitwise<Element> && std::contiguous_iterator<It> && std::sized_sentinel_for<End, It> &&
                std::is_same_v<std::iter_value_t<It>, Element>) {
    // Plain numbers in contiguous memory: one copy for the whole chunk.
    count = std::min<std::size_t>(limit, static_cast<std::size_t>(end - it));
    w.write_bytes(std::to_address(it), count * sizeof(Element));
    it += static_cast<std::iter_difference_t<It>>(count);
  } else {
    for (; count < limit && it != end; ++count, ++it) w.write(static_cast<Element>(*it));
  }
  job.range = {count, 0, count};
  write_task_tail(w, job.range, job.blocks);
  job.payload = std::move(w.buffer());
  job.attachments = std::move(w.attachments());
  return count;
}

}  // namespace forkpool::detail
