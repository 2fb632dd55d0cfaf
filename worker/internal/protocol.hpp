#pragma once
// The pool's protocol between the parent and a worker. Each message is one ipc frame (kind,
// request id, payload, descriptors):
//
//   task    (parent -> worker): encode_task() writes it, read_task() reads it.
//     payload      [u64 invoker address][u64 function address]
//                  [the chunk's elements, each codec-encoded]
//                  [u64 element count][u64 first][u64 end]
//                  [table of blocks] (shm/internal/block_table.hpp)
//                  the worker calls elements [first, end) of the chunk (all of them, but for a
//                  retried part of a chunk whose worker died: see ElementRange)
//     descriptors  what the elements attached, which they name by index
//   hello   (parent -> worker): the first message: a HelloMessage, with the worker's
//                               RunningSlot, the rings and the two wake eventfds
//   result  (worker -> parent): [u64 count of results, end - first][results...][table of blocks]
//                               [release][u32 its length]: what the task let go of
//   error   (worker -> parent): [type name][message] of what the task threw; with request id 0,
//                               of what the pool's initializer threw (the worker then exits)
//   slabs   (either way): the slabs the next message names that are new to the receiver,
//                         with their descriptors (PeerMemory::Introduction)
//   release (either way): blocks let go and slabs gone (PeerMemory::Release)
//   load object (parent -> worker): [path][build id][base][size] of an object the parent loaded
//                               after forking the worker, sent before the first task whose
//                               function is in it; the worker loads it and translates addresses
//
// Function addresses are the parent's. A forked worker shares its image; a spawned one, or one
// told to load an object, translates them (ObjectTranslation) before it calls anything.

#include <atomic>
#include <sys/types.h>

#include <cstdint>
#include <exception>
#include <cstring>
#include <array>
#include <chrono>
#include <optional>
#include <functional>
#include <iterator>
#include <span>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <forkpool/ipc/codec.hpp>
#include <forkpool/shm/internal/block_table.hpp>
#include <forkpool/shm/sharing.hpp>
#include <forkpool/runtime/task.hpp>

namespace forkpool::detail {

struct Message;
class PeerMemory;
struct LoadedObject;

// Which elements of an encoded chunk a task runs: [first, end) of `count`.
struct ElementRange {
  std::uint64_t count = 0;
  std::uint64_t first = 0;
  std::uint64_t end = 0;
  std::uint64_t size() const noexcept { return end - first; }
};

enum MessageKind : std::uint16_t {
  kTaskMessage = 1,
  kResultMessage = 2,
  kErrorMessage = 3,
  kReleaseMessage = 4,
  kHelloMessage = 5,
  kLoadObjectMessage = 6,
  kSlabMessage = 7,
  kReadyMessage = 8,  // worker -> parent, once: its initializer succeeded, tasks come next
};

// Shared between the parent and one worker: the request id of the last task the worker took up
// (0 before the first). A worker is sent its jobs in rising id order and takes them up in that
// order, so after its death a job in flight with a higher id never started; one with this id or
// lower ran (its reply, if sent, was unreadable).
//
// A job sent and not taken up can be withdrawn: moved to another worker (the pool evens out its
// workers' queues), dropped (its map failed) or cancelled. One of the two sides wins, never both:
// the worker stores `request_id`, then takes the job up by exchanging its claim word for
// kTaken|id; the parent withdraws it by a compare-exchange to kWithdrawn|id, which fails once the
// worker has taken it. A withdrawn job's message is still read by the worker, and skipped without
// a reply. When withdrawing fails, `request_id` (stored before the exchange the parent saw) says
// whether the job is running now (cancel then stops the worker) or has finished.
//
// Claim words are reused: the parent never gives two unsettled jobs of one worker (in flight, or
// withdrawn and not yet passed by the worker) the same one (PoolWorker::claim_word_free).
struct RunningSlot {
  static constexpr std::size_t kClaims = 4096;  // pool_core.cpp: more than twice the most jobs a worker holds
  static constexpr std::uint64_t kTaken = 1ull << 63;
  static constexpr std::uint64_t kWithdrawn = 1ull << 62;
  std::atomic<std::uint64_t> request_id;
  std::atomic<std::uint64_t> element;  // of that task's chunk: the one being called
  std::atomic<std::uint64_t> claims[kClaims];

