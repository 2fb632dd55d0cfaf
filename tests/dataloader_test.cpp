// DataLoader: torch's DataLoader on real forked workers, and streams in blocking range-for.

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <limits>
#include <numeric>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <forkpool/forkpool.hpp>
#include <forkpool/pool/internal/index_batch.hpp>

#include "support.hpp"

namespace forkpool {
namespace {

using namespace std::chrono_literals;

// Sample i is i * 10.
struct Numbers {
  std::size_t n;
  std::size_t size() const { return n; }
  int get(std::size_t index) const { return static_cast<int>(index) * 10; }
};

// Sample i is {i, i + 0.5, i + 1} as a tensor of 3 floats.
struct Vectors {
  std::size_t size() const { return 8; }
  Tensor get(std::size_t index) const {
    float base = static_cast<float>(index);
    std::vector<float> values{base, base + 0.5f, base + 1};
    return Tensor::from<float>(values, {3});
  }
};

// Which process made each sample.
struct Pids {
  std::size_t size() const { return 16; }
  int get(std::size_t) const { return static_cast<int>(getpid()); }
};

// Sample 5 is corrupt.
struct OneBadSample {
  std::size_t size() const { return 12; }
  int get(std::size_t index) const {
    if (index == 5) throw std::out_of_range("corrupt record");
    return static_cast<int>(index);
  }
};

// State built at run time, found by the workers.
struct Words {
  std::vector<std::string> words;
  std::size_t size() const { return words.size(); }
  std::string get(std::size_t index) const { return words[index]; }
};

// An epoch read to its end: the samples of the batches that came, and the messages of those
// that failed with WorkerLost. A Stream has no timeout of its own: a test that drains one runs
// in run_in_child_within.
struct Drained {
  std::vector<int> samples;
  std::vector<std::string> lost;
};
Drained drain(Stream<std::vector<int>>& epoch) {
  Drained drained;
  for (;;) {
    try {
      std::optional<std::vector<int>> batch = run(epoch.next());
      if (!batch) return drained;
      drained.samples.insert(drained.samples.end(), batch->begin(), batch->end());
    } catch (const WorkerLost& e) {
      drained.lost.push_back(e.what());
    }
  }
}

std::vector<int> flatten(DataLoader<Numbers>& loader) {
  std::vector<int> all;
  for (std::vector<int>& batch : loader) all.insert(all.end(), batch.begin(), batch.end());
  return all;
}

TEST(DataLoaderTest, BatchesHoldConsecutiveSamplesAndTheLastOneIsShort) {
  DataLoader loader(Numbers{10}, {.batch_size = 4});
  EXPECT_EQ(loader.size(), 3u);
  std::vector<std::vector<int>> batches;
  for (std::vector<int>& batch : loader) batches.push_back(batch);
  EXPECT_EQ(batches, (std::vector<std::vector<int>>{{0, 10, 20, 30}, {40, 50, 60, 70}, {80, 90}}));
}

TEST(DataLoaderTest, ABatchSizeLargerThanTheDatasetMakesOneShortBatch) {
  // (One near SIZE_MAX wrapped size()'s sum to 0 batches while the epoch made one.)
  for (std::size_t batch_size : {std::size_t{11}, std::numeric_limits<std::size_t>::max()}) {
    DataLoader loader(Numbers{10}, {.batch_size = batch_size});
    EXPECT_EQ(loader.size(), 1u) << batch_size;
    EXPECT_EQ(flatten(loader), (std::vector<int>{0, 10, 20, 30, 40, 50, 60, 70, 80, 90})) << batch_size;
    DataLoader dropping(Numbers{10}, {.batch_size = batch_size, .drop_last = true});
    EXPECT_EQ(dropping.size(), 0u) << batch_size;
    EXPECT_EQ(flatten(dropping), std::vector<int>{}) << batch_size;
  }
}

// (Each read a null state: the dataset's size through null, and an epoch that ran workers over
// it, which died of SIGSEGV.)
TEST(DataLoaderTest, AMovedFromLoaderIsALogicErrorNamingItAndTheKeptOneLoadsOn) {
  DataLoader moved(Numbers{6}, {.batch_size = 4, .num_workers = 1});
  DataLoader kept = std::move(moved);
  test_support::expect_moved_from_error("DataLoader", [&] { moved.size(); });
  test_support::expect_moved_from_error("DataLoader", [&] { moved.epoch(); });
  test_support::expect_moved_from_error("DataLoader", [&] { flatten(moved); });
  EXPECT_EQ(flatten(kept), (std::vector<int>{0, 10, 20, 30, 40, 50}));
}

TEST(DataLoaderTest, DropLastDropsTheShortBatch) {
  DataLoader loader(Numbers{10}, {.batch_size = 4, .drop_last = true});
  EXPECT_EQ(loader.size(), 2u);
  EXPECT_EQ(flatten(loader), (std::vector<int>{0, 10, 20, 30, 40, 50, 60, 70}));
}

TEST(DataLoaderTest, ShuffleDrawsANewOrderEachEpochThatTheSeedReproduces) {
  DataLoader first(Numbers{40}, {.batch_size = 8, .shuffle = true, .seed = 7});
  DataLoader second(Numbers{40}, {.batch_size = 8, .shuffle = true, .seed = 7});
  std::vector<int> epoch1 = flatten(first), epoch2 = flatten(first);
  EXPECT_EQ(flatten(second), epoch1);
  EXPECT_NE(epoch1, epoch2);
  std::vector<int> sorted = epoch1;
  std::sort(sorted.begin(), sorted.end());
  std::vector<int> expected(40);
  for (int i = 0; i < 40; ++i) expected[i] = i * 10;
  EXPECT_EQ(sorted, expected);
  EXPECT_NE(epoch1, expected);
}

TEST(DataLoaderTest, TensorSamplesStackIntoOneSharedBatchTensor) {
  DataLoader loader(Vectors{}, {.batch_size = 4});
  int seen = 0;
  for (Tensor& batch : loader) {
    ASSERT_EQ(std::vector<std::int64_t>(batch.shape().begin(), batch.shape().end()), (std::vector<std::int64_t>{4, 3}));
    EXPECT_TRUE(batch.is_shared());
    for (int row = 0; row < 4; ++row) {
      float base = static_cast<float>(seen * 4 + row);
      EXPECT_EQ(batch.data<float>()[row * 3 + 1], base + 0.5f);
    }
    ++seen;
  }
  EXPECT_EQ(seen, 2);
}

// As Vectors, but sample 5 has 4 floats.
struct OneLongSample {
  std::size_t size() const { return 8; }
  Tensor get(std::size_t index) const {
    std::vector<float> values(index == 5 ? 4 : 3, static_cast<float>(index));
    return Tensor::from<float>(values, {static_cast<std::int64_t>(values.size())});
  }
};

TEST(DataLoaderTest, TheDefaultCollateRefusesASampleOfAnotherShapeNamingItsPlaceInTheBatch) {
  for (int workers : {0, 2}) {
    DataLoader loader(OneLongSample{}, {.batch_size = 4, .num_workers = workers});
    Stream<Tensor> epoch = loader.epoch();
    std::optional<Tensor> first = run(epoch.next());
    ASSERT_TRUE(first);
    EXPECT_EQ(first->data<float>()[3 * 3], 3.0f) << workers;
    try {
      run(epoch.next());
      ADD_FAILURE() << "the batch with sample 5 arrived";
    } catch (const std::exception& e) {  // a worker's arrives as RemoteError, the caller's as thrown
      EXPECT_NE(std::string(e.what()).find("sample 1 of the batch differs from the first"), std::string::npos)
          << e.what();
      if (workers > 0) {
        EXPECT_EQ(dynamic_cast<const RemoteError&>(e).type_name(), "std::invalid_argument");
      }
    }
    EXPECT_FALSE(run(epoch.next()));
  }
}

TEST(DataLoaderTest, ASampleThatThrowsFailsItsBatchNamingItAndTheEpochGoesOn) {
  for (int workers : {0, 2}) {
    DataLoader loader(OneBadSample{}, {.batch_size = 4, .num_workers = workers});
    Stream<std::vector<int>> epoch = loader.epoch();
    auto batch = run(epoch.next());
    ASSERT_TRUE(batch);
    try {
      run(epoch.next());
      ADD_FAILURE() << "the batch with sample 5 arrived";
    } catch (const RemoteError& e) {
      EXPECT_EQ(e.type_name(), "std::out_of_range") << workers;
      EXPECT_EQ(e.message(), "sample 5: corrupt record") << workers;
    }
    auto last = run(epoch.next());
    ASSERT_TRUE(last);
    EXPECT_EQ(*last, (std::vector<int>{8, 9, 10, 11}));
    EXPECT_FALSE(run(epoch.next()));
  }
}

TEST(DataLoaderTest, NumWorkersZeroMakesBatchesHereAndWorkersElsewhere) {
  DataLoader here(Pids{}, {.batch_size = 4, .num_workers = 0});
  for (std::vector<int>& batch : here)
    for (int pid : batch) EXPECT_EQ(pid, getpid());
  DataLoader there(Pids{}, {.batch_size = 4, .num_workers = 2});
  std::set<int> pids;
  for (std::vector<int>& batch : there) pids.insert(batch.begin(), batch.end());
  EXPECT_FALSE(pids.contains(getpid()));
  EXPECT_GE(pids.size(), 1u);
}

std::set<int> pids_of_an_epoch(DataLoader<Pids>& loader) {
  std::set<int> pids;
  for (std::vector<int>& batch : loader) pids.insert(batch.begin(), batch.end());
  return pids;
}

TEST(DataLoaderTest, PersistentWorkersServeEveryEpochAndOthersAreNewEachEpoch) {
  DataLoader persistent(Pids{}, {.batch_size = 2, .num_workers = 2, .persistent_workers = true});
  std::set<int> first = pids_of_an_epoch(persistent);
  std::set<int> second = pids_of_an_epoch(persistent);
  EXPECT_TRUE(std::includes(first.begin(), first.end(), second.begin(), second.end()) ||
              std::includes(second.begin(), second.end(), first.begin(), first.end()));
  DataLoader fresh(Pids{}, {.batch_size = 2, .num_workers = 2});
  std::set<int> before = pids_of_an_epoch(fresh);
  std::set<int> after = pids_of_an_epoch(fresh);
  for (int pid : after) EXPECT_FALSE(before.contains(pid));
}

TEST(DataLoaderTest, TheDistributedSamplerGivesEachRankItsShareOfOnePermutation) {
  std::multiset<int> all;
  for (int rank = 0; rank < 3; ++rank) {
    DataLoader loader(Numbers{10}, {.batch_size = 2, .shuffle = true, .rank = rank, .world_size = 3});
    EXPECT_EQ(loader.size(), 2u);  // 4 samples each: 10 padded to 12
    for (int x : flatten(loader)) all.insert(x);
  }
  EXPECT_EQ(all.size(), 12u);
  for (int i = 0; i < 10; ++i) EXPECT_GE(all.count(i * 10), 1u) << i;  // every sample, two repeated
}

TEST(DataLoaderTest, EachRankTakesEveryWorldSizethSampleOfTheOrderPaddedByItsStartAsTorchsSamplerDoes) {
  auto share = [](std::size_t size, int rank, int world) {
    DataLoader loader(Numbers{size}, {.batch_size = 1, .num_workers = 0, .rank = rank, .world_size = world});
    return flatten(loader);
  };
  // 5 samples on 3 ranks: 0 1 2 3 4 0.
  EXPECT_EQ(share(5, 0, 3), (std::vector<int>{0, 30}));
  EXPECT_EQ(share(5, 1, 3), (std::vector<int>{10, 40}));
  EXPECT_EQ(share(5, 2, 3), (std::vector<int>{20, 0}));
  // A world larger than the dataset: 0 1 2 0 1 2 0 1, one each.
  for (int rank = 0; rank < 8; ++rank) EXPECT_EQ(share(3, rank, 8), std::vector<int>{rank % 3 * 10}) << rank;
  // And much larger, in a child whose address space could not hold the padded order (2^26
  // indices, 512 MiB): only this rank's share is made.
  int status = test_support::run_in_child_within(60s, [&] {
    test_support::limit_address_space(std::size_t{256} << 20);
    if (share(3, (1 << 26) - 1, 1 << 26) != std::vector<int>{((1 << 26) - 1) % 3 * 10}) _exit(2);
  });
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
}

int worker_init_mark = -1;
struct InitMarks {
  std::size_t size() const { return 8; }
  int get(std::size_t) const { return worker_init_mark; }
};

TEST(DataLoaderTest, WorkerInitRunsInEachWorkerWithItsIdBeforeItsFirstBatch) {
  DataLoader loader(InitMarks{},
                    {.batch_size = 1, .num_workers = 2, .worker_init = [](int id) { worker_init_mark = 100 + id; }});
  std::set<int> marks;
  for (std::vector<int>& batch : loader) marks.insert(batch[0]);
  EXPECT_TRUE(
      std::includes(std::set<int>{100, 101}.begin(), std::set<int>{100, 101}.end(), marks.begin(), marks.end()));
  EXPECT_EQ(worker_init_mark, -1);  // not in this process
}

TEST(DataLoaderTest, WorkersFindADatasetBuiltAtRunTime) {
  Words words;
  for (int i = 0; i < 5; ++i) words.words.push_back("w" + std::to_string(i));
  DataLoader loader(words, {.batch_size = 5});
  for (std::vector<std::string>& batch : loader) EXPECT_EQ(batch, words.words);
}

std::string joined(std::vector<std::string> samples) {
  std::string all;
  for (auto& s : samples) all += s;
  return all;
}

TEST(DataLoaderTest, ACollateRunsInTheWorkerOnEachBatch) {
  DataLoader loader(Words{{"a", "b", "c", "d", "e"}}, {.batch_size = 2}, &joined);
  std::vector<std::string> batches;
  for (std::string& batch : loader) batches.push_back(batch);
  EXPECT_EQ(batches, (std::vector<std::string>{"ab", "cd", "e"}));
}

TEST(DataLoaderTest, AnEpochInACoroutineAndOutOfOrderBatchesAllArrive) {
  DataLoader loader(Numbers{30}, {.batch_size = 3, .num_workers = 2, .in_order = false});
  auto body = [&]() -> Task<std::vector<int>> {
    Stream<std::vector<int>> epoch = loader.epoch();
    std::vector<int> all;
    while (auto batch = co_await epoch.next()) all.insert(all.end(), batch->begin(), batch->end());
    co_return all;
  };
  std::vector<int> all = run(body());
  std::sort(all.begin(), all.end());
  ASSERT_EQ(all.size(), 30u);
  for (int i = 0; i < 30; ++i) EXPECT_EQ(all[i], i * 10);
}

struct Slow {
  std::size_t size() const { return 4; }
  int get(std::size_t index) const {
    if (index == 2) std::this_thread::sleep_for(20s);
    return static_cast<int>(index);
  }
};

TEST(DataLoaderTest, ABatchPastTheTimeoutFailsWithTimeoutError) {
  DataLoader loader(Slow{}, {.batch_size = 1, .num_workers = 2, .timeout = 300ms});
  Stream<std::vector<int>> epoch = loader.epoch();
  EXPECT_EQ(*run(epoch.next()), std::vector<int>{0});
  EXPECT_EQ(*run(epoch.next()), std::vector<int>{1});
  auto started = std::chrono::steady_clock::now();
  try {
    run(epoch.next());
    ADD_FAILURE() << "batch 2 arrived";
  } catch (const TimeoutError& e) {
    EXPECT_NE(std::string(e.what()).find("batch 2 of the epoch"), std::string::npos) << e.what();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - started, test_support::scaled(10s));
  EXPECT_EQ(*run(epoch.next()), std::vector<int>{3});
}

// Sample 5 kills the worker that reads it.
struct Deadly {
  std::size_t size() const { return 8; }
  int get(std::size_t index) const {
    if (index == 5) raise(SIGKILL);
    return static_cast<int>(index);
  }
};

TEST(DataLoaderTest, ABatchWhoseWorkerDiedFailsWithWorkerLostNamingItAndTheEpochGoesOn) {
  // (The message said "the task": which batch was lost, the consumer could not tell.)
  int status = test_support::run_in_child_within(30s, [] {
    DataLoader loader(Deadly{}, {.batch_size = 2, .num_workers = 2});
    Stream<std::vector<int>> epoch = loader.epoch();
    Drained drained = drain(epoch);
    ASSERT_EQ(drained.lost.size(), 1u);
    EXPECT_NE(drained.lost[0].find("died while running batch 2 of the epoch (killed by SIGKILL)"), std::string::npos)
        << drained.lost[0];
    EXPECT_EQ(drained.samples, (std::vector<int>{0, 1, 2, 3, 6, 7}));
  });
  test_support::expect_ended_well(status, "hung: the epoch did not go on past the lost batch");
}

TEST(DataLoaderTest, TheProgressOptionDrawsALineWithTheLabel) {
  DataLoader loader(Numbers{8}, {.batch_size = 2, .progress = "loading"});
  testing::internal::CaptureStderr();
  EXPECT_EQ(flatten(loader).size(), 8u);
  std::string drawn = testing::internal::GetCapturedStderr();
  EXPECT_NE(drawn.find("loading"), std::string::npos) << drawn;
  EXPECT_NE(drawn.find("4/4"), std::string::npos) << drawn;
}

TEST(DataLoaderTest, OptionsOutOfRangeAreRefusedNamingTheField) {
  auto refused = [](DataLoaderOptions options) -> std::string {
    try {
      DataLoader loader(Numbers{4}, std::move(options));
    } catch (const std::invalid_argument& e) {
      return e.what();
    }
    return "accepted";
  };
  EXPECT_NE(refused({.batch_size = 0}).find("batch_size"), std::string::npos);
  EXPECT_NE(refused({.num_workers = -1}).find("num_workers"), std::string::npos);
  EXPECT_NE(refused({.prefetch_factor = 0}).find("prefetch_factor"), std::string::npos);
  EXPECT_NE(refused({.rank = 2, .world_size = 2}).find("rank"), std::string::npos);
}

// An iterable dataset: 0..n-1, each worker reading every num_workers-th number from its id on
// (torch's IterableDataset recipe with get_worker_info()); the whole range outside workers.
// Reading `fails_at` throws; reading `kills_at` kills the worker; worker `slow_worker` takes
// 20 ms a number.
struct Counting {
  int n;
  int fails_at = -1;
  int kills_at = -1;
  int slow_worker = -1;
  struct Iterator {
    using value_type = int;
    using difference_type = std::ptrdiff_t;
    const Counting* dataset = nullptr;
    int at = 0, step = 1;
    int operator*() const {
      if (at == dataset->fails_at) throw std::runtime_error("unreadable record " + std::to_string(at));
      if (at == dataset->kills_at) ::raise(SIGKILL);
      if (step > 1 && at % step == dataset->slow_worker) std::this_thread::sleep_for(20ms);
      return at;
    }
    Iterator& operator++() {
      at += step;
      return *this;
    }
    void operator++(int) { ++*this; }
    bool operator==(std::default_sentinel_t) const { return at >= dataset->n; }
  };
  Iterator begin() const {
    std::optional<WorkerInfo> info = worker_info();
    return info ? Iterator{this, info->id, info->num_workers} : Iterator{this, 0, 1};
  }
  std::default_sentinel_t end() const { return {}; }
};

template <class Loader>
std::vector<std::vector<int>> all_batches(Loader& loader) {
  std::vector<std::vector<int>> batches;
  for (std::vector<int>& batch : loader) batches.push_back(batch);
  return batches;
}

TEST(IterableDatasetTest, EachWorkerReadsItsOwnShardAndTheirBatchesComeInTurn) {
  DataLoader loader(Counting{10}, {.batch_size = 2, .num_workers = 2});
  // Worker 0 reads 0 2 4 6 8, worker 1 reads 1 3 5 7 9; as torch's, worker 0's first batch,
  // then worker 1's first, and so on.
  EXPECT_EQ(all_batches(loader), (std::vector<std::vector<int>>{{0, 2}, {1, 3}, {4, 6}, {5, 7}, {8}, {9}}));
}

TEST(IterableDatasetTest, ASlowWorkersBatchesStillComeFromItsOwnShardInTurn) {
  // Worker 1 is idle while worker 0 reads; still only worker 0 may read worker 0's shard.
  DataLoader loader(Counting{12, -1, -1, /*slow_worker=*/0}, {.batch_size = 2, .num_workers = 2});
  EXPECT_EQ(all_batches(loader), (std::vector<std::vector<int>>{{0, 2}, {1, 3}, {4, 6}, {5, 7}, {8, 10}, {9, 11}}));
}

TEST(IterableDatasetTest, AShardThatEndsFirstDropsOutAndDropLastDropsEachShardsShortBatch) {
  DataLoader uneven(Counting{7}, {.batch_size = 2, .num_workers = 2});
  EXPECT_EQ(all_batches(uneven), (std::vector<std::vector<int>>{{0, 2}, {1, 3}, {4, 6}, {5}}));
  DataLoader dropping(Counting{7}, {.batch_size = 2, .drop_last = true, .num_workers = 2});
  EXPECT_EQ(all_batches(dropping), (std::vector<std::vector<int>>{{0, 2}, {1, 3}, {4, 6}}));
}

TEST(IterableDatasetTest, PersistentWorkersReadTheirShardsAfreshEachEpoch) {
  DataLoader loader(Counting{9}, {.batch_size = 3, .num_workers = 3, .persistent_workers = true});
  auto first = all_batches(loader);
  EXPECT_EQ(first, (std::vector<std::vector<int>>{{0, 3, 6}, {1, 4, 7}, {2, 5, 8}}));
  EXPECT_EQ(all_batches(loader), first);
}

TEST(IterableDatasetTest, NumWorkersZeroReadsTheWholeDatasetHere) {
  DataLoader loader(Counting{5}, {.batch_size = 2, .num_workers = 0});
  EXPECT_EQ(all_batches(loader), (std::vector<std::vector<int>>{{0, 1}, {2, 3}, {4}}));
  EXPECT_EQ(all_batches(loader), (std::vector<std::vector<int>>{{0, 1}, {2, 3}, {4}}));
}

TEST(IterableDatasetTest, OutOfOrderBatchesAllArrive) {
  DataLoader loader(Counting{40}, {.batch_size = 3, .num_workers = 2, .in_order = false});
  std::vector<int> all;
  for (std::vector<int>& batch : loader) all.insert(all.end(), batch.begin(), batch.end());
  std::sort(all.begin(), all.end());
  std::vector<int> expected(40);
  std::iota(expected.begin(), expected.end(), 0);
  EXPECT_EQ(all, expected);
}

TEST(IterableDatasetTest, AReadThatThrowsFailsItsBatchNamingWorkerAndBatchAndEndsThatShardOnly) {
  for (int workers : {0, 2}) {
    // Worker 1 reads 1 3 5 7 9: 7 is in its batch 1. Alone, 7 is in batch 3.
    DataLoader loader(Counting{10, /*fails_at=*/7}, {.batch_size = 2, .num_workers = workers});
    Stream<std::vector<int>> epoch = loader.epoch();
    std::vector<int> got;
    std::vector<std::string> errors;
    for (;;) {
      try {
        std::optional<std::vector<int>> batch = run(epoch.next());
        if (!batch) break;
        got.insert(got.end(), batch->begin(), batch->end());
      } catch (const RemoteError& e) {
        errors.push_back(e.what());
      }
    }
    ASSERT_EQ(errors.size(), 1u) << workers << " workers";
    EXPECT_NE(errors[0].find(workers ? "worker 1, batch 1 of its shard" : "batch 3 of its shard"), std::string::npos)
        << errors[0];
    EXPECT_NE(errors[0].find("unreadable record 7"), std::string::npos) << errors[0];
    EXPECT_NE(errors[0].find("runtime_error"), std::string::npos) << errors[0];
    std::sort(got.begin(), got.end());
    // The shard ends at the error (where its iterator stands is unknown); the others finish.
    std::vector<int> expected = workers ? std::vector<int>{0, 1, 2, 3, 4, 6, 8} : std::vector<int>{0, 1, 2, 3, 4, 5};
    EXPECT_EQ(got, expected) << workers << " workers";
  }
}

TEST(IterableDatasetTest, AWorkerKilledMidShardFailsOneBatchAndTheOtherShardsFinish) {
  // Worker 1 reads 1 3 5 7 9 ...: it dies reading 9, in its batch 2.
  int status = test_support::run_in_child_within(30s, [] {
    DataLoader loader(Counting{20, -1, /*kills_at=*/9}, {.batch_size = 2, .num_workers = 2});
    Stream<std::vector<int>> epoch = loader.epoch();
    Drained drained = drain(epoch);
    ASSERT_EQ(drained.lost.size(), 1u);
    // (It said "the task".)
    EXPECT_NE(drained.lost[0].find("died while running batch 2 of shard 1 (killed by SIGKILL)"), std::string::npos)
        << drained.lost[0];
    std::sort(drained.samples.begin(), drained.samples.end());
    EXPECT_EQ(drained.samples, (std::vector<int>{0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 18}));
  });
  test_support::expect_ended_well(status, "hung: the other shards did not finish");
}

// A loader's epoch from another thread: persistent workers belong to the thread that made them,
// so the epoch is refused, naming the rule (an iterable dataset's was sent from the wrong
// thread); without them the epoch makes its own workers there, and the old ones' pool ends on
// its own thread (~Pool on another thread did hang).
template <class Dataset>
std::string epoch_on_another_thread(DataLoader<Dataset>& loader, std::vector<int>& got) {
  return test_support::logic_error_on_another_thread([&] {
    for (std::vector<int>& batch : loader) got.insert(got.end(), batch.begin(), batch.end());
  });
}

TEST(DataLoaderTest, AnEpochOnAnotherThreadIsRefusedWithPersistentWorkersAndRunsWithout) {
  int status = test_support::run_in_child_within(30s, [] {
    for (bool iterable : {false, true}) {
      for (bool persistent : {true, false}) {
        DataLoaderOptions options{.batch_size = 2, .num_workers = 2, .persistent_workers = persistent};
        std::vector<int> here, there;
        std::string refusal;
        if (iterable) {
          DataLoader loader(Counting{6}, options);
          for (std::vector<int>& batch : loader) here.insert(here.end(), batch.begin(), batch.end());
          refusal = epoch_on_another_thread(loader, there);
        } else {
          DataLoader loader(Numbers{6}, options);
          here = flatten(loader);
          refusal = epoch_on_another_thread(loader, there);
        }
        std::string what = std::string(iterable ? "iterable" : "map-style") + (persistent ? ", persistent" : "");
        if (persistent) {
          EXPECT_NE(refusal.find("belongs to the thread that made it"), std::string::npos) << what << ": " << refusal;
          EXPECT_TRUE(there.empty()) << what;
        } else {
          EXPECT_EQ(refusal, "") << what;
          std::sort(here.begin(), here.end());
          std::sort(there.begin(), there.end());
          EXPECT_EQ(there, here) << what;
        }
      }
    }
    run(sleep_for(1ms));  // this thread's loop turns: the pools handed back to it end
  });
  test_support::expect_ended_well(status, "hung: a loader's epoch on another thread");
}

TEST(IterableDatasetTest, OptionsThatNeedASamplerAreRefused) {
  auto refused = [](DataLoaderOptions options) {
    try {
      DataLoader loader(Counting{4}, options);
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  EXPECT_NE(refused({.shuffle = true}).find("shuffle"), std::string::npos);
  EXPECT_NE(refused({.world_size = 2}).find("world_size"), std::string::npos);
}

// How many samples the workers have started making, counted across processes.
struct Started {
  std::atomic<int> count;
};
// Sample 0 is slow: the others finish first and wait for their turn.
struct SlowFirst {
  std::size_t size() const { return 40; }
  int get(std::size_t index) const {
    test_support::shared_across_forks<Started>().count.fetch_add(1);
    if (index == 0) std::this_thread::sleep_for(300ms);
    return static_cast<int>(index);
  }
};

TEST(DataLoaderTest, PrefetchFactorBoundsTheBatchesMadeAheadOfTheConsumer) {
  test_support::shared_across_forks<Started>().count.store(0);
  DataLoader loader(SlowFirst{}, {.batch_size = 1, .num_workers = 2, .prefetch_factor = 3});
  Stream<std::vector<int>> epoch = loader.epoch();
  int handed_out = 0, most_ahead = 0;
  for (int i = 0; i < 12; ++i) {
    ASSERT_EQ(*run(epoch.next()), std::vector<int>{i});
    ++handed_out;
    most_ahead = std::max(most_ahead, test_support::shared_across_forks<Started>().count.load() - handed_out);
  }
  EXPECT_LE(most_ahead, 6);  // 2 workers × 3
  EXPECT_GE(most_ahead, 1);
}

// Counts the samples started, and makes them at once.
struct CountedNumbers {
  std::size_t size() const { return 100; }
  int get(std::size_t index) const {
    test_support::shared_across_forks<Started>().count.fetch_add(1);
    return static_cast<int>(index);
  }
};

// As torch's: taking a batch frees its place at once, so the workers keep the whole window
// (num_workers × prefetch_factor) going while the consumer works on the batch it holds.
TEST(DataLoaderTest, TakingABatchLetsTheWorkersStartTheNextOneBeforeTheConsumerAsksAgain) {
  test_support::shared_across_forks<Started>().count.store(0);
  DataLoader loader(CountedNumbers{}, {.batch_size = 1, .num_workers = 2, .prefetch_factor = 3});
  Stream<std::vector<int>> epoch = loader.epoch();
  ASSERT_EQ(*run(epoch.next()), std::vector<int>{0});
  auto started = [] { return test_support::shared_across_forks<Started>().count.load(); };
  // The loop runs meanwhile (the pool sends what its workers' windows let through as they answer).
  for (int waited = 0; waited < 30 && started() < 7; ++waited) run(sleep_for(100ms));
  run(sleep_for(100ms));
  EXPECT_EQ(started(), 7) << "1 taken + 2 workers × 3 ahead";
}

TEST(DataLoaderTest, AConsumerThatBreaksOutEarlyLeavesNoWorkerBehind) {
  {
    DataLoader loader(Numbers{1000}, {.batch_size = 2, .num_workers = 2});
    int seen = 0;
    for (std::vector<int>& batch : loader) {
      (void)batch;
      if (++seen == 3) break;
    }
    EXPECT_EQ(seen, 3);
  }
  EXPECT_TRUE(test_support::eventually([] { return test_support::children_named("forkpool-worker-0").empty(); }));
  EXPECT_TRUE(test_support::eventually([] { return test_support::children_named("forkpool-worker-1").empty(); }));
}

int square(int x) { return x * x; }

TEST(StreamTest, PlainCodeIteratesAStreamWithRangeFor) {
  Pool pool({.processes = 2});
  std::vector<int> got;
  for (int x : pool.imap(square, std::vector<int>{1, 2, 3, 4})) got.push_back(x);
  EXPECT_EQ(got, (std::vector<int>{1, 4, 9, 16}));
}

TEST(StreamTest, RangeForInsideACoroutineOnTheSameLoopIsRefused) {
  Pool pool({.processes = 1});
  auto body = [&]() -> Task<void> {
    for (int x : pool.imap(square, std::vector<int>{1})) (void)x;
    co_return;
  };
  EXPECT_THROW(run(body()), std::logic_error);
}

// A sequential sampler's batch crosses as two numbers whatever its size; a shuffled one as its
// list; either arrives as it left. What a hostile sender makes of them is a ProtocolError.
std::vector<std::uint64_t> indices_of(const detail::IndexBatch& batch) {
  std::vector<std::uint64_t> out(batch.size());
  for (std::size_t i = 0; i < out.size(); ++i) out[i] = batch[i];
  return out;
}

TEST(IndexBatchTest, ConsecutiveIndicesCrossAsARunAndAnyOtherOrderAsItsList) {
  std::vector<std::uint64_t> consecutive(64), shuffled{5, 9, 6, 2};
  std::iota(consecutive.begin(), consecutive.end(), std::uint64_t{4096});
  detail::IndexBatch run = detail::IndexBatch::of(consecutive), list = detail::IndexBatch::of(shuffled);
  EXPECT_TRUE(run.is_run());
  EXPECT_FALSE(list.is_run());
  EXPECT_EQ(indices_of(run), consecutive);
  EXPECT_EQ(indices_of(list), shuffled);
  EXPECT_EQ(encode(run).bytes().size(), 17u) << "a run is its first index and its count";
  EXPECT_EQ(indices_of(decode<detail::IndexBatch>(encode(run).bytes())), consecutive);
  EXPECT_EQ(indices_of(decode<detail::IndexBatch>(encode(list).bytes())), shuffled);
  EXPECT_TRUE(detail::IndexBatch::of(std::vector<std::uint64_t>{7}).is_run());

  auto malformed = [](auto... fields) {
    Writer w;
    (w.write(fields), ...);
    return decode<detail::IndexBatch>(w.bytes());
  };
  EXPECT_THROW(malformed(std::uint8_t{2}, std::uint64_t{0}, std::uint64_t{1}), ProtocolError) << "unknown kind";
  EXPECT_THROW(malformed(std::uint8_t{1}, ~std::uint64_t{0}, std::uint64_t{2}), ProtocolError) << "past the largest";
  EXPECT_THROW(malformed(std::uint8_t{0}, std::vector<std::uint64_t>{3}), ProtocolError) << "a list of one";
}

}  // namespace
}  // namespace forkpool
