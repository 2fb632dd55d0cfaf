// Loads a forkpool-using module with dlopen() (argv[1]) into a program that is not linked with
// forkpool, as Python loads an extension, and runs its check. Before that, each forkpool library
// the module brought in must not ask for static TLS (DF_STATIC_TLS: initial-exec thread-locals),
// which a dlopen()ed library gets only from glibc's small surplus, and may not get at all.
// Exits 0 when all holds.
#include <dlfcn.h>
#include <elf.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <set>
#include <string>

namespace {

// Whether the ELF file at `path` asks for static TLS; -1 when it cannot be read.
int asks_for_static_tls(const std::string& path) {
  int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return -1;
  struct stat st {};
  fstat(fd, &st);
  void* map = mmap(nullptr, static_cast<std::size_t>(st.st_size), PROT_READ, MAP_PRIVATE, fd, 0);
  close(fd);
  if (map == MAP_FAILED) return -1;
  const auto* bytes = static_cast<const unsigned char*>(map);
  const auto* header = reinterpret_cast<const Elf64_Ehdr*>(bytes);
  int answer = 0;
  for (int i = 0; i < header->e_phnum; ++i) {
    const auto* segment = reinterpret_cast<const Elf64_Phdr*>(bytes + header->e_phoff + i * header->e_phentsize);
    if (segment->p_type != PT_DYNAMIC) continue;
    for (const auto* d = reinterpret_cast<const Elf64_Dyn*>(bytes + segment->p_offset); d->d_tag != DT_NULL; ++d)
      if (d->d_tag == DT_FLAGS && (d->d_un.d_val & DF_STATIC_TLS)) answer = 1;
  }
  munmap(map, static_cast<std::size_t>(st.st_size));
  return answer;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) return 2;
  void* module = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (!module) {
    std::fprintf(stderr, "dlopen: %s\n", dlerror());
    return 1;
  }
  std::set<std::string> libraries;
  std::ifstream maps("/proc/self/maps");
  for (std::string line; std::getline(maps, line);) {
    auto slash = line.find('/');
    if (slash != std::string::npos && line.find("/libforkpool", slash) != std::string::npos)
      libraries.insert(line.substr(slash));
  }
  if (libraries.empty()) {
    std::fprintf(stderr, "the module brought in no forkpool library\n");
    return 1;
  }
  int failures = 0;
  for (const std::string& library : libraries) {
    int tls = asks_for_static_tls(library);
    std::printf("%s: %s\n", library.c_str(), tls == 0 ? "dynamic TLS" : tls == 1 ? "STATIC_TLS" : "unreadable");
    if (tls != 0) ++failures;
  }
  auto check = reinterpret_cast<int (*)()>(dlsym(module, "forkpool_dlopen_check"));
  int result = check ? check() : -1;
  std::printf("forkpool_dlopen_check: %d\n", result);
  return failures == 0 && result == 0 ? 0 : 1;
}