  static std::size_t claim_index(std::uint64_t id) noexcept { return id % kClaims; }
  // The worker, after storing `request_id`: true when it may run job `id`, false when the
  // parent withdrew it.
  bool take_up(std::uint64_t id) noexcept { return claims[claim_index(id)].exchange(kTaken | id) != (kWithdrawn | id); }
  // The parent: true when the worker will not run job `id` (it had not taken it up).
  bool withdraw(std::uint64_t id) noexcept {
    std::atomic<std::uint64_t>& word = claims[claim_index(id)];
    std::uint64_t seen = word.load();
    while (seen != (kTaken | id))
      if (word.compare_exchange_weak(seen, kWithdrawn | id)) return true;
    return false;
  }
};
inline constexpr std::size_t kRunningSlotBytes = std::size_t{9} * 4096;
static_assert(sizeof(RunningSlot) <= kRunningSlotBytes);

// A chunk is sent whole; when its worker dies, the part before the element that was running and
// the part after it are sent again as ranges of the same payload (ElementRange, pool/internal/task_encoding.hpp), and
// that element alone carries the retry: one poison element cannot use up a whole chunk's retries.

// Decodes the elements of `range` from `in` (skipping those before it), calls the function on
// each, encodes the results to `out`; says which element it calls in `running`.
using Invoker = void (*)(std::uintptr_t function, const ElementRange& range, Reader& in, Writer& out,
                         std::atomic<std::uint64_t>& running);

// What a task may be: a function pointer, or a lambda without captures (an empty,
// default-constructible class).
template <class F>
inline constexpr bool is_sendable_function_v = (std::is_pointer_v<F> && std::is_function_v<std::remove_pointer_t<F>>) ||
                                               (std::is_class_v<F> && std::is_empty_v<F> &&
                                                std::is_default_constructible_v<F>);

template <class F>
void check_sendable() {
  static_assert(is_sendable_function_v<F>,
                "forkpool: a task must be a function pointer or a lambda without captures: a "
                "std::function, a member function pointer, a functor with state or a lambda with "
                "captures cannot cross into a worker process; pass the data (or the object) as "
                "arguments instead");
}

template <class F>
std::uintptr_t function_bits(F f) {
  if constexpr (std::is_pointer_v<F>) {
    return reinterpret_cast<std::uintptr_t>(f);
  } else {
    return 0;  // a captureless lambda is rebuilt from its type
  }
}

template <class F>
F rebuild_function(std::uintptr_t bits) {
  if constexpr (std::is_pointer_v<F>) {
    return reinterpret_cast<F>(bits);
  } else {
    return F{};
  }
}

// Whether f can take a decoded element (spread: its tuple's values) as they arrive, as rvalues.
template <class F, class Tuple>
struct ApplyResult {
  using type = decltype(std::apply(std::declval<F&>(), std::declval<Tuple>()));
};

template <class F, class Element, bool Spread>
inline constexpr bool takes_element_v = std::is_invocable_v<F&, Element>;
template <class F, class... Args>
inline constexpr bool takes_element_v<F, std::tuple<Args...>, true> = std::is_invocable_v<F&, Args...>;
template <class F, class A, class B>
inline constexpr bool takes_element_v<F, std::pair<A, B>, true> = std::is_invocable_v<F&, A, B>;

// (void when f cannot take it: the static_assert's message is then the only error.)
template <class F, class Element, bool Spread>
struct CallResultOf {
  static_assert(takes_element_v<F, Element, Spread>,
                "forkpool: the task cannot be called with these arguments as they arrive (values, "
                "decoded in the worker): take each by value or by const reference; a non-const "
                "reference would change a copy the caller never sees, so return the new value instead");
  using Result = std::conditional_t<Spread, ApplyResult<F, Element>, std::invoke_result<F&, Element>>;
  using type = typename std::conditional_t<takes_element_v<F, Element, Spread>, Result, std::type_identity<void>>::type;
};

// Each element of a chunk is one call. Spread: the element is a tuple of arguments; otherwise
// it is the single argument.
template <class F, class Element, bool Spread>
struct Call {
  using Result = typename CallResultOf<F, Element, Spread>::type;

  static void invoke(std::uintptr_t bits, const ElementRange& range, Reader& in, Writer& out,
                     std::atomic<std::uint64_t>& running) {
    F f = rebuild_function<F>(bits);
    in.check_count(range.count, min_encoded_size<Element>(), "chunk");
    out.write_size(range.size());
    if constexpr (!Spread && Bitwise<Element> && Bitwise<Result>) {
      // Plain numbers in, plain numbers out: read them in place, write results straight out.
      std::span<const std::byte> arguments = in.read_span(range.count * sizeof(Element));
      ByteBuffer& buffer = out.buffer();
      std::size_t at = buffer.size();
      buffer.resize(at + range.size() * sizeof(Result));
      for (std::size_t i = range.first; i < range.end; ++i) {
        running.store(i, std::memory_order_relaxed);
        Element argument;
        std::memcpy(&argument, arguments.data() + i * sizeof(Element), sizeof argument);
        Result result = std::invoke(f, argument);
        std::memcpy(buffer.data() + at + (i - range.first) * sizeof(Result), &result, sizeof result);
      }
      in.expect_end();
      return;
    }
    for (std::size_t i = 0; i < range.first; ++i) (void)in.read<Element>();  // run before
    for (std::size_t i = range.first; i < range.end; ++i) {
      running.store(i, std::memory_order_relaxed);
      Element element = in.read<Element>();
      if constexpr (std::is_void_v<Result>) {
        call(f, std::move(element));
      } else {
        out.write(call(f, std::move(element)));
      }
    }
    if (range.end == range.count) in.expect_end();
  }

