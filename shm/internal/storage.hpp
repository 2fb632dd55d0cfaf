#pragma once
// Storage: the bytes behind tensors. Shared storage is
//   - a block of a slab (file_descriptor, slab.hpp): what Tensor::empty makes. Released here, it
//     goes back to its owner's allocator once no process holds it any more;
//   - a whole memfd received outside any conversation that could carry blocks;
//   - or a named /dev/shm segment (file_system).
// Each is mapped once per process and released when the last holder in the process lets go.
// External storage (from DLPack) is memory forkpool does not own and cannot share without a copy.

#include <sys/types.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <forkpool/ipc/internal/mapping.hpp>
#include <forkpool/runtime/unique_fd.hpp>
#include <forkpool/shm/internal/slab.hpp>
#include <forkpool/shm/sharing.hpp>

namespace forkpool::detail {

class Storage {
 public:
  // New shared storage of `bytes`, of the kind the current sharing strategy names. Recycled
  // memory is not cleared: its bytes are whatever the last tensor in it left.
  static std::shared_ptr<Storage> allocate(std::size_t bytes);
  // Memory owned elsewhere; `release` runs when the last holder lets go.
  static std::shared_ptr<Storage> external(std::byte* data, std::size_t bytes, std::function<void()> release);

  // Receiving. Each validates before mapping (a memfd sealed against shrinking and growing, or a
  // regular file directly in /dev/shm with a forkpool name, at least `min_bytes` long) and throws
  // ProtocolError otherwise. A storage this process already maps is reused, not mapped again.
  static std::shared_ptr<Storage> adopt_memfd(UniqueFd fd, std::size_t min_bytes);
  // Takes over the reference the sender added for its message (see add_message_reference).
  static std::shared_ptr<Storage> adopt_named(const std::string& name, std::size_t min_bytes);

  // In a helper process that closed the descriptors it inherited: the storages its parent
  // mapped before the fork are not reused (their descriptors are gone; a storage received again
  // is mapped afresh).
  static void forget_inherited() noexcept;

  // Made only by the factories above (the key is theirs): public for std::make_shared, which
  // puts the storage and its count in one allocation.
  class Key {
    friend class Storage;
    explicit Key() = default;
  };
  explicit Storage(Key);
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;

  // Unique among this process's storages, never reused: the name a peer borrows it under.
  std::uint64_t id() const noexcept { return id_; }
  std::byte* data() const noexcept { return data_; }
  std::size_t size() const noexcept { return size_; }
  bool is_shared() const noexcept { return kind_ != Kind::external; }
  // A block of a slab: where it lies in the slab.
  Slab* slab() const noexcept { return slab_.get(); }
  std::size_t slab_offset() const noexcept { return slab_offset_; }
  SharingStrategy strategy() const noexcept {
    return kind_ == Kind::named ? SharingStrategy::file_system : SharingStrategy::file_descriptor;
  }
  // file_descriptor storage: the memfd to send (a block's is its slab's).
  int fd() const noexcept;
  // file_system storage: the segment's name under /dev/shm.
  const std::string& name() const noexcept { return name_; }
  // file_system: counts one more holder for a message about to carry the name; the receiver
  // takes it over. Throws Error if another process truncated the segment. The segment's name is unlinked when its count
  // of holders reaches zero.
  void add_message_reference();
  // `listener` is told when this storage is released here (unless it is gone by then).
  void notify_on_release(const std::shared_ptr<ReleaseListener>& listener);

  // One object a binding keeps per storage (forkpool-torch: a weak handle to the torch storage
  // over these bytes, so that tensors of one block share it). `release(object)` runs when the
  // storage goes; whoever replaces the object releases the old one.
  struct Binding {
    void* object = nullptr;
    void (*release)(void*) noexcept = nullptr;
  };
  // Runs `use(binding)` under the storage's lock. Any thread. `use` must not let go of anything
  // that may hold this storage.
  template <class F>
  decltype(auto) with_binding(F&& use) {
    std::lock_guard lock(mutex_);
    struct Publish {  // after `use`, before the unlock
      Storage& storage;
      ~Publish() { storage.bound_.store(storage.binding_.object != nullptr, std::memory_order_relaxed); }
    } publish{*this};
    return std::forward<F>(use)(binding_);
  }
  // Whether a binding is set, without the lock (a worker's decode, which would only find none,
  // skips it): one set on another thread at this moment may not be seen yet.
  bool has_binding() const noexcept { return bound_.load(std::memory_order_relaxed); }

 private:
  friend class Slab;
  enum class Kind { block, memfd, named, external };
  static std::shared_ptr<Storage> block(std::shared_ptr<Slab> slab, std::size_t offset, std::size_t bytes);
  static std::shared_ptr<Storage> cached(dev_t device, ino_t inode);
  static void remember(const std::shared_ptr<Storage>& storage, dev_t device, ino_t inode);
  static void allocate_named(Storage& storage, std::size_t bytes);
  // file_system: the segment is still as long as our mapping (no other process truncated it).
  bool segment_intact() const noexcept;
  std::atomic<std::int64_t>* holders() const noexcept;

  Kind kind_ = Kind::memfd;
  std::shared_ptr<Slab> slab_;  // block
  std::size_t slab_offset_ = 0;
  UniqueFd fd_;
  Mapping mapping_;
  std::byte* data_ = nullptr;
  std::size_t size_ = 0;
  std::string name_;
  std::function<void()> release_;
  dev_t device_ = 0;
  ino_t inode_ = 0;
  bool cached_ = false;
  std::uint64_t id_;
  std::mutex mutex_;  // for listeners_ and binding_: a storage may be lent and used on several threads
  std::vector<std::weak_ptr<ReleaseListener>> listeners_;
  Binding binding_;
  std::atomic<bool> bound_{false};  // binding_.object != nullptr, for has_binding
};

}  // namespace forkpool::detail
