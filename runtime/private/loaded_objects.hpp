#pragma once
// The object files (the executable and shared libraries) this process has loaded: where code
// lives, so that a function can be named in terms another process of the same program can
// resolve. A forked worker has every object its parent had when it was forked, at the same
// address; one the parent dlopen()ed later, the worker loads itself (ObjectTranslation).

#include <cstdint>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

namespace forkpool::detail {

struct LoadedObject {
  std::string path;         // as the loader knows it ("" for the main program: /proc/self/exe)
  std::string build_id;     // the GNU build id note, raw bytes ("" when the object has none)
  std::uintptr_t base = 0;  // where it is loaded
  std::uintptr_t size = 0;  // from base to the end of its last loadable segment
};

// Every object loaded now, the main program first.
std::vector<LoadedObject> loaded_objects();

// The load addresses of every object loaded now.
std::shared_ptr<const std::set<std::uintptr_t>> loaded_object_bases();

// The object that holds `address`, or nothing (code made at run time, say).
std::optional<LoadedObject> object_at(std::uintptr_t address);

// A code address as another process of the same program can find it: its object (path, "" for the
// main program, and build id) and the offset from the object's base.
struct CodeAddress {
  std::string path;
  std::string build_id;
  std::uint64_t offset = 0;
};
std::optional<CodeAddress> code_address_of(std::uintptr_t address);
// Where `code` is in this process: only among the objects loaded now (nothing is loaded from a
// path that was sent), and only when the build id matches; nothing otherwise.
std::optional<std::uintptr_t> loaded_address(const CodeAddress& code);

// A worker's view of objects its parent has and it may not have at the same address: loaded
// after forking it, or, in a spawned worker (a fresh run of the program), all of them. For each,
// the parent's address range and where (or whether) this process has it.
class ObjectTranslation {
 public:
  // Loads `object` (the parent's description) here; the main program ("") is our own. A failure
  // (no such file, another build) is remembered, and addresses in it fail with an Error naming
  // the reason.
  void load(const LoadedObject& parents);
  // The address in this process of the parent's `address`: itself unless it lies in an object
  // loaded through load(). Throws Error for an object that could not be loaded.
  std::uintptr_t translate(std::uintptr_t address) const;

 private:
  struct Entry {
    std::uintptr_t parent_base, parent_end, local_base;
    std::string error;
  };
  std::vector<Entry> entries_;
};

}  // namespace forkpool::detail