  static decltype(auto) call(F& f, Element&& element) {
    if constexpr (Spread) {
      return std::apply(f, std::move(element));
    } else {
      return std::invoke(f, std::move(element));
    }
  }
};

// The result type of calling F on one element (Spread: the element's tuple as arguments).
template <class F, class Element, bool Spread>
using CallResult = typename Call<F, Element, Spread>::Result;

// The task message's layout is known here and in protocol.cpp only. A task is written as
// its head (the two code addresses), its elements, and its tail (the range and the block table).
void write_task_head(Writer& w, std::uint64_t invoker, std::uint64_t function);
void write_task_tail(Writer& w, const ElementRange& range, const OutgoingBlocks& blocks);

// A task message's body (its payload without the block table), parsed once. Throws ProtocolError
// when it is too short or its range is not within its chunk.
struct TaskLayout {
  std::uint64_t invoker = 0;
  std::uint64_t function = 0;  // 0: a captureless lambda, rebuilt from its type
  std::span<const std::byte> elements;
  ElementRange range;
};
TaskLayout parse_task(std::span<const std::byte> body);
// The two code addresses at the front of an encoded task payload (invoker, function).
std::array<std::uint64_t, 2> task_code_addresses(std::span<const std::byte> payload);

// Rewrites the range in an encoded task message (a part of a chunk sent again after its worker
// died: the same payload, another range). `table_bytes`: the size of its block table.
void rewrite_task_range(std::span<std::byte> payload, std::size_t table_bytes, const ElementRange& range);

// A task message as the worker runs it.
struct TaskCall {
  Invoker invoker;
  std::uintptr_t function;
  ElementRange range;
  std::span<const std::byte> elements;  // in the message
  IncomingBlocks blocks;                // what the elements' tensors name
};
// Reads `task`, resolving the blocks it carries through `memory`. Throws ProtocolError when the
// message is malformed.
TaskCall read_task(Message& task, PeerMemory& memory);

// The payload of the hello: who the worker is (worker_info()) and how it talks.
struct HelloMessage {
  std::int32_t worker_id;
  std::int32_t workers;
  std::uint64_t seed;
  SharingStrategy sharing;                       // the parent's, as a forked worker would have it
  std::optional<std::chrono::nanoseconds> spin;  // PoolOptions::spin (none: adaptive)
  pid_t parent;                                  // the pool's process
};
Writer encode_hello(const HelloMessage& hello);
HelloMessage decode_hello(std::span<const std::byte> payload);  // ProtocolError when malformed

// A loaded object as it crosses: [path][build id][base][size].
using ObjectRecord = std::tuple<std::string, std::string, std::uint64_t, std::uint64_t>;
ObjectRecord record_of(const LoadedObject& object);
LoadedObject object_of(ObjectRecord record);

// The payload of a load-object message.
Writer encode_object(const LoadedObject& object);
LoadedObject decode_object(std::span<const std::byte> payload);

// The payload of an error message: the type name and message of the exception being handled
// (encode), and back into exception E (decode; ProtocolError when malformed).
Writer encode_current_exception();
template <class E>
std::exception_ptr decode_exception(std::span<const std::byte> payload, pid_t worker_pid) {
  auto [type, text] = decode<std::pair<std::string, std::string>>(payload);
  return std::make_exception_ptr(E(std::move(type), std::move(text), worker_pid));
}

// A result message: [u64 count of results][results...][table of blocks][release][u32 its
// length]. The invoker writes the count and the results (Call::invoke); the worker appends the
// table of the blocks the results name (OutgoingBlocks::write_table) and what the task let go of
// (append_release), which may include blocks of the parent's the results return: the parent
// takes the results' blocks before it reads the release.
struct ResultLayout {
  std::span<const std::byte> release;
  TabledPayload results;  // the count and the results; the table of their blocks
};
ResultLayout parse_result(std::span<const std::byte> payload);  // ProtocolError when malformed

// Reads the results of elements `range` of a chunk of `chunk_size` calls, as every sink does:
// the count must be the range's, each result goes to `store(index in the chunk, R&&)`, and
// nothing may follow. Throws ProtocolError otherwise.
void expect_result_count(Reader& results, const ElementRange& range, std::size_t chunk_size);
template <class R, class Store>
void read_results(Reader& results, const ElementRange& range, std::size_t chunk_size, Store&& store) {
  expect_result_count(results, range, chunk_size);
  for (std::uint64_t i = range.first; i < range.end; ++i) store(static_cast<std::size_t>(i), results.read<R>());
  results.expect_end();
}

}  // namespace forkpool::detail
