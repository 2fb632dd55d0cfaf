#pragma once
// SharedMemory: a named block in /dev/shm that other processes, and other programs, attach by
// name, as Python's multiprocessing.shared_memory.SharedMemory.
//
//   auto block = forkpool::SharedMemory::create("forkpool-frames", 1 << 20);
//   // another process or program:
//   auto same = forkpool::SharedMemory::attach("forkpool-frames");
//
// What is left behind: a block is unlinked by unlink(), and otherwise by the name tracker once
// every process that created or attached it has ended, also when they were SIGKILLed (as
// file_system tensors are). The tracker only touches names that start with "forkpool-", so
// create() wants such a name, unless the block is made to outlive the program (`outlive`
// true): then it stays until someone calls unlink() (or `rm /dev/shm/<name>`). Handles are
// copies of one mapping; passed as an argument (start_process, spawn, pool tasks) the receiver
// maps the same block. Any thread.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include <forkpool/ipc/codec.hpp>
#include <forkpool/runtime/internal/shared_handle.hpp>

namespace forkpool {

class SharedMemory {
 public:
  // A new zero-filled block of `size` bytes; an empty name: a fresh "forkpool-shm-..." name.
  // Throws std::invalid_argument for a size of 0, a name with '/' or, unless `outlive`, one without the
  // "forkpool-" prefix; std::system_error when it exists already (EEXIST) or /dev/shm is full.
  static SharedMemory create(std::string name, std::size_t size, bool outlive = false);
  // The block named `name`, made by this program or another. Throws std::system_error (ENOENT
  // when there is none).
  static SharedMemory attach(std::string name);

  std::span<std::byte> bytes() const;
  const std::string& name() const;
  // Removes the name now: attach() fails from here on; mappings stay valid until released.
  void unlink();

 private:
  friend struct codec<SharedMemory>;
  struct Block;
  explicit SharedMemory(std::shared_ptr<Block> block) : block_(std::move(block)) {}
  static SharedMemory map(std::string name, int fd, bool track);
  detail::SharedHandle<Block, "SharedMemory"> block_;
};

template <>
struct codec<SharedMemory> {
  static constexpr std::size_t min_size = sizeof(std::uint32_t) + sizeof(std::uint64_t);
  static void encode(Writer& w, const SharedMemory& memory);
  static SharedMemory decode(Reader& r);
};

}  // namespace forkpool
