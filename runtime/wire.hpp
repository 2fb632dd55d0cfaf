#pragma once
// The pool's protocol between the parent and a worker, on top of ipc frames.
//   task    (parent -> worker): [invoker address][function address][chunk of arguments]
//                               [ids of the storages it lends]...[u32 count of them]
//                               descriptors: those lent storages new to the worker, in order,
//                               then what the arguments attached
//   result  (worker -> parent): the chunk's results
//   error   (worker -> parent): [type name][message] of what the task threw
//   release (parent -> worker): [ids of lent storages the parent released]
// Lent storages are shm/storage_loans.hpp's: the worker keeps them mapped until released.
// Function addresses are valid in the worker because it is a fork of the parent's image.

#include <cstdint>
#include <cstring>
#include <functional>
#include <span>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "ipc/codec.hpp"
#include "shm/storage_loans.hpp"

namespace forkpool::detail {

enum MessageKind : std::uint16_t { kTaskMessage = 1, kResultMessage = 2, kErrorMessage = 3, kReleaseMessage = 4 };

// Decodes a chunk of arguments from `in`, calls the function on each, encodes the results to `out`.
using Invoker = void (*)(std::uintptr_t function, Reader& in, Writer& out);

// What a task may be: a function pointer, or a lambda without captures (an empty,
// default-constructible class).
template <class F>
inline constexpr bool is_sendable_function_v =
    (std::is_pointer_v<F> && std::is_function_v<std::remove_pointer_t<F>>) ||
    (std::is_class_v<F> && std::is_empty_v<F> && std::is_default_constructible_v<F>);

template <class F>
void check_sendable() {
  static_assert(is_sendable_function_v<F>,
                "forkpool: a task must be a function pointer or a lambda without captures; a lambda with "
                "captures cannot cross into a worker process: pass the data as arguments instead");
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

// A void result travels as std::monostate.
template <class R>
using Wire = std::conditional_t<std::is_void_v<R>, std::monostate, R>;

template <class F, class Element, bool Spread>
struct CallResultOf {
  using type = std::invoke_result_t<F&, Element>;
};
template <class F, class Element>
struct CallResultOf<F, Element, true> {
  using type = decltype(std::apply(std::declval<F&>(), std::declval<Element>()));
};

// Each element of a chunk is one call. Spread: the element is a tuple of arguments; otherwise
// it is the single argument.
template <class F, class Element, bool Spread>
struct Call {
  using Result = typename CallResultOf<F, Element, Spread>::type;

  static void invoke(std::uintptr_t bits, Reader& in, Writer& out) {
    F f = rebuild_function<F>(bits);
    std::size_t count = in.read_count(min_encoded_size<Element>(), "chunk");
    out.write_size(count);
    if constexpr (!Spread && Bitwise<Element> && Bitwise<Result>) {
      // Plain numbers in, plain numbers out: read them in place, write results straight out.
      std::span<const std::byte> arguments = in.read_span(count * sizeof(Element));
      ByteBuffer& buffer = out.buffer();
      std::size_t at = buffer.size();
      buffer.resize(at + count * sizeof(Result));
      for (std::size_t i = 0; i < count; ++i) {
        Element argument;
        std::memcpy(&argument, arguments.data() + i * sizeof(Element), sizeof argument);
        Result result = std::invoke(f, argument);
        std::memcpy(buffer.data() + at + i * sizeof(Result), &result, sizeof result);
      }
      in.expect_end();
      return;
    }
    for (std::size_t i = 0; i < count; ++i) {
      Element element = in.read<Element>();
      if constexpr (std::is_void_v<Result>) {
        call(f, std::move(element));
      } else {
        out.write(call(f, std::move(element)));
      }
    }
    in.expect_end();
  }

  static decltype(auto) call(F& f, Element&& element) {
    if constexpr (Spread) {
      return std::apply(f, std::move(element));
    } else {
      return std::invoke(f, std::move(element));
    }
  }
};

// A result message starts with its number of results, which must be the chunk's size.
inline void expect_result_count(Reader& results, std::size_t expected) {
  auto count = results.read<std::uint64_t>();
  if (count != expected)
    results.fail(std::to_string(count) + " results for a chunk of " + std::to_string(expected) + " calls");
}

// The header of a task message.
inline void write_task_header(Writer& w, Invoker invoker, std::uintptr_t function) {
  w.write(static_cast<std::uint64_t>(reinterpret_cast<std::uintptr_t>(invoker)));
  w.write(static_cast<std::uint64_t>(function));
}

// Ends a task message with the ids of the storages it lends.
inline void write_lent_ids(Writer& w, const MessageLoan& loan) {
  for (const auto& storage : loan.storages()) w.write(storage->id());
  w.write(static_cast<std::uint32_t>(loan.storages().size()));
}

// A task message split into its body and the ids it lends. Throws ProtocolError if malformed.
struct TaskParts {
  std::span<const std::byte> body;
  std::vector<std::uint64_t> lent_ids;
};
inline TaskParts split_task(std::span<const std::byte> payload) {
  std::uint32_t count = 0;
  if (payload.size() < sizeof count) throw ProtocolError("forkpool: a task message without its lent-storage count");
  std::memcpy(&count, payload.data() + payload.size() - sizeof count, sizeof count);
  std::size_t table = std::size_t{count} * sizeof(std::uint64_t) + sizeof count;
  if (table > payload.size())
    throw ProtocolError("forkpool: a task message claims " + std::to_string(count) + " lent storages in " +
                        std::to_string(payload.size()) + " bytes");
  TaskParts parts{payload.first(payload.size() - table), std::vector<std::uint64_t>(count)};
  if (count > 0) std::memcpy(parts.lent_ids.data(), payload.data() + parts.body.size(), count * sizeof(std::uint64_t));
  return parts;
}

}  // namespace forkpool::detail
