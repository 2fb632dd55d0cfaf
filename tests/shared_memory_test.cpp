// Shared memory that is recycled (shm/internal/slab.hpp, shm/private/peer_memory.hpp): tensors
// are blocks of slabs mapped once; a slab crosses to a peer once; blocks are lent and come home,
// and are reused only when no process holds them.

#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <forkpool/ipc/internal/channel.hpp>
#include <forkpool/ipc/private/memfd.hpp>
#include <forkpool/shm/private/peer_memory.hpp>
#include <forkpool/pool/pool.hpp>
#include <forkpool/runtime/private/memory_limit.hpp>
#include <forkpool/shm/private/slab_allocator.hpp>
#include <forkpool/shm/shared_memory.hpp>
#include <forkpool/shm/sharing.hpp>
#include <forkpool/shm/tensor.hpp>
#include <forkpool/shm/tensor_codec.hpp>
#include "support.hpp"

namespace forkpool {
namespace {

using detail::BlockEntry;
using detail::OutgoingBlocks;
using detail::PeerMemory;
using test_support::eventually;
using test_support::open_fd_count;
using test_support::rss_kib;

using namespace std::chrono_literals;

// How many mappings of slabs process `pid` has.
int slab_mappings_of(pid_t pid) {
  std::ifstream maps("/proc/" + std::to_string(pid) + "/maps");
  int count = 0;
  for (std::string line; std::getline(maps, line);)
    if (line.find("memfd:forkpool-slab") != std::string::npos) ++count;
  return count;
}
// How many shared-memory mappings (memfds, /dev/shm) process `pid` has: what crossing a tensor
// could map. (Other lines move on their own: a sanitizer's allocator maps as it likes.)
int all_mappings_of(pid_t pid) {
  std::ifstream maps("/proc/" + std::to_string(pid) + "/maps");
  int count = 0;
  for (std::string line; std::getline(maps, line);)
    if (line.find("memfd:") != std::string::npos || line.find("/dev/shm/") != std::string::npos) ++count;
  return count;
}

// Restores the cache limit when a test ends.
struct CacheLimit {
  explicit CacheLimit(std::size_t bytes) { set_shared_memory_cache_limit(bytes); }
  ~CacheLimit() { set_shared_memory_cache_limit(detail::SlabAllocator::kDefaultCacheLimit); }
};

// Lowers this process's descriptor limit for one test.
struct DescriptorLimit {
  rlimit saved{};
  explicit DescriptorLimit(rlim_t limit) {
    getrlimit(RLIMIT_NOFILE, &saved);
    rlimit lowered{limit, saved.rlim_max};
    EXPECT_EQ(setrlimit(RLIMIT_NOFILE, &lowered), 0);
  }
  ~DescriptorLimit() { setrlimit(RLIMIT_NOFILE, &saved); }
};

std::uintptr_t address_in_worker(Tensor t) { return reinterpret_cast<std::uintptr_t>(t.raw_data()); }
Tensor same_tensor(Tensor t) { return t; }
Tensor second_half(Tensor t) { return t.slice(0, t.shape()[0] / 2, t.shape()[0]); }
int nothing(int x) { return x; }
std::int32_t first_int(Tensor t) { return t.data<std::int32_t>()[0]; }
Tensor touch_first(Tensor t) {
  t.data<float>()[0] += 1;
  return t;
}
// A worker's new batch: n floats, each `value`.
Tensor batch(std::int64_t n, float value) {
  Tensor t = Tensor::empty({n}, DType::f32);
  std::fill_n(t.data<float>(), n, value);
  return t;
}
int mappings_here(int) { return all_mappings_of(getpid()); }

// Tensors a worker keeps past its task (as a Hogwild worker keeps its parameters).
std::vector<Tensor>& kept_in_worker() {
  static std::vector<Tensor> kept;
  return kept;
}
int keep(Tensor t) {
  kept_in_worker().push_back(std::move(t));
  return static_cast<int>(kept_in_worker().size());
}
int drop_kept(int) {
  kept_in_worker().clear();
  return 0;
}
Tensor give_back_kept(int) {
  Tensor t = kept_in_worker().at(0);
  kept_in_worker().clear();
  return t;
}

TEST(SlabAllocator, AFreedBlockIsTheNextOneHandedOut) {
  std::optional<Tensor> t = Tensor::empty({1000}, DType::f32);
  void* first = t->raw_data();
  t.reset();
  Tensor again = Tensor::empty({1000}, DType::f32);
  EXPECT_EQ(again.raw_data(), first);
  EXPECT_NE(Tensor::empty({1000}, DType::f32).raw_data(), first);  // while `again` holds it
}

TEST(SlabAllocator, ZerosClearsRecycledMemory) {
  std::optional<Tensor> t = Tensor::empty({64}, DType::f32);
  std::fill_n(t->data<float>(), 64, 5.0f);
  t.reset();
  Tensor zeros = Tensor::zeros({64}, DType::f32);
  for (int i = 0; i < 64; ++i) ASSERT_EQ(zeros.data<float>()[i], 0.0f);
}

TEST(SlabAllocator, SmallTensorsShareSlabsAndDescriptors) {
  std::size_t before = shared_memory_stats().descriptors;
  std::vector<Tensor> kept;
  for (int i = 0; i < 10'000; ++i) kept.push_back(Tensor::empty({16}, DType::f32));
  EXPECT_LE(shared_memory_stats().descriptors - before, 1u);  // 10,000 × 64 B fit in one 2 MiB slab
  EXPECT_GE(shared_memory_stats().in_use_bytes, 10'000u * 64);
}

TEST(SlabAllocator, CachedMemoryFallsToTheLimitAfterABurst) {
  CacheLimit limit(64 << 20);
  {
    std::vector<Tensor> burst;
    for (int i = 0; i < 64; ++i) burst.push_back(Tensor::empty({(16 << 20) / 4}, DType::f32));  // 1 GiB
    EXPECT_GE(shared_memory_stats().in_use_bytes, std::size_t{1} << 30);
  }
  SharedMemoryStats stats = shared_memory_stats();
  EXPECT_LE(stats.cached_bytes, std::size_t{64} << 20);
  EXPECT_LT(stats.mapped_bytes, std::size_t{256} << 20) << "free slabs went back to the kernel";
}

TEST(SlabAllocator, AnAllocationBeyondTheAddressSpaceLimitIsAnException) {
  int status = test_support::run_in_child([] {
    test_support::limit_address_space(std::size_t{32} << 20);
    for (std::int64_t mib : {60, 2048}) {  // a slab of the largest class, and one larger
      try {
        Tensor::empty({mib << 18}, DType::f32);
        throw std::runtime_error("an allocation of " + std::to_string(mib) + " MiB succeeded");
      } catch (const std::bad_alloc&) {
      } catch (const std::system_error&) {}
    }
    Tensor small = Tensor::empty({16}, DType::f32);  // and the process goes on
    small.data<float>()[0] = 1;
  });
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
}

// More bytes than RAM and swap together. The child volunteers to the OOM killer first: with the
// check gone, tmpfs would take pages until the OOM killer ended a process, and then it is the
// child (whose memfd goes with it) rather than the suite or anything else on the machine.
std::int64_t more_than_the_machine_has() {
  return static_cast<std::int64_t>(test_support::machine_memory_bytes()) + (1 << 20);
}
std::string how_the_child_ended(SharingStrategy strategy, int status) {
  return (strategy == SharingStrategy::file_system ? "file_system: " : "file_descriptor: ") +
         (WIFEXITED(status) ? "exit " + std::to_string(WEXITSTATUS(status))
                            : "killed by signal " + std::to_string(WTERMSIG(status)));
}

TEST(SharedMemory, ATensorLargerThanTheMachinesMemoryIsRefusedBeforeAnyIsTaken) {
  for (SharingStrategy strategy : get_all_sharing_strategies()) {
    int status = test_support::run_in_child_within(60s, [&] {
      test_support::volunteer_to_the_oom_killer();
      set_sharing_strategy(strategy);
      Tensor warm = Tensor::zeros({16}, DType::f32);  // a slab, the tracker: what a program has
      SharedMemoryStats before = shared_memory_stats();
      int descriptors = open_fd_count();
      try {
        Tensor::empty({more_than_the_machine_has()}, DType::u8);
        _exit(2);
      } catch (const std::system_error& e) {
        if (e.code() != std::errc::not_enough_memory) _exit(3);
        if (std::string(e.what()).find("more than this process may have") == std::string::npos) _exit(4);
      }
      if (shared_memory_stats().mapped_bytes != before.mapped_bytes || open_fd_count() != descriptors) _exit(5);
      Tensor::zeros({1 << 20}, DType::f32).data<float>()[0] = 1;  // and the process goes on
    });
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << how_the_child_ended(strategy, status);
  }
}

// A memory cgroup limited to `bytes` of memory below this process's, made for one test and removed
// with it; empty where cgroups cannot be written here (not root, no memory controller).
class MemoryCgroup {
 public:
  explicit MemoryCgroup(std::uint64_t bytes) {
    for (const detail::MemoryCgroupDir& group : detail::memory_cgroups_of_this_process()) {
      std::string dir = group.dir + "/forkpool-test-" + std::to_string(getpid());
      if (mkdir(dir.c_str(), 0755) != 0) continue;
      dir_ = dir;
      // Memory only, swap left unlimited, as `docker run --memory` on a machine without swap: the
      // limit is then the memory's (with swap, more could be had).
      bool limited = write(dir + (group.v1 ? "/memory.limit_in_bytes" : "/memory.max"), bytes);
      if (limited) return;
      rmdir(dir_.c_str());
      dir_.clear();
    }
  }
  ~MemoryCgroup() {
    // (A process the child started, the file_system strategy's name tracker, may leave after it.)
    if (!dir_.empty()) eventually([&] { return rmdir(dir_.c_str()) == 0; }, 10s);
  }
  bool made() const { return !dir_.empty(); }
  // Moves the calling process in.
  bool enter() const { return write(dir_ + "/cgroup.procs", static_cast<std::uint64_t>(getpid())); }

 private:
  static bool write(const std::string& path, std::uint64_t value) {
    std::ofstream file(path);
    file << value << std::flush;
    return static_cast<bool>(file);
  }
  std::string dir_;
};

TEST(SharedMemory, ATensorLargerThanItsCgroupAllowsIsRefusedBeforeAnyIsTaken) {
  MemoryCgroup group(std::uint64_t{256} << 20);
  if (!group.made()) GTEST_SKIP() << "no memory cgroup can be made here";
  if (test_support::machine_has_swap()) GTEST_SKIP() << "with swap, the group could have more than its memory";
  for (SharingStrategy strategy : get_all_sharing_strategies()) {
    int status = test_support::run_in_child_within(60s, [&] {
      test_support::volunteer_to_the_oom_killer();
      if (!group.enter()) _exit(6);
      set_sharing_strategy(strategy);
      try {
        Tensor::empty({std::int64_t{512} << 20}, DType::u8);  // with the check gone: the group's OOM killer
        _exit(2);
      } catch (const std::system_error& e) {
        if (e.code() != std::errc::not_enough_memory) _exit(3);
        if (std::string(e.what()).find("cgroup") == std::string::npos) _exit(4);
      }
      Tensor::zeros({std::int64_t{64} << 20}, DType::u8).data<std::uint8_t>()[0] = 1;  // within it: made
    });
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << how_the_child_ended(strategy, status);
  }
}

TEST(SharedMemory, ATensorSentAgainIsTheSameMemoryInTheWorkerAndMapsNothingNew) {
  Pool pool({.processes = 1});
  Tensor t = Tensor::zeros({1024}, DType::f32);
  std::uintptr_t first = pool.apply_async(address_in_worker, t).get();
  int mappings = all_mappings_of(pool.worker_pids().at(0));
  for (int i = 0; i < 20; ++i) EXPECT_EQ(pool.apply_async(address_in_worker, t).get(), first);
  EXPECT_EQ(all_mappings_of(pool.worker_pids().at(0)), mappings);
  EXPECT_EQ(slab_mappings_of(pool.worker_pids().at(0)), 1);
}

TEST(SharedMemory, AReturnedTensorIsTheParentsOwnStorage) {
  Pool pool({.processes = 1});
  Tensor t = Tensor::zeros({1024}, DType::f32);
  Tensor back = pool.apply_async(same_tensor, t).get();
  EXPECT_EQ(back.storage(), t.storage());
  Tensor half = pool.apply_async(second_half, t).get();
  EXPECT_EQ(half.storage(), t.storage());
  EXPECT_EQ(half.storage_offset(), 512 * 4);
  EXPECT_EQ(half.shape()[0], 512);
}

TEST(SharedMemory, ManyTensorsInOneChunkCrossInOneSlab) {
  Pool pool({.processes = 1});
  std::vector<Tensor> tensors;
  for (int i = 0; i < 20; ++i) tensors.push_back(Tensor::zeros({16}, DType::f32));
  tensors.push_back(tensors[3]);  // the same storage twice in one message
  std::vector<Tensor> back = pool.map_async(same_tensor, tensors, 7).get();
  ASSERT_EQ(back.size(), tensors.size());
  for (std::size_t i = 0; i < back.size(); ++i) EXPECT_EQ(back[i].storage(), tensors[i].storage());
  EXPECT_EQ(slab_mappings_of(pool.worker_pids().at(0)), 1);
}

// A worker returns a tensor of the parent's that it kept from an earlier task and lets go of it
// in the same task, after the parent dropped its own: the result still arrives over that memory.
TEST(SharedMemory, ATensorAWorkerKeptAndReturnsArrivesThoughTheResultAlsoReleasesIt) {
  Pool pool({.processes = 1});
  std::optional<Tensor> t = Tensor::zeros({256}, DType::i32);
  t->data<std::int32_t>()[0] = 41;
  void* address = t->raw_data();
  ASSERT_EQ(pool.apply_async(keep, *t).get(), 1);
  t.reset();  // only the worker holds it now
  Tensor back = pool.apply_async(give_back_kept, 0).get();
  EXPECT_EQ(back.raw_data(), address);
  EXPECT_EQ(back.data<std::int32_t>()[0], 41);
  EXPECT_EQ(pool.apply_async(nothing, 5).get(), 5) << "the pool serves on";
}

// A pipeline: a batch one pool's worker made, passed to another pool's worker that keeps it;
// the parent lets go of it, and that worker later returns it and lets go in the same task.
TEST(SharedMemory, ABatchPassedOnToAnotherPoolAndReturnedFromThereArrivesIntact) {
  Pool makers({.processes = 1}), keepers({.processes = 1});
  std::optional<Tensor> made = makers.apply_async(batch, 512, 2.5f).get();
  void* address = made->raw_data();
  ASSERT_EQ(keepers.apply_async(keep, *made).get(), 1);
  made.reset();  // only the keeper holds it now (the maker's block is still lent to us)
  Tensor back = keepers.apply_async(give_back_kept, 0).get();
  EXPECT_EQ(back.raw_data(), address);
  EXPECT_EQ(back.data<float>()[0], 2.5f);
  EXPECT_EQ(back.data<float>()[511], 2.5f);
  EXPECT_EQ(keepers.apply_async(nothing, 5).get(), 5) << "the pool serves on";
}

// The DataLoader pattern: each task builds a new batch; the parent consumes and drops it.
TEST(SharedMemory, ARecycledBatchIsTheSameBlockAndNeitherSideMapsAnythingNew) {
  Pool pool({.processes = 1});
  pid_t worker = pool.worker_pids().at(0);
  std::optional<Tensor> first = pool.apply_async(batch, 1 << 16, 0.0f).get();
  const void* address = first->raw_data();
  const detail::Slab* slab = first->storage()->slab();
  ASSERT_NE(slab, nullptr);
  first.reset();
  int worker_mappings = 0, parent_mappings = 0;
  for (int i = 1; i <= 1000; ++i) {
    Tensor next = pool.apply_async(batch, 1 << 16, static_cast<float>(i)).get();
    ASSERT_EQ(next.data<float>()[12345], static_cast<float>(i));
    EXPECT_EQ(next.raw_data(), address) << "batch " << i << " is not the recycled block";
    EXPECT_EQ(next.storage()->slab(), slab);
    if (i == 10) {
      worker_mappings = pool.apply_async(mappings_here, 0).get();
      parent_mappings = all_mappings_of(getpid());
    }
  }
  EXPECT_EQ(pool.apply_async(mappings_here, 0).get(), worker_mappings);
  EXPECT_EQ(all_mappings_of(getpid()), parent_mappings);
  EXPECT_EQ(slab_mappings_of(worker), 1);
}

TEST(SharedMemory, TwentyThousandTensorsMadeByWorkersAreKeptWithFewDescriptors) {
  Pool pool({.processes = 2});
  DescriptorLimit limit(256);
  std::vector<std::int64_t> sizes(20'000, 64);
  std::vector<Tensor> kept = pool.map_async([](std::int64_t n) { return batch(n, 3.0f); }, sizes, 100).get();
  ASSERT_EQ(kept.size(), 20'000u);
  for (const Tensor& t : kept) ASSERT_EQ(t.data<float>()[63], 3.0f);
  EXPECT_LT(open_fd_count(), 64);
}

// Issue 58.7: 5,000 kept batches of 48 KiB held 120 descriptors (a 2 MiB slab each 42). A size
// class's slabs grow, so 1 GiB of them, made by workers or by the parent, needs fewer than 64.
int mappings_held_in_worker(int) { return slab_mappings_of(getpid()); }
TEST(SharedMemory, AGibibyteOfKept48KiBTensorsNeedsFewerThan64DescriptorsEitherWay) {
  constexpr std::int64_t kFloats = 48 * 1024 / 4;
  constexpr std::size_t kTensors = (std::size_t{1} << 30) / (48 * 1024);
  Pool pool({.processes = 1});
  std::vector<Tensor> made =
      pool.map_async([](std::int64_t n) { return batch(n, 2.0f); }, std::vector<std::int64_t>(kTensors, kFloats), 512)
          .get(60s);
  ASSERT_EQ(made.size(), kTensors);
  EXPECT_EQ(made.back().data<float>()[kFloats - 1], 2.0f);
  EXPECT_LT(shared_memory_stats().descriptors, 64u) << "worker-made, kept here";
  made.clear();
  std::vector<Tensor> kept;
  for (std::size_t i = 0; i < kTensors; ++i) kept.push_back(Tensor::empty({kFloats}, DType::i32));
  EXPECT_LT(shared_memory_stats().descriptors, 64u) << "made here";
  EXPECT_EQ(pool.map_async(first_int, std::vector<Tensor>(kept.begin(), kept.begin() + 4096), 512).get(60s).size(),
            4096u);
  EXPECT_LT(pool.apply_async(mappings_held_in_worker, 0).get(20s), 64) << "the worker maps them in few slabs too";
}

TEST(SharedMemory, TwentyThousandTensorsMadeByTheParentEachSentToAWorkerNeedFewDescriptors) {
  Pool pool({.processes = 2, .initializer = [] {
               rlimit limit{256, 256};
               if (setrlimit(RLIMIT_NOFILE, &limit) != 0) std::abort();
             }});
  DescriptorLimit limit(256);
  std::vector<Tensor> tensors;
  for (int i = 0; i < 20'000; ++i) {
    tensors.push_back(Tensor::empty({64}, DType::i32));
    tensors.back().data<std::int32_t>()[0] = i;
  }
  std::vector<std::int32_t> firsts = pool.map_async(first_int, tensors, 100).get();
  for (int i = 0; i < 20'000; ++i) ASSERT_EQ(firsts[i], i);
  EXPECT_LT(open_fd_count(), 64);
  EXPECT_EQ(pool.worker_pids().size(), 2u);
}

TEST(SharedMemory, ABlockLentToTwoWorkersIsNotReusedUntilBothLetGo) {
  Pool pool({.processes = 2});
  std::optional<Tensor> t = Tensor::empty({256}, DType::f32);
  void* address = t->raw_data();
  // Each worker keeps it; apply_async to both (a map of 2 with chunksize 1 reaches both busy workers).
  auto slow_keep = [](Tensor x) {
    std::this_thread::sleep_for(100ms);
    return keep(std::move(x));
  };
  EXPECT_EQ(pool.map_async(slow_keep, std::vector<Tensor>{*t, *t}, 1).get(), (std::vector<int>{1, 1}));
  t.reset();
  std::vector<Tensor> fresh;
  for (int i = 0; i < 100; ++i) {
    fresh.push_back(Tensor::empty({256}, DType::f32));
    ASSERT_NE(fresh.back().raw_data(), address) << "reused while the workers hold it";
  }
  fresh.clear();
  pool.map_async(
          [](int) {
            std::this_thread::sleep_for(100ms);
            return drop_kept(0);
          },
          std::vector<int>{0, 0}, 1)
      .get();
  EXPECT_TRUE(eventually([&] {
    pool.apply_async(nothing, 0).get();  // lets the releases in
    return Tensor::empty({256}, DType::f32).raw_data() == address;
  })) << "never came home";
}

// A task that takes a parent's tensor by reference leaves it to the worker, which lets go of it
// after the call: that release rides in the task's result, so the block is home as soon as the
// result is, with no loop turn and no later task to carry it.
std::int32_t first_int_seen(const Tensor& t) { return t.data<std::int32_t>()[0]; }
TEST(SharedMemory, ATensorAWorkerHeldForItsCallIsHomeWhenTheCallsResultIs) {
  Pool pool({.processes = 1});
  std::optional<Tensor> t = Tensor::zeros({256}, DType::i32);
  void* address = t->raw_data();
  for (int i = 0; i < 20; ++i) {
    ASSERT_EQ(pool.apply_async(first_int_seen, *t).get(10s), 0);
    t.reset();  // the last hold: the block is free now, or it is still lent
    EXPECT_EQ(Tensor::empty({256}, DType::i32).raw_data(), address) << "round " << i << ": still lent";
    t = Tensor::zeros({256}, DType::i32);
    ASSERT_EQ(t->raw_data(), address);
  }
}

// The worker returns the same tensor twice: the parent holds its block for two messages, and
// releases it with that count once it drops both.
Tensor& worker_batch() {
  static Tensor kept;
  if (!kept.storage()) kept = batch(256, 1.0f);
  return kept;
}
Tensor same_worker_batch(int) { return worker_batch(); }
std::uintptr_t new_batch_address(int) {
  worker_batch() = Tensor();
  return reinterpret_cast<std::uintptr_t>(batch(256, 2.0f).raw_data());
}
TEST(SharedMemory, ABlockReturnedTwiceComesHomeOnceBothAreDropped) {
  Pool pool({.processes = 1});
  std::optional<Tensor> first = pool.apply_async(same_worker_batch, 0).get();
  std::optional<Tensor> second = pool.apply_async(same_worker_batch, 0).get();
  ASSERT_EQ(first->storage(), second->storage());
  auto address = address_in_worker(*first);  // the same in both processes? no: read it there
  (void)address;
  std::uintptr_t in_worker = pool.apply_async([](int) { return address_in_worker(worker_batch()); }, 0).get();
  first.reset();
  EXPECT_NE(pool.apply_async(new_batch_address, 0).get(), in_worker) << "reused while the parent holds it";
  second.reset();
  EXPECT_TRUE(eventually([&] { return pool.apply_async(new_batch_address, 0).get() == in_worker; }))
      << "the parent's release did not bring it home";
}

std::size_t in_use_in_worker(int) { return shared_memory_stats().in_use_bytes; }
Tensor a_batch_of(int index) { return batch(1024, static_cast<float>(index)); }

// Blocks a worker made, dropped by the parent on four threads while its loop serves the pool:
// every release reaches the worker (the threads suite runs this under TSan; before it, the
// suite's filter matched no test of this program).
TEST(SharedMemoryThreads, BatchesFromAWorkerDroppedOnFourThreadsWhileThePoolWorksAllGoHome) {
  Pool pool({.processes = 1});
  std::vector<int> indices(64);
  for (int i = 0; i < 64; ++i) indices[i] = i;
  std::vector<Tensor> batches = pool.map_async(a_batch_of, indices).get();
  ASSERT_GE(pool.apply_async(in_use_in_worker, 0).get(), 64u * 1024 * sizeof(float));
  std::vector<std::thread> droppers;
  for (int first = 0; first < 4; ++first)
    droppers.emplace_back([&batches, first] {
      for (std::size_t i = first; i < batches.size(); i += 4) {
        EXPECT_EQ(batches[i].data<float>()[1023], static_cast<float>(i));
        batches[i] = Tensor();
      }
    });
  for (int i = 0; i < 50; ++i) EXPECT_EQ(pool.apply_async(nothing, i).get(), i);  // meanwhile
  for (std::thread& dropper : droppers) dropper.join();
  EXPECT_TRUE(eventually([&] { return pool.apply_async(in_use_in_worker, 0).get() == 0; }))
      << "blocks dropped on other threads never went home";
}

// Releases sent from other threads travel on the worker's socket. A worker that never waits (a
// steady stream of tasks) reads them within moments, not at its next sleep (issue 58.10): its
// blocks come home and it makes no new slabs meanwhile.
TEST(SharedMemoryThreads, ReleasesFromAnotherThreadReachAWorkerThatNeverWaits) {
  // A long spin: between two tasks the worker polls its ring and finds the next, never sleeping.
  PoolOptions options{.processes = 1};
  options.spin = std::chrono::milliseconds(50);
  Pool pool(options);
  std::vector<int> indices(64);
  for (int i = 0; i < 64; ++i) indices[i] = i;
  // Rounds: a worker may still doze once in a while and read a socket message then.
  for (int round = 0; round < 10; ++round) {
    std::vector<Tensor> batches = pool.map_async(a_batch_of, indices).get();
    std::thread dropper([&batches] {
      for (Tensor& batch : batches) batch = Tensor();  // one release each, on the socket
    });
    dropper.join();
    std::vector<AsyncResult<int>> busy;
    for (int i = 0; i < 2'000; ++i) busy.push_back(pool.apply_async(nothing, i));
    AsyncResult<std::size_t> in_use = pool.apply_async(in_use_in_worker, 0);  // behind them
    for (int i = 0; i < 2'000; ++i) ASSERT_EQ(busy[i].get(), i);
    ASSERT_EQ(in_use.get(), 0u) << "round " << round << ": releases waited on the socket of a worker that never slept";
  }
}

TEST(SharedMemory, AWorkerKilledWhileHoldingBlocksGivesThemBack) {
  Pool pool({.processes = 1});
  std::optional<Tensor> t = Tensor::empty({256}, DType::f32);
  void* address = t->raw_data();
  pool.apply_async(keep, *t).get();
  t.reset();
  EXPECT_NE(Tensor::empty({256}, DType::f32).raw_data(), address);
  kill(pool.worker_pids().at(0), SIGKILL);
  EXPECT_TRUE(eventually([&] {
    pool.apply_async(nothing, 0).wait();  // lets the loop notice the death
    return Tensor::empty({256}, DType::f32).raw_data() == address;
  })) << "the dead worker's hold was never released";
}

TEST(SharedMemory, AKilledWorkersBatchesStayValidAndGoWhenTheParentLetsGo) {
  Pool pool({.processes = 1});
  std::vector<Tensor> batches;
  for (int i = 0; i < 8; ++i) batches.push_back(pool.apply_async(batch, 1 << 18, static_cast<float>(i)).get());
  std::size_t mapped = shared_memory_stats().mapped_bytes;
  pid_t dead = pool.worker_pids().at(0);
  kill(dead, SIGKILL);
  ASSERT_TRUE(eventually([&] {
    pool.apply_async(nothing, 0).wait();  // lets the loop notice the death
    return pool.worker_pids().at(0) != dead;
  }));
  EXPECT_EQ(shared_memory_stats().mapped_bytes, mapped);
  for (int i = 0; i < 8; ++i) EXPECT_EQ(batches[i].data<float>()[1000], static_cast<float>(i));
  batches.clear();
  EXPECT_LE(shared_memory_stats().mapped_bytes, mapped - (std::size_t{8} << 20))
      << "the dead worker's slabs stay mapped";
}

long shmem_kib() {
  std::ifstream meminfo("/proc/meminfo");
  for (std::string key; meminfo >> key;) {
    long value = 0;
    meminfo >> value;
    if (key == "Shmem:") return value;
    meminfo.ignore(64, '\n');
  }
  return -1;
}

TEST(SharedMemory, MemoryComesBackWhenTheParentIsKilled) {
  long before = shmem_kib();
  pid_t parent = fork();
  if (parent == 0) {
    try {
      Pool pool({.processes = 2});
      std::vector<Tensor> batches;
      for (int i = 0; i < 16; ++i) batches.push_back(pool.apply_async(batch, 1 << 22, 1.0f).get());  // 256 MiB
      for (int i = 0; i < 16; ++i) batches.push_back(Tensor::zeros({1 << 22}, DType::i32));
      pool.map_async(first_int, std::vector<Tensor>(batches.begin() + 16, batches.end())).get();
      kill(getpid(), SIGKILL);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "%s\n", e.what());
    }
    _exit(3);
  }
  int status = 0;
  waitpid(parent, &status, 0);
  ASSERT_TRUE(WIFSIGNALED(status));
  EXPECT_TRUE(eventually([&] { return shmem_kib() - before < 64 * 1024; }, 10s))
      << "Shmem grew by " << (shmem_kib() - before) << " KiB";
}

TEST(SharedMemory, ASlabTheParentFreesIsUnmappedInTheWorker) {
  CacheLimit limit(0);
  Pool pool({.processes = 1});
  pid_t worker = pool.worker_pids().at(0);
  std::optional<Tensor> t = Tensor::zeros({1 << 20}, DType::f32);
  pool.apply_async(address_in_worker, *t).get();
  EXPECT_EQ(slab_mappings_of(worker), 1);
  std::thread([&] { t.reset(); }).join();  // on another thread, while the pool's loop is not running
  EXPECT_TRUE(eventually([&] { return slab_mappings_of(worker) == 0; })) << "the worker still maps it";
  EXPECT_EQ(shared_memory_stats().slabs, 0u);
}

// The kernel queues few datagrams per socket (net.unix.max_dgram_qlen): releases sent while the
// worker is busy fill it, and later jobs must still arrive in order and complete.
int sleep_ms(int ms) {
  std::this_thread::sleep_for(std::chrono::milliseconds(ms));
  return ms;
}
TEST(SharedMemory, ReleasesThatFillABusyWorkersSocketLoseNothing) {
  CacheLimit limit(0);
  Pool pool({.processes = 1});
  pid_t worker = pool.worker_pids().at(0);
  std::vector<Tensor> dropped;
  for (int i = 0; i < 40; ++i) dropped.push_back(Tensor::zeros({1 << 20}, DType::f32));  // a slab each
  pool.map_async(address_in_worker, dropped).get();
  auto busy = pool.apply_async(sleep_ms, 200);
  dropped.clear();  // 40 slabs gone while the worker sleeps
  Tensor kept = Tensor::zeros({16}, DType::f32);
  std::vector<AsyncResult<Tensor>> results;
  for (int i = 0; i < 8; ++i) results.push_back(pool.apply_async(touch_first, kept));
  EXPECT_EQ(busy.get(), 200);
  for (auto& result : results) EXPECT_EQ(result.get().storage(), kept.storage());
  EXPECT_EQ(kept.data<float>()[0], 8.0f);
  EXPECT_TRUE(eventually([&] { return slab_mappings_of(worker) == 1; })) << slab_mappings_of(worker);
}

// A worker keeps a mapping per slab it was given: the parent's forgets keep that bounded by what
// the parent holds, not by what it ever sent.
TEST(SharedMemory, AWorkerSentThousandsOfTensorsOverItsLifeNeverRunsOutOfDescriptors) {
  CacheLimit limit(0);
  Pool pool({.processes = 1, .initializer = [] {
               rlimit limit{64, 64};
               if (setrlimit(RLIMIT_NOFILE, &limit) != 0) std::abort();
             }});
  for (int i = 0; i < 400; ++i) {                     // six times the worker's 64 descriptors
    Tensor t = Tensor::zeros({1 << 20}, DType::i32);  // a slab of its own each, freed each time
    t.data<std::int32_t>()[0] = i;
    ASSERT_EQ(pool.apply_async(first_int, t).get(), i);
  }
  EXPECT_EQ(pool.worker_pids().size(), 1u);
}

TEST(SharedMemory, AReplacementWorkerIsIntroducedToTheSlabAfresh) {
  Pool pool({.processes = 1});
  Tensor t = Tensor::zeros({1024}, DType::f32);
  pool.apply_async(address_in_worker, t).get();
  pid_t first = pool.worker_pids().at(0);
  kill(first, SIGKILL);
  ASSERT_TRUE(eventually([&] {
    auto pids = pool.worker_pids();
    if (!pids.empty() && pids[0] != first) return true;
    pool.apply_async(nothing, 0).wait();  // lets the loop notice the death
    return false;
  }));
  Tensor back = pool.apply_async(same_tensor, t).get();
  EXPECT_EQ(back.storage(), t.storage());
}

// file_system storages are not slabs: a worker killed while holding a segment could not give
// back its count of holders, and the name would outlive every user until the parent exits.
TEST(SharedMemory, ASegmentSentToAPoolThatIsTerminatedKeepsNoName) {
  set_sharing_strategy(SharingStrategy::file_system);
  std::optional<Tensor> t = Tensor::zeros({1024}, DType::f32);
  set_sharing_strategy(SharingStrategy::file_descriptor);
  std::string segment = t->storage()->name();
  {
    Pool pool({.processes = 1});
    EXPECT_EQ(pool.apply_async(same_tensor, *t).get().storage(), t->storage());
  }  // ~Pool terminates: the worker is killed
  t.reset();
  EXPECT_TRUE(eventually([&] { return !std::filesystem::exists("/dev/shm/" + segment); }))
      << segment << " kept its name";
}

// The protocol on its own: two PeerMemory objects in one process stand for the two sides.

// Sends `t` from `from` to `to` as a message would, returning what `to` decodes.
Tensor cross(PeerMemory& from, PeerMemory& to, const Tensor& t) {
  OutgoingBlocks blocks;
  Writer w(&blocks);
  w.write(t);
  blocks.write_table(w);
  if (auto introduction = from.lend(blocks)) {
    std::vector<UniqueFd> fds;
    for (int fd : introduction->fds) fds.emplace_back(dup(fd));
    to.accept_introduction(introduction->payload.bytes(), fds);
  }
  detail::TabledPayload payload = detail::split_block_table(w.bytes());
  detail::IncomingBlocks incoming = to.accept_blocks(payload.table);
  Reader r(payload.body, {}, &incoming);
  return r.read<Tensor>();
}

TEST(PeerMemory, ASlabIsIntroducedOnceAndABlockIsReleasedWithItsCount) {
  auto a = std::make_shared<PeerMemory>(), b = std::make_shared<PeerMemory>();
  Tensor t = Tensor::empty({4}, DType::f32);
  OutgoingBlocks blocks;
  blocks.block_index(t.storage());
  blocks.block_index(t.storage());
  EXPECT_EQ(blocks.storages().size(), 1u);
  auto first = a->lend(blocks);
  ASSERT_TRUE(first);
  EXPECT_EQ(first->fds, std::vector<int>{t.storage()->fd()});
  EXPECT_FALSE(a->lend(blocks)) << "introduced twice";
  // Two messages lent it: the peer's release must count both.
  Writer release =
      encode(std::pair(std::vector<std::uint64_t>{t.storage()->slab()->id(), t.storage()->slab_offset(), 1},
                       std::vector<std::uint64_t>{}));
  a->accept_release(release.bytes());
  a->accept_release(release.bytes());
  EXPECT_THROW(a->accept_release(release.bytes()), ProtocolError) << "released more often than lent";
}

// A release read where it lies is checked as a decoded one was: a count of numbers that is not
// (slab, offset, count) triples, a truncated list or trailing bytes are a ProtocolError, and
// the lent block stays lent.
TEST(PeerMemory, AMalformedReleaseIsAProtocolErrorAndReleasesNothing) {
  auto a = std::make_shared<PeerMemory>();
  Tensor t = Tensor::empty({4}, DType::f32);
  OutgoingBlocks blocks;
  blocks.block_index(t.storage());
  ASSERT_TRUE(a->lend(blocks));
  std::uint64_t slab = t.storage()->slab()->id(), offset = t.storage()->slab_offset();
  using Numbers = std::vector<std::uint64_t>;
  Writer pairs = encode(std::pair(Numbers{slab, offset}, Numbers{}));
  EXPECT_THROW(a->accept_release(pairs.bytes()), ProtocolError) << "not triples";
  Writer good = encode(std::pair(Numbers{slab, offset, 1}, Numbers{}));
  std::vector<std::byte> trailing(good.bytes().begin(), good.bytes().end());
  trailing.push_back(std::byte{0});
  EXPECT_THROW(a->accept_release(trailing), ProtocolError) << "trailing bytes";
  EXPECT_THROW(a->accept_release(good.bytes().first(good.bytes().size() - 1)), ProtocolError) << "truncated";
  a->accept_release(good.bytes());  // the block was still lent once
  EXPECT_THROW(a->accept_release(good.bytes()), ProtocolError) << "released more often than lent";
}

// The books reuse the entry of a block that came home for the next one lent: each block is still
// counted under its own name, however they alternate.
TEST(PeerMemory, BlocksLentAfterOthersCameHomeAreCountedUnderTheirOwnNames) {
  auto a = std::make_shared<PeerMemory>();
  Tensor x = Tensor::empty({4}, DType::f32), y = Tensor::empty({4}, DType::f32);
  auto lend = [&](const Tensor& t) {
    OutgoingBlocks blocks;
    blocks.block_index(t.storage());
    a->lend(blocks);
  };
  auto release = [&](const Tensor& t) {
    using Numbers = std::vector<std::uint64_t>;
    Writer w = encode(std::pair(Numbers{t.storage()->slab()->id(), t.storage()->slab_offset(), 1}, Numbers{}));
    a->accept_release(w.bytes());
  };
  for (int round = 0; round < 3; ++round) {
    lend(x);
    release(x);  // x's entry is now the spare
    lend(y);     // made from it
    lend(x);
    release(y);
    EXPECT_THROW(release(y), ProtocolError) << "round " << round << ": y was lent once";
    release(x);
    EXPECT_THROW(release(x), ProtocolError) << "round " << round << ": x came home already";
  }
}

// A message names each storage once in its table however often its tensors repeat it, both
// while it scans its few blocks and after it indexes many.
TEST(PeerMemory, AMessagesTableNamesEachStorageOnceBeforeAndAfterItIndexesThem) {
  std::vector<Tensor> tensors;
  for (int i = 0; i < 40; ++i) tensors.push_back(Tensor::empty({4}, DType::f32));
  OutgoingBlocks blocks;
  for (int pass = 0; pass < 2; ++pass)
    for (std::uint32_t i = 0; i < tensors.size(); ++i) {
      EXPECT_EQ(blocks.block_index(tensors[i].storage()), i) << "pass " << pass;
      EXPECT_EQ(blocks.block_index(tensors[i / 2].storage()), i / 2) << "pass " << pass;
    }
  ASSERT_EQ(blocks.storages().size(), tensors.size());
  for (std::size_t i = 0; i < tensors.size(); ++i) EXPECT_EQ(blocks.storages()[i], tensors[i].storage());
}

// A result carries its task's release at its end, written in place: split off again it is the
// release message's own payload, and the message before it is untouched; so is an empty one.
TEST(PeerMemory, AReleaseRidingAtAMessagesEndSplitsOffAsItsOwnMessage) {
  detail::BlockRelease releases[] = {{{7, 4096, 2, 9, 0, 1}, {3}}, {}};
  for (const detail::BlockRelease& release : releases) {
    Writer w;
    w.write(std::string("the result"));
    Writer body = encode(std::string("the result"));
    detail::append_release(w, release);
    auto [riding, rest] = detail::split_release(w.bytes());
    EXPECT_TRUE(std::ranges::equal(riding, release.encode().bytes()));
    EXPECT_TRUE(std::ranges::equal(rest, body.bytes()));
    auto [blocks, slabs] = decode<std::pair<std::vector<std::uint64_t>, std::vector<std::uint64_t>>>(riding);
    EXPECT_EQ(blocks, release.blocks);
    EXPECT_EQ(slabs, release.slabs);
  }
}
TEST(PeerMemory, AnUndeliveredIntroductionIsMadeAgain) {
  auto a = std::make_shared<PeerMemory>();
  Tensor t = Tensor::empty({4}, DType::f32);
  OutgoingBlocks blocks;
  blocks.block_index(t.storage());
  auto introduction = a->lend(blocks);
  a->unlend(blocks, introduction);
  EXPECT_TRUE(a->lend(blocks));
}

TEST(PeerMemory, HostileTablesAreProtocolErrors) {
  auto a = std::make_shared<PeerMemory>(), b = std::make_shared<PeerMemory>();
  Tensor t = Tensor::empty({4}, DType::f32);
  cross(*a, *b, t);  // b maps a's slab
  std::uint64_t slab = t.storage()->slab()->id(), size = t.storage()->slab()->size();
  std::vector<BlockEntry> unknown{{slab + 1000, 0, 64}};
  EXPECT_THROW(b->accept_blocks(unknown), ProtocolError);
  std::vector<BlockEntry> outside{{slab, size - 32, 64}};
  EXPECT_THROW(b->accept_blocks(outside), ProtocolError);
  std::vector<BlockEntry> overflowing{{slab, ~std::uint64_t{0} - 8, 64}};
  EXPECT_THROW(b->accept_blocks(overflowing), ProtocolError);
  // a's own slab named back as "yours" by a peer it never gave it to.
  Writer yours = encode(std::vector<std::uint64_t>{77, 1, slab + 5});
  EXPECT_THROW(a->accept_introduction(yours.bytes(), {}), ProtocolError);
  // A message that claims more table than it has.
  std::uint32_t huge = 1'000'000;
  std::vector<std::byte> short_message(sizeof huge);
  std::memcpy(short_message.data(), &huge, sizeof huge);
  EXPECT_THROW(detail::split_block_table(short_message), ProtocolError);
}

TEST(PeerMemory, AnUnsealedOrShortSlabIsRefusedAndNothingIsMapped) {
  auto b = std::make_shared<PeerMemory>();
  std::size_t mapped = shared_memory_stats().mapped_bytes;
  int fds_before = open_fd_count();
  {
    std::vector<UniqueFd> fds;
    fds.push_back(create_memfd("forkpool-slab", 4096));  // not sealed
    Writer intro = encode(std::vector<std::uint64_t>{1, 0, 4096});
    EXPECT_THROW(b->accept_introduction(intro.bytes(), fds), ProtocolError);
  }
  {
    std::vector<UniqueFd> fds;
    fds.push_back(create_memfd("forkpool-slab", 4096));
    seal_size(fds[0].get());
    Writer intro = encode(std::vector<std::uint64_t>{2, 0, 1 << 20});  // claims more than it is
    EXPECT_THROW(b->accept_introduction(intro.bytes(), fds), ProtocolError);
  }
  {
    Writer intro = encode(std::vector<std::uint64_t>{3, 0, 4096});  // no descriptor at all
    EXPECT_THROW(b->accept_introduction(intro.bytes(), {}), ProtocolError);
  }
  EXPECT_EQ(shared_memory_stats().mapped_bytes, mapped);
  EXPECT_EQ(open_fd_count(), fds_before);
}

// One 48-byte message must not make us commit the memory a sparse file claims.
TEST(PeerMemory, ASparseSlabIsRefusedBeforeAnyOfItIsPagedIn) {
  auto b = std::make_shared<PeerMemory>();
  long rss_before = rss_kib();
  std::vector<UniqueFd> fds;
  fds.push_back(create_memfd("forkpool-slab", std::size_t{1} << 30));  // 1 GiB, none of it allocated
  seal_size(fds[0].get());
  Writer intro = encode(std::vector<std::uint64_t>{1, 0, std::uint64_t{1} << 30});
  EXPECT_THROW(b->accept_introduction(intro.bytes(), fds), ProtocolError);
  EXPECT_LT(rss_kib() - rss_before, 64 * 1024) << "the sparse slab was paged in";
}

// Each slab a peer has us map costs a descriptor: past a bound the peer breaks the protocol.
TEST(PeerMemory, APeerCannotMakeUsMapSlabsWithoutLimit) {
  auto b = std::make_shared<PeerMemory>();
  int fds_before = open_fd_count();
  bool refused = false;
  for (std::uint64_t id = 1; id <= 5000 && !refused; ++id) {
    std::vector<UniqueFd> fds;
    fds.push_back(create_memfd("forkpool-slab", 4096));
    ASSERT_EQ(posix_fallocate(fds[0].get(), 0, 4096), 0);
    seal_size(fds[0].get());
    Writer intro = encode(std::vector<std::uint64_t>{id, 0, 4096});
    try {
      b->accept_introduction(intro.bytes(), fds);
    } catch (const ProtocolError& e) {
      refused = true;
      EXPECT_NE(std::string(e.what()).find("slabs at once"), std::string::npos) << e.what();
    }
  }
  EXPECT_TRUE(refused) << "5000 slabs mapped for one peer";
  b->peer_gone();
  EXPECT_EQ(open_fd_count(), fds_before);
}

TEST(PeerMemory, ABlockOutsideAnyConversationCarriesItsWholeSlabAndIsNeverHandedOutAgain) {
  std::optional<Tensor> t = Tensor::empty({4}, DType::f32);
  t->data<float>()[1] = 9;
  void* address = t->raw_data();
  Writer w;
  w.write(*t);
  ASSERT_EQ(w.fds().size(), 1u);
  std::vector<UniqueFd> fds;
  fds.emplace_back(dup(w.fds()[0]));
  Reader r(w.bytes(), fds);
  Tensor received = r.read<Tensor>();
  EXPECT_EQ(received.data<float>()[1], 9);
  t.reset();
  for (int i = 0; i < 100; ++i) EXPECT_NE(Tensor::empty({4}, DType::f32).raw_data(), address);
}

}  // namespace
}  // namespace forkpool
