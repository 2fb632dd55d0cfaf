#include <forkpool/runtime/private/loaded_objects.hpp>

#include <dlfcn.h>
#include <elf.h>
#include <link.h>

#include <cstring>

#include <forkpool/runtime/error.hpp>

namespace forkpool::detail {
namespace {

std::string build_id_of(const dl_phdr_info& info) {
  for (int i = 0; i < info.dlpi_phnum; ++i) {
    const ElfW(Phdr)& segment = info.dlpi_phdr[i];
    if (segment.p_type != PT_NOTE) continue;
    auto at = info.dlpi_addr + segment.p_vaddr;
    auto end = at + segment.p_memsz;
    while (at + sizeof(ElfW(Nhdr)) <= end) {
      const auto* note = reinterpret_cast<const ElfW(Nhdr)*>(at);
      auto name = at + sizeof(ElfW(Nhdr));
      auto desc = name + ((note->n_namesz + 3) & ~3u);
      if (note->n_type == NT_GNU_BUILD_ID && note->n_namesz == 4 &&
          std::memcmp(reinterpret_cast<const char*>(name), "GNU", 4) == 0)
        return std::string(reinterpret_cast<const char*>(desc), note->n_descsz);
      at = desc + ((note->n_descsz + 3) & ~3u);
    }
  }
  return {};
}

LoadedObject describe(const dl_phdr_info& info) {
  LoadedObject object;
  object.path = info.dlpi_name ? info.dlpi_name : "";
  object.build_id = build_id_of(info);
  object.base = info.dlpi_addr;
  for (int i = 0; i < info.dlpi_phnum; ++i)
    if (info.dlpi_phdr[i].p_type == PT_LOAD)
      object.size = std::max<std::uintptr_t>(object.size, info.dlpi_phdr[i].p_vaddr + info.dlpi_phdr[i].p_memsz);
  return object;
}

template <class F>
void each_object(F f) {
  dl_iterate_phdr(
      [](dl_phdr_info* info, std::size_t, void* data) {
        (*static_cast<F*>(data))(*info);
        return 0;
      },
      &f);
}

// The object loaded here under `path` ("" for the main program), or nothing.
std::optional<LoadedObject> loaded_object_named(const std::string& path) {
  std::optional<LoadedObject> here;
  each_object([&](const dl_phdr_info& info) {
    if (!here && path == (info.dlpi_name ? info.dlpi_name : "")) here = describe(info);
  });
  return here;
}

}  // namespace

std::vector<LoadedObject> loaded_objects() {
  std::vector<LoadedObject> objects;
  each_object([&](const dl_phdr_info& info) { objects.push_back(describe(info)); });
  return objects;
}

std::shared_ptr<const std::set<std::uintptr_t>> loaded_object_bases() {
  auto bases = std::make_shared<std::set<std::uintptr_t>>();
  each_object([&](const dl_phdr_info& info) { bases->insert(info.dlpi_addr); });
  return bases;
}

std::optional<LoadedObject> object_at(std::uintptr_t address) {
  std::optional<LoadedObject> found;
  each_object([&](const dl_phdr_info& info) {
    if (found) return;
    for (int i = 0; i < info.dlpi_phnum; ++i) {
      const ElfW(Phdr)& segment = info.dlpi_phdr[i];
      std::uintptr_t begin = info.dlpi_addr + segment.p_vaddr;
      if (segment.p_type == PT_LOAD && address >= begin && address < begin + segment.p_memsz) {
        found = describe(info);
        return;
      }
    }
  });
  return found;
}

void ObjectTranslation::load(const LoadedObject& parents) {
  Entry entry{parents.base, parents.base + parents.size, 0, {}};
  bool main_program = parents.path.empty();
  // RTLD_NODELETE: a function we resolved stays valid for the worker's life.
  if (main_program || dlopen(parents.path.c_str(), RTLD_NOW | RTLD_NODELETE)) {
    std::optional<LoadedObject> here = loaded_object_named(parents.path);
    if (!here) {
      entry.error = "it was loaded but not found among the loaded objects";
    } else if (here->build_id != parents.build_id) {
      entry.error = "the file is another build than the parent's (its build id differs)";
    } else {
      entry.local_base = here->base;
    }
  } else {
    const char* why = dlerror();
    entry.error = why ? why : "dlopen failed";
  }
  if (!entry.error.empty())
    entry.error = "forkpool: the worker cannot load " +
                  (main_program ? std::string("the main program") : parents.path) + ": " + entry.error;
  entries_.push_back(std::move(entry));
}

std::uintptr_t ObjectTranslation::translate(std::uintptr_t address) const {
  for (auto it = entries_.rbegin(); it != entries_.rend(); ++it) {
    if (address < it->parent_base || address >= it->parent_end) continue;
    if (!it->error.empty()) throw Error(it->error);
    return it->local_base + (address - it->parent_base);
  }
  return address;
}

std::optional<CodeAddress> code_address_of(std::uintptr_t address) {
  std::optional<LoadedObject> object = object_at(address);
  if (!object) return std::nullopt;
  return CodeAddress{object->path, object->build_id, address - object->base};
}

std::optional<std::uintptr_t> loaded_address(const CodeAddress& code) {
  std::optional<LoadedObject> here = loaded_object_named(code.path);
  if (!here || here->build_id != code.build_id || code.offset >= here->size) return std::nullopt;
  return here->base + code.offset;
}

}  // namespace forkpool::detail
