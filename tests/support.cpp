#include "support.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/sysinfo.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <forkpool/pool/process.hpp>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <system_error>
#include <vector>

namespace forkpool::test_support {

int open_fd_count() {
  DIR* dir = opendir("/proc/self/fd");
  int count = 0;
  while (dirent* entry = readdir(dir))
    if (entry->d_name[0] != '.') ++count;
  closedir(dir);
  return count - 1;  // the descriptor opendir itself used
}

namespace {
// A field of /proc/self/status in KiB ("VmRSS:"), -1 when it is not there.
long status_kib(const std::string& field) {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line))
    if (line.rfind(field, 0) == 0) return std::stol(line.substr(field.size()));
  return -1;
}
}  // namespace

long rss_kib() { return status_kib("VmRSS:"); }

void limit_address_space(std::size_t extra_bytes) {
  long mapped_kib = status_kib("VmSize:");
  if (mapped_kib < 0) throw std::runtime_error("forkpool test: no VmSize in /proc/self/status");
  rlim_t bytes = (static_cast<rlim_t>(mapped_kib) << 10) + extra_bytes;
  rlimit limit{bytes, bytes};
  if (setrlimit(RLIMIT_AS, &limit) != 0) throw std::system_error(errno, std::generic_category(), "setrlimit");
}

std::uint64_t machine_memory_bytes() {
  struct sysinfo machine {};
  if (sysinfo(&machine) != 0) throw std::system_error(errno, std::generic_category(), "sysinfo");
  return (std::uint64_t{machine.totalram} + machine.totalswap) * machine.mem_unit;
}

void volunteer_to_the_oom_killer() { std::ofstream("/proc/self/oom_score_adj") << 1000; }

bool machine_has_swap() {
  struct sysinfo machine {};
  if (sysinfo(&machine) != 0) throw std::system_error(errno, std::generic_category(), "sysinfo");
  return machine.totalswap != 0;
}

char process_state(pid_t pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string text;
  if (!std::getline(stat, text)) return '?';
  auto close_paren = text.rfind(')');
  if (close_paren == std::string::npos || close_paren + 2 >= text.size()) return '?';
  return text[close_paren + 2];
}

double time_scale() {
  static const double scale = [] {
    const char* text = std::getenv("FORKPOOL_TEST_TIME_SCALE");
    double value = text != nullptr ? std::strtod(text, nullptr) : 1.0;
    return value >= 1.0 ? value : 1.0;
  }();
  return scale;
}

std::chrono::milliseconds cpu_time_of(pid_t pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  std::getline(stat, line);
  std::istringstream fields(line.substr(line.rfind(')') + 2));  // from field 3 (state) on
  std::string field;
  long utime = 0, stime = 0;
  for (int i = 3; i <= 15 && fields >> field; ++i) {
    if (i == 14) utime = std::stol(field);
    if (i == 15) stime = std::stol(field);
  }
  return std::chrono::milliseconds((utime + stime) * 1000 / sysconf(_SC_CLK_TCK));
}

bool process_alive(pid_t pid) {
  char state = process_state(pid);
  return state != '?' && state != 'Z' && state != 'X';
}

bool is_active_child(pid_t pid) {
  std::vector<pid_t> children = active_children();
  return std::find(children.begin(), children.end(), pid) != children.end();
}

std::vector<pid_t> children_of(pid_t pid) {
  std::vector<pid_t> children;
  std::string tasks = "/proc/" + std::to_string(pid) + "/task";
  std::error_code error;
  for (const auto& task : std::filesystem::directory_iterator(tasks, error)) {
    std::ifstream list(task.path() / "children");
    pid_t child;
    while (list >> child) children.push_back(child);
  }
  return children;
}

std::string process_name(pid_t pid) {
  std::ifstream comm("/proc/" + std::to_string(pid) + "/comm");
  std::string name;
  std::getline(comm, name);
  return name;
}

std::vector<pid_t> children_named(const std::string& name) {
  std::vector<pid_t> named;
  for (pid_t child : children_of(getpid()))
    if (process_name(child) == name) named.push_back(child);
  return named;
}

int run_in_child(const std::function<void()>& body) {
  pid_t pid = fork();
  if (pid == 0) {
    int code = 0;
    try {
      body();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "child failed: %s\n", e.what());
      code = 1;
    }
    // An EXPECT that failed in the child is printed there; its status carries it here.
    if (::testing::Test::HasFailure()) code = 1;
    std::fflush(stdout);
    _exit(code);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  return status;
}

int run_in_child_within(std::chrono::seconds limit, const std::function<void()>& body) {
  return run_in_child([&] {
    alarm(static_cast<unsigned>(limit.count()));
    body();
  });
}

void expect_ended_well(int status, const char* hang) {
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
      << (WIFSIGNALED(status) && WTERMSIG(status) == SIGALRM ? hang : "failed") << " (status " << status << ")";
}

namespace {
constexpr const char* kFreshProcessVariable = "FORKPOOL_TEST_FRESH_PROCESS";
}

bool in_fresh_process() { return std::getenv(kFreshProcessVariable) != nullptr; }

namespace {
constexpr const char* kTestRunVariable = "FORKPOOL_TEST_RUN";
}

void mark_test_run() {
  if (!std::getenv(kTestRunVariable)) setenv(kTestRunVariable, std::to_string(getpid()).c_str(), 1);
}

bool meet_before_init(int parties) {
  std::atomic<int>& arrived = shared_across_forks<SpawnMeeting>().arrived;
  arrived.fetch_add(1);
  return eventually([&] { return arrived.load() >= parties; }, std::chrono::seconds(5));
}

void* shared_file(const char* name, std::size_t size) {
  const char* run = std::getenv(kTestRunVariable);
  std::string path = std::string("/tmp/forkpool-test-") + (run ? run : std::to_string(getpid())) + "-" +
                     std::to_string(std::hash<std::string>{}(name));
  int fd = open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (fd < 0 || ftruncate(fd, static_cast<off_t>(size)) != 0) std::abort();
  void* memory = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (memory == MAP_FAILED) std::abort();
  // The run's first process removes the file when it exits; the mapping lives on meanwhile.
  static std::vector<std::string>* to_remove = new std::vector<std::string>;
  if (!run || std::to_string(getpid()) == run) {
    static pid_t owner = getpid();  // a forked child that calls exit() inherits the handler
    if (to_remove->empty())
      std::atexit([] {
        if (getpid() == owner)
          for (auto& p : *to_remove) unlink(p.c_str());
      });
    to_remove->push_back(path);
  }
  return memory;
}

int rerun_in_fresh_process() {
  const testing::TestInfo* test = testing::UnitTest::GetInstance()->current_test_info();
  std::string filter = std::string("--gtest_filter=") + test->test_suite_name() + "." + test->name();
  pid_t pid = fork();
  if (pid == 0) {
    setenv(kFreshProcessVariable, "1", 1);
    unsetenv(kTestRunVariable);  // a run of its own
    execl("/proc/self/exe", "fresh-process", filter.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  return status;
}

void expect_passes_in_fresh_process() {
  int status = rerun_in_fresh_process();
  ASSERT_TRUE(WIFEXITED(status)) << "the fresh process ended by signal " << WTERMSIG(status);
  EXPECT_EQ(WEXITSTATUS(status), 0);
}

}  // namespace forkpool::test_support
