#pragma once
// A primitive's update of several words of its shared page, all or nothing across the death of
// the process making it (a redo log). Under the primitive's robust mutex, the new values are
// written to the journal, one store commits them, and only then are they applied. A process
// killed before the commit changed nothing; one killed after it left a committed journal, which
// the next locker (told the holder died) applies again: the values are absolute, so applying
// twice is applying once. Words that waiters read without the mutex (a futex word) are stored
// atomically.
//
// The journal and the words it sets lie in one shared page, whose start is `page`.
//
//   state.journal.commit(&state, {{&state.value, v - 1}, {&slot, packed}});  // mutex held
//   if (guard.holder_died()) state.journal.replay(&state);

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <initializer_list>

namespace forkpool::detail {

class Journal {
 public:
  static constexpr std::size_t kMaxWrites = 6;

  // One word to set: its address (in the same page as the journal) and its new value. A null
  // address sets nothing (nothing(): HolderTable::change when the table has no slot for it).
  struct Write {
    template <class Word>
    requires(sizeof(Word) == 4 || sizeof(Word) == 8) Write(Word* word, std::uint64_t value)
        : address(word), size(sizeof(Word)), value(value) {}
    // A word waiters read without the mutex (a futex word): it is stored atomically.
    template <class Word>
    requires(sizeof(std::atomic<Word>) == sizeof(Word)) Write(std::atomic<Word>* word, std::uint64_t value)
        : Write(reinterpret_cast<Word*>(word), value) {}
    static Write nothing() noexcept { return {static_cast<std::uint64_t*>(nullptr), 0}; }
    void* address;
    std::uint32_t size;
    std::uint64_t value;
  };

  static constexpr std::size_t kPageSize = 4096;

  // Records `writes`, commits and applies them. At most kMaxWrites; the caller holds the mutex.
  void commit(void* page, std::initializer_list<Write> writes) noexcept {
    std::size_t n = 0;
    for (const Write& write : writes) {
      if (!write.address) continue;
      if (n == kMaxWrites) __builtin_trap();  // a caller's bug, never input
      // Offsets in the page: another process maps it at another address.
      entries_[n++] = {
          static_cast<std::uint32_t>(static_cast<std::byte*>(write.address) - static_cast<std::byte*>(page)),
          write.size, write.value};
    }
    count_.store(static_cast<std::uint32_t>(n), std::memory_order_release);  // the commit
    replay(page);
  }

  // Applies a committed journal again, and clears it: after a holder died (the mutex held).
  void replay(void* page) noexcept {
    std::uint32_t n = count_.load(std::memory_order_acquire);
    if (n > kMaxWrites) n = 0;  // a page another process scribbled on: nothing to trust
    for (std::uint32_t i = 0; i < n; ++i) {
      const Entry& entry = entries_[i];
      bool word = entry.size == 4 || entry.size == 8;
      if (!word || entry.offset % entry.size != 0 || entry.offset > kPageSize - entry.size) continue;  // nor here
      std::byte* target = static_cast<std::byte*>(page) + entry.offset;
      if (entry.size == 4)
        __atomic_store_n(reinterpret_cast<std::uint32_t*>(target), static_cast<std::uint32_t>(entry.value),
                         __ATOMIC_RELEASE);
      else if (entry.size == 8)
        __atomic_store_n(reinterpret_cast<std::uint64_t*>(target), entry.value, __ATOMIC_RELEASE);
    }
    count_.store(0, std::memory_order_release);
  }

 private:
  struct Entry {
    std::uint32_t offset;  // in the page
    std::uint32_t size;
    std::uint64_t value;
  };
  Entry entries_[kMaxWrites];
  std::atomic<std::uint32_t> count_;  // committed writes; 0: none pending
};

}  // namespace forkpool::detail
