// Shared tensors on real memfds, /dev/shm segments, sockets and forked workers.

#include <dirent.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <limits>
#include <numeric>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <forkpool/ipc/internal/channel.hpp>
#include <forkpool/ipc/private/memfd.hpp>
#include <forkpool/pool/pool.hpp>
#include <forkpool/shm/dlpack.hpp>
#include <forkpool/shm/sharing.hpp>
#include <forkpool/shm/tensor.hpp>
#include <forkpool/shm/tensor_codec.hpp>
#include "support.hpp"

namespace forkpool {
namespace {

using namespace std::chrono_literals;

// Sends `tensor` through a socketpair and decodes what arrives, as another process would.
Tensor through_channel(const Tensor& tensor) {
  auto [a, b] = detail::Channel::make_pair();
  Writer w = encode(tensor);
  a.send(1, 1, w.bytes(), w.fds());
  detail::Message m = b.receive();
  Reader r = m.reader();
  Tensor out = r.read<Tensor>();
  r.expect_end();
  return out;
}

Tensor same_tensor(Tensor t) { return t; }
Tensor with_dims(int dims) {
  return Tensor::zeros(std::vector<std::int64_t>(static_cast<std::size_t>(dims), 1), DType::f32);
}

// A receiver reads at most 64 dimensions (what a message may claim is bounded before anything is
// mapped): a tensor with more is refused where it is sent, never taken for a malformed message
// where it arrives (a worker's result that the parent refused as malformed would cost the worker).
TEST(TensorTest, ATensorOfMoreDimensionsThanAReceiverReadsIsRefusedWhereItIsSent) {
  Pool pool({.processes = 1});
  pid_t worker = pool.worker_pids().at(0);
  EXPECT_EQ(pool.apply_async(same_tensor, with_dims(64)).get(10s).dim(), 64);
  try {
    pool.apply_async(same_tensor, with_dims(65)).get(10s);
    ADD_FAILURE() << "a tensor of 65 dimensions was sent";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("65 dimensions"), std::string::npos) << e.what();
  }
  try {
    pool.apply_async(with_dims, 65).get(10s);
    ADD_FAILURE() << "a worker's tensor of 65 dimensions arrived";
  } catch (const RemoteError& e) {
    EXPECT_NE(e.message().find("65 dimensions"), std::string::npos) << e.what();
  }
  EXPECT_EQ(pool.apply_async(with_dims, 3).get(10s).dim(), 3);
  EXPECT_EQ(pool.worker_pids().at(0), worker);  // the same worker served on
}

Tensor fill_ones(Tensor t) {
  float* data = t.data<float>();
  for (std::int64_t i = 0; i < t.numel(); ++i) data[i] = 1.0f;
  return t;
}

Tensor make_in_worker(int n) {
  Tensor t = Tensor::empty({n}, DType::i32);
  for (int i = 0; i < n; ++i) t.data<std::int32_t>()[i] = i * 3;
  return t;
}

// Touches the first and last element, as torch's benchmark does, and returns the tensor.
Tensor touch_ends(Tensor t) {
  auto* bytes = static_cast<std::uint8_t*>(t.raw_data());
  bytes[0] += 1;
  bytes[t.nbytes() - 1] += 1;
  return t;
}

float first_element(Tensor t) { return t.data<float>()[0]; }
float sleep_and_hold(Tensor t) {
  std::this_thread::sleep_for(std::chrono::seconds(30));
  return t.data<float>()[0];
}

class SharingStrategies : public ::testing::TestWithParam<SharingStrategy> {
 protected:
  void SetUp() override { set_sharing_strategy(GetParam()); }
  void TearDown() override { set_sharing_strategy(SharingStrategy::file_descriptor); }
};

TEST(Tensor, HasShapeStridesAndDtype) {
  Tensor t = Tensor::zeros({2, 3, 4}, DType::f32);
  EXPECT_EQ(std::vector<std::int64_t>(t.shape().begin(), t.shape().end()), (std::vector<std::int64_t>{2, 3, 4}));
  EXPECT_EQ(std::vector<std::int64_t>(t.strides().begin(), t.strides().end()), (std::vector<std::int64_t>{12, 4, 1}));
  EXPECT_EQ(t.numel(), 24);
  EXPECT_EQ(t.nbytes(), 96u);
  EXPECT_TRUE(t.is_shared());
  EXPECT_EQ(t.data<float>()[23], 0.0f);
}

// Up to four dimensions are held in the tensor itself, more on the heap: both keep their shape
// and strides through copies, moves, slices and a channel.
TEST(Tensor, KeepsItsShapeAndStridesAtEveryRankThroughCopiesMovesAndAChannel) {
  auto as_vector = [](std::span<const std::int64_t> values) {
    return std::vector<std::int64_t>(values.begin(), values.end());
  };
  for (std::size_t rank = 0; rank <= 7; ++rank) {
    std::vector<std::int64_t> shape;
    for (std::size_t d = 0; d < rank; ++d) shape.push_back(static_cast<std::int64_t>(d % 3) + 1);
    Tensor t = Tensor::zeros(shape, DType::i16);
    std::vector<std::int64_t> strides = detail::contiguous_strides(shape);
    Tensor copy = t;
    Tensor assigned;
    assigned = copy;
    Tensor moved = std::move(copy);
    Tensor received = through_channel(t);
    for (const Tensor* each : {&t, &assigned, &moved, &received}) {
      EXPECT_EQ(as_vector(each->shape()), shape) << "rank " << rank;
      EXPECT_EQ(as_vector(each->strides()), strides) << "rank " << rank;
      EXPECT_EQ(each->dim(), static_cast<std::int64_t>(rank));
    }
    if (rank > 0) {
      Tensor sliced = t.slice(-1, 0, 1);
      EXPECT_EQ(sliced.shape().back(), 1) << "rank " << rank;
      EXPECT_EQ(as_vector(sliced.strides()), strides) << "rank " << rank;
    }
  }
}

TEST(Tensor, DefaultIsEmptyWithoutStorage) {
  Tensor t;
  EXPECT_EQ(t.numel(), 0);
  EXPECT_EQ(t.raw_data(), nullptr);
  EXPECT_EQ(through_channel(t).numel(), 0);
}

TEST(Tensor, DataOfTheWrongTypeThrows) {
  Tensor t = Tensor::zeros({4}, DType::i32);
  EXPECT_THROW(t.data<float>(), std::invalid_argument);
  EXPECT_NO_THROW(t.data<std::int32_t>());
}

TEST(Tensor, FromCopiesValuesOnce) {
  std::vector<double> values{1, 2, 3, 4, 5, 6};
  Tensor t = Tensor::from<double>(values, {2, 3});
  values[0] = 100;
  EXPECT_EQ(t.data<double>()[0], 1.0);
  EXPECT_EQ(t.data<double>()[5], 6.0);
  EXPECT_THROW(Tensor::from<double>(values, {4}), std::invalid_argument);
}

TEST(Tensor, ViewsAndSlicesShareStorage) {
  std::vector<std::int32_t> values(12);
  std::iota(values.begin(), values.end(), 0);
  Tensor t = Tensor::from<std::int32_t>(values, {3, 4});
  Tensor flat = t.view({-1});
  EXPECT_EQ(flat.numel(), 12);
  Tensor row = t.slice(0, 1, 2);
  EXPECT_EQ(row.data<std::int32_t>()[0], 4);
  Tensor column = t.slice(1, 2, 3);
  EXPECT_EQ(column.shape()[0], 3);
  EXPECT_EQ(column.data<std::int32_t>()[column.strides()[0]], 6);
  row.data<std::int32_t>()[0] = 40;
  EXPECT_EQ(t.data<std::int32_t>()[4], 40);
  EXPECT_EQ(flat.data<std::int32_t>()[4], 40);
  Tensor down = column.view({3});  // (3, 1) strides (4, 1): the size-1 dimension goes, as in torch
  EXPECT_EQ(std::vector<std::int64_t>(down.strides().begin(), down.strides().end()), std::vector<std::int64_t>{4});
  EXPECT_EQ(down.data<std::int32_t>()[2 * 4], 10);
  EXPECT_THROW(t.slice(1, 1, 3).view({6}), std::invalid_argument);  // two separate runs of 2
  EXPECT_THROW(t.view({5}), std::invalid_argument);
  EXPECT_THROW(Tensor::empty({-1}, DType::f32), std::invalid_argument);
}

TEST(Tensor, ASizeOfZeroReachesNothingHoweverLargeTheOthersAndEveryOtherShapeIsCheckedWhole) {
  constexpr std::int64_t kHuge = std::int64_t{1} << 40;  // two of them overflow an int64
  // No element: valid whatever the other sizes (torch.empty(2**40, 2**40, 0) is), numel 0.
  for (std::vector<std::int64_t> shape : {std::vector<std::int64_t>{kHuge, kHuge, 0}, {0, kHuge, kHuge}}) {
    Tensor none = Tensor::empty(shape, DType::f32);
    EXPECT_EQ(none.numel(), 0);
    EXPECT_EQ(none.nbytes(), 0u);
  }
  // A negative size is refused wherever it stands, after a 0 too.
  EXPECT_THROW(Tensor::empty({0, -1}, DType::f32), std::invalid_argument);
  // Shapes past int64 are refused (the asan build's UBSan halts on the overflow itself).
  EXPECT_THROW(Tensor::empty({kHuge, kHuge}, DType::f32), std::invalid_argument);
  Tensor four = Tensor::zeros({4}, DType::f32);
  try {
    four.view({kHuge, kHuge});
    ADD_FAILURE() << "a view of 2^80 elements was made";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("more elements than an int64"), std::string::npos) << e.what();
  }
  // As torch: beside a 0 the -1 of a view could be any size.
  EXPECT_THROW(Tensor::zeros({0}, DType::f32).view({0, -1}), std::invalid_argument);
  EXPECT_EQ(four.view({2, -1}).shape()[1], 2);
}

TEST(Tensor, ASliceWithAStepTakesEveryStepthElementAsTorchsDoes) {
  std::vector<std::int32_t> values(20);
  std::iota(values.begin(), values.end(), 0);
  Tensor t = Tensor::from<std::int32_t>(values, {4, 5});
  auto elements = [](const Tensor& s) {  // row-major, through the strides
    std::vector<std::int32_t> out;
    for (std::int64_t i = 0; i < s.shape()[0]; ++i)
      for (std::int64_t j = 0; j < s.shape()[1]; ++j)
        out.push_back(s.data<std::int32_t>()[i * s.strides()[0] + j * s.strides()[1]]);
    return out;
  };
  // torch: t[:, 1::2] is columns 1 and 3; t[::3] rows 0 and 3; t[1:4:2] rows 1 and 3.
  EXPECT_EQ(elements(t.slice(1, 1, 5, 2)), (std::vector<std::int32_t>{1, 3, 6, 8, 11, 13, 16, 18}));
  EXPECT_EQ(elements(t.slice(0, 0, 4, 3)), (std::vector<std::int32_t>{0, 1, 2, 3, 4, 15, 16, 17, 18, 19}));
  EXPECT_EQ(t.slice(0, 1, 4, 2).shape()[0], 2);
  EXPECT_EQ(t.slice(1, 0, 5, std::numeric_limits<std::int64_t>::max()).shape()[1],
            1);  // one element: no stride overflow
  EXPECT_EQ(t.slice(1, 3, 3, 2).shape()[1], 0);
  EXPECT_THROW(t.slice(1, 0, 5, 0), std::invalid_argument);
  EXPECT_THROW(t.slice(1, 0, 5, -1), std::invalid_argument);
}

TEST(Tensor, AViewOfANonContiguousTensorSplitsOrMergesOnlyWithinItsRunsAsTorchsDoes) {
  auto strides_of = [](const Tensor& t) { return std::vector<std::int64_t>(t.strides().begin(), t.strides().end()); };
  std::vector<std::int32_t> values(24);
  std::iota(values.begin(), values.end(), 0);
  Tensor t = Tensor::from<std::int32_t>(values, {4, 6});
  // Rows of 4 out of 6: each row is a run; a row may be split, two rows may not merge.
  Tensor rows = t.slice(1, 0, 4);
  Tensor split = rows.view({4, 2, 2});
  EXPECT_EQ(strides_of(split), (std::vector<std::int64_t>{6, 2, 1}));
  EXPECT_EQ(split.data<std::int32_t>()[1 * 6 + 1 * 2 + 1], 9);  // element [1][1][1] is row 1, column 3
  EXPECT_EQ(strides_of(rows.view({2, 2, 4})), (std::vector<std::int64_t>{12, 6, 1}));  // merging whole rows is fine
  EXPECT_THROW(rows.view({16}), std::invalid_argument);
  EXPECT_THROW(rows.view({2, 8}), std::invalid_argument);
  // The transpose of a 3 x 4: (4, 3) with strides (1, 4). torch gives (2, 2, 3) the strides (2, 1, 4).
  Tensor transposed = Tensor::from_storage(t.storage(), 0, {4, 3}, {1, 4}, DType::i32);
  EXPECT_EQ(strides_of(transposed.view({2, 2, 3})), (std::vector<std::int64_t>{2, 1, 4}));
  EXPECT_THROW(transposed.view({12}), std::invalid_argument);
  // A 0-dim tensor views as any shape of one element; an empty one keeps its strides in its shape.
  Tensor scalar = Tensor::zeros({}, DType::f32);
  EXPECT_EQ(strides_of(scalar.view({1, 1})), (std::vector<std::int64_t>{1, 1}));
  EXPECT_EQ(strides_of(Tensor::from_storage(t.storage(), 0, {0, 3}, {1, 4}, DType::i32).view({0, 3})),
            (std::vector<std::int64_t>{1, 4}));
}

TEST(Tensor, IsContiguousExactlyWhenTheStridesAreRowMajor) {
  Tensor t = Tensor::zeros({3, 4}, DType::f32);
  EXPECT_TRUE(t.is_contiguous());
  EXPECT_TRUE(t.slice(0, 1, 3).is_contiguous());   // whole rows
  EXPECT_FALSE(t.slice(1, 1, 3).is_contiguous());  // part of each row
  EXPECT_TRUE(Tensor::zeros({}, DType::f32).is_contiguous());
  auto strided = [&](std::vector<std::int64_t> shape, std::vector<std::int64_t> strides) {
    return Tensor::from_storage(t.storage(), 0, std::move(shape), std::move(strides), DType::f32);
  };
  EXPECT_FALSE(strided({4, 3}, {1, 4}).is_contiguous());  // the transpose
  EXPECT_TRUE(strided({3, 0}, {1, 1}).is_contiguous());   // no elements: strides as if each dim were 1
  EXPECT_FALSE(strided({3, 0}, {0, 1}).is_contiguous());
  EXPECT_FALSE(strided({2, 2}, {4, 2}).is_contiguous());  // every other element
}

TEST(Tensor, SharingStrategiesAreListedAndSettable) {
  EXPECT_EQ(get_sharing_strategy(), SharingStrategy::file_descriptor);
  EXPECT_EQ(get_all_sharing_strategies().size(), 2u);
  set_sharing_strategy(SharingStrategy::file_system);
  EXPECT_EQ(get_sharing_strategy(), SharingStrategy::file_system);
  set_sharing_strategy(SharingStrategy::file_descriptor);
}

TEST_P(SharingStrategies, ASentTensorIsTheSameMemory) {
  Tensor t = Tensor::zeros({16}, DType::f32);
  Tensor received = through_channel(t);
  received.data<float>()[3] = 7.0f;
  EXPECT_EQ(t.data<float>()[3], 7.0f);
  // A segment already mapped here is reused, not mapped again. (A block sent outside a pool's
  // conversation carries its whole slab, which is mapped whole.)
  if (GetParam() == SharingStrategy::file_system) {
    EXPECT_EQ(received.raw_data(), t.raw_data());
  }
}

TEST_P(SharingStrategies, SlicesAndViewsKeepTheirOffsets) {
  std::vector<float> values(100);
  std::iota(values.begin(), values.end(), 0.0f);
  Tensor t = Tensor::from<float>(values, {10, 10});
  Tensor column = through_channel(t.slice(0, 2, 5).slice(1, 3, 4));
  ASSERT_EQ(column.numel(), 3);
  EXPECT_EQ(column.data<float>()[0], 23.0f);
  EXPECT_EQ(column.data<float>()[column.strides()[0] * 2], 43.0f);
  Tensor view = through_channel(t.view({4, 25}).slice(0, 1, 2));
  EXPECT_EQ(view.data<float>()[0], 25.0f);
}

TEST_P(SharingStrategies, AWorkersWritesAreSeenByTheParent) {
  Pool pool({.processes = 2, .start_method = StartMethod::fork});
  Tensor t = Tensor::zeros({1024, 1024}, DType::f32);
  Tensor same = pool.apply_async(fill_ones, t).get();
  EXPECT_EQ(t.data<float>()[0], 1.0f);
  EXPECT_EQ(t.data<float>()[1024 * 1024 - 1], 1.0f);
  EXPECT_EQ(same.raw_data(), t.raw_data());
  EXPECT_EQ(pool.apply_async(first_element, t).get(), 1.0f);
}

TEST_P(SharingStrategies, ATensorMadeInAWorkerOutlivesTheWorker) {
  Pool pool({.processes = 1, .maxtasksperchild = 1, .start_method = StartMethod::forkserver});
  Tensor t = pool.apply_async(make_in_worker, 1000).get();
  auto pids = pool.worker_pids();
  pool.close();
  run(pool.join());
  for (pid_t pid : pids) EXPECT_FALSE(test_support::process_alive(pid));
  ASSERT_EQ(t.numel(), 1000);
  EXPECT_EQ(t.data<std::int32_t>()[999], 999 * 3);
}

INSTANTIATE_TEST_SUITE_P(Both, SharingStrategies,
                         ::testing::Values(SharingStrategy::file_descriptor, SharingStrategy::file_system),
                         [](const auto& info) {
                           return info.param == SharingStrategy::file_descriptor ? "file_descriptor" : "file_system";
                         });

TEST(Tensor, AOneGiBTensorRoundTripsThroughAWorker) {
  Pool pool({.processes = 1});
  Tensor t = Tensor::zeros({1 << 28}, DType::f32);  // 1 GiB
  Tensor back = pool.apply_async(touch_ends, t).get();
  EXPECT_EQ(back.nbytes(), std::size_t{1} << 30);
  EXPECT_EQ(static_cast<std::uint8_t*>(t.raw_data())[0], 1);
  EXPECT_EQ(static_cast<std::uint8_t*>(t.raw_data())[(std::size_t{1} << 30) - 1], 1);
}

// A hand-made tensor message, as a lying peer would send it.
void expect_rejected(std::uint8_t kind, int fd, std::uint64_t storage_size, std::vector<std::int64_t> shape,
                     std::vector<std::int64_t> strides, const char* fragment) {
  auto [a, b] = detail::Channel::make_pair();
  Writer w;
  w.write(kind);
  w.write(fd >= 0 ? w.attach_fd(fd) : 0u);
  w.write(storage_size);
  w.write(std::int64_t{0});
  w.write(DType::f32);
  w.write(shape);
  w.write(strides);
  a.send(1, 1, w.bytes(), w.fds());
  detail::Message m = b.receive();
  Reader r = m.reader();
  try {
    r.read<Tensor>();
    FAIL() << "accepted";
  } catch (const ProtocolError& e) {
    EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
  }
}

TEST(Tensor, MalformedTensorsAreProtocolErrors) {
  constexpr std::uint8_t kMemfd = 1;
  char path[] = "/tmp/forkpool-regular-XXXXXX";
  UniqueFd regular(mkstemp(path));
  unlink(path);
  ASSERT_EQ(ftruncate(regular.get(), 4096), 0);
  expect_rejected(kMemfd, regular.get(), 4096, {16}, {1}, "not a memfd");

  int pipe_fds[2];
  ASSERT_EQ(pipe2(pipe_fds, O_CLOEXEC), 0);
  UniqueFd pipe_read(pipe_fds[0]), pipe_write(pipe_fds[1]);
  expect_rejected(kMemfd, pipe_read.get(), 64, {16}, {1}, "not a memfd");

  UniqueFd unsealed = create_memfd("unsealed", 4096);
  expect_rejected(kMemfd, unsealed.get(), 4096, {16}, {1}, "not sealed");

  UniqueFd small = create_memfd("small", 64);
  seal_size(small.get());
  expect_rejected(kMemfd, small.get(), 1 << 20, {1024}, {1}, "holds 64 bytes");
  expect_rejected(kMemfd, small.get(), 64, {1024}, {1}, "exceeds its storage");
  expect_rejected(kMemfd, small.get(), 64, {std::int64_t{1} << 62, 4}, {4, 1}, "overflow");
  expect_rejected(kMemfd, small.get(), 64, {-4}, {1}, "negative");
  expect_rejected(kMemfd, small.get(), 64, {0, -4}, {1, 1}, "negative");  // after a 0 too
  expect_rejected(kMemfd, small.get(), 64, {4, 4}, {1}, "mismatched");
}

TEST(Tensor, ASegmentNameThatIsNotForkpoolsIsAProtocolError) {
  auto [a, b] = detail::Channel::make_pair();
  Writer w;
  w.write(std::uint8_t{2});  // a named segment
  w.write(std::string("../etc/passwd"));
  w.write(std::uint64_t{64});
  w.write(std::int64_t{0});
  w.write(DType::f32);
  w.write(std::vector<std::int64_t>{4});
  w.write(std::vector<std::int64_t>{1});
  a.send(1, 1, w.bytes());
  detail::Message m = b.receive();
  EXPECT_THROW(decode<Tensor>(m.payload.bytes()), ProtocolError);
}

// Outside a pool, a tensor carries its slab's descriptor in every message; a receiver that drops
// it closes the descriptor. (In a pool a slab crosses once: shared_memory_test.cpp.)
TEST(Tensor, ThousandsOfTensorsReceivedOutsideAPoolNeverExhaustDescriptors) {
  int status = test_support::run_in_child([] {
    rlimit limit{256, 256};
    if (setrlimit(RLIMIT_NOFILE, &limit) != 0) throw std::runtime_error("setrlimit");
    auto [receiver, sender] = detail::Channel::make_pair();
    pid_t pid = fork();
    if (pid == 0) {
      receiver.release().reset();
      for (int i = 0; i < 2'000; ++i) {
        Tensor t = Tensor::empty({4}, DType::i32);  // distinct storage each time
        t.data<std::int32_t>()[0] = i;
        Writer w = encode(t);
        sender.send(1, i, w.bytes(), w.fds());
        if (i % 64 == 63) sender.receive();  // bounded in flight
      }
      _exit(0);
    }
    sender.release().reset();
    for (int i = 0; i < 2'000; ++i) {
      detail::Message m = receiver.receive();
      Tensor t = decode<Tensor>(m.payload.bytes(), m.fds);
      if (t.data<std::int32_t>()[0] != i) throw std::runtime_error("wrong tensor");
      if (i % 64 == 63) receiver.send(2, i, {});
    }
    int child = 0;
    waitpid(pid, &child, 0);
    if (!WIFEXITED(child) || WEXITSTATUS(child) != 0) throw std::runtime_error("sender failed");
  });
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
}

// Kibibytes of shared memory `pid` has touched (RssShmem): its own, whatever other processes do.
long shmem_resident_kib(pid_t pid) {
  std::ifstream status("/proc/" + std::to_string(pid) + "/status");
  std::string key;
  while (status >> key) {
    long value;
    if (key == "RssShmem:" && status >> value) return value;
  }
  return -1;
}

bool is_shared_segment(const std::string& path) {
  return path.rfind("/memfd:", 0) == 0 || path.rfind("/dev/shm/", 0) == 0;
}

// A memfd or /dev/shm file: its device and inode.
using Segment = std::pair<dev_t, ino_t>;

// The memfds and /dev/shm files `pid` maps or holds open, with the bytes of its largest mapping
// of each (0: only a descriptor).
std::map<Segment, std::size_t> shared_segments_of(pid_t pid) {
  std::map<Segment, std::size_t> found;
  std::string proc = "/proc/" + std::to_string(pid);
  std::ifstream maps(proc + "/maps");
  for (std::string line; std::getline(maps, line);) {
    std::istringstream fields(line);
    std::uintptr_t begin = 0, end = 0;
    std::string perms, offset, path;
    unsigned major = 0, minor = 0;
    char dash, colon;
    ino_t inode = 0;
    fields >> std::hex >> begin >> dash >> end >> perms >> offset >> major >> colon >> minor >> std::dec >> inode;
    std::getline(fields >> std::ws, path);
    if (inode == 0 || !is_shared_segment(path)) continue;
    std::size_t& bytes = found[{makedev(major, minor), inode}];
    bytes = std::max<std::size_t>(bytes, end - begin);
  }
  if (DIR* fds = opendir((proc + "/fd").c_str())) {
    while (dirent* entry = readdir(fds)) {
      std::string fd = proc + "/fd/" + entry->d_name;
      char target[256];
      ssize_t length = readlink(fd.c_str(), target, sizeof target - 1);
      struct stat file;
      if (length > 0 && is_shared_segment(std::string(target, static_cast<std::size_t>(length))) &&
          stat(fd.c_str(), &file) == 0)
        found.try_emplace({file.st_dev, file.st_ino}, 0);
    }
    closedir(fds);
  }
  return found;
}

// The processes that still map or hold any of `segments`, with the bytes of the largest mapping
// of one of them each has.
std::map<pid_t, std::size_t> holders_of(const std::set<Segment>& segments) {
  std::map<pid_t, std::size_t> holders;
  if (DIR* proc = opendir("/proc")) {
    while (dirent* entry = readdir(proc)) {
      pid_t pid = std::atoi(entry->d_name);
      if (pid <= 0) continue;
      for (const auto& [segment, bytes] : shared_segments_of(pid))
        if (segments.contains(segment)) holders[pid] = std::max(holders[pid], bytes);
    }
    closedir(proc);
  }
  return holders;
}

std::vector<std::string> segments_of(pid_t pid) {
  std::vector<std::string> found;
  std::string prefix = "forkpool-" + std::to_string(pid) + "-";
  if (DIR* dir = opendir("/dev/shm")) {
    while (dirent* entry = readdir(dir))
      if (std::string(entry->d_name).rfind(prefix, 0) == 0) found.push_back(entry->d_name);
    closedir(dir);
  }
  return found;
}

// Measured on the segments themselves, not the machine's Shmem total, which other tests running
// beside this one move by hundreds of MiB: the memory of a segment no process maps or holds and
// no name keeps is the kernel's again.
// The parent's loop runs until the tensor is in its workers' hands: one has mapped it and
// sleeps holding it, so only the parent's death can end that worker in time.
TEST_P(SharingStrategies, AParentKilledWithTensorsInFlightLeavesNothingBehind) {
  constexpr std::size_t kBig = std::size_t{256} << 20;
  SharingStrategy strategy = GetParam();
  int ready[2];
  ASSERT_EQ(pipe(ready), 0);
  pid_t parent = fork();
  if (parent == 0) {
    set_sharing_strategy(strategy);
    Pool pool({.processes = 2, .start_method = StartMethod::fork});
    Tensor big = Tensor::empty({static_cast<std::int64_t>(kBig / sizeof(float))}, DType::f32);
    std::memset(big.raw_data(), 1, big.nbytes());
    std::optional<AsyncResult<float>> held;
    run([&]() -> Task<void> {
      for (int i = 0; i < 4; ++i) co_await pool.apply_async(first_element, big);
      held = pool.apply_async(sleep_and_hold, big);
      co_await sleep_for(100ms);  // the loop sends it; the worker takes it up
    }());
    char one = 1;
    (void)!write(ready[1], &one, 1);
    pause();
    _exit(0);
  }
  close(ready[1]);
  char one;
  ASSERT_EQ(read(ready[0], &one, 1), 1);
  close(ready[0]);
  EXPECT_GE(shmem_resident_kib(parent), static_cast<long>(kBig >> 10)) << "the tensor is not in shared memory";
  // Its own, not the slabs of earlier tests it inherited from this process (fork keeps them).
  std::set<Segment> segments;
  for (const auto& [segment, bytes] : shared_segments_of(parent)) segments.insert(segment);
  for (const auto& [ours, bytes] : shared_segments_of(getpid())) segments.erase(ours);
  std::map<pid_t, std::size_t> holding = holders_of(segments);
  holding.erase(parent);
  ASSERT_FALSE(holding.empty()) << "its workers map nothing of the parent's";
  EXPECT_TRUE(std::ranges::any_of(holding, [&](const auto& holder) { return holder.second >= kBig; }))
      << "no worker maps the tensor it was sent";
  kill(parent, SIGKILL);
  waitpid(parent, nullptr, 0);
  test_support::eventually([&] { return segments_of(parent).empty() && holders_of(segments).empty(); });
  holding = holders_of(segments);
  EXPECT_TRUE(segments_of(parent).empty()) << segments_of(parent).front();
  if (!holding.empty()) {
    pid_t holder = holding.begin()->first;
    ADD_FAILURE() << "process " << holder << " (" << test_support::process_name(holder)
                  << ") still holds the killed parent's shared memory";
  }
}

TEST(DLPack, RoundTripKeepsDataShapeStridesAndDtype) {
  std::vector<std::int16_t> values(24);
  std::iota(values.begin(), values.end(), 0);
  Tensor t = Tensor::from<std::int16_t>(values, {4, 6}).slice(1, 1, 4);
  DLManagedTensor* managed = to_dlpack(t);
  EXPECT_EQ(managed->dl_tensor.ndim, 2);
  EXPECT_EQ(managed->dl_tensor.dtype.code, kDLInt);
  EXPECT_EQ(managed->dl_tensor.dtype.bits, 16);
  EXPECT_EQ(managed->dl_tensor.strides[0], 6);
  Tensor back = from_dlpack(managed);
  EXPECT_TRUE(back.is_shared());
  EXPECT_EQ(back.raw_data(), t.raw_data());
  EXPECT_EQ(back.dtype(), DType::i16);
  EXPECT_EQ(std::vector<std::int64_t>(back.shape().begin(), back.shape().end()), (std::vector<std::int64_t>{4, 3}));
  EXPECT_EQ(std::vector<std::int64_t>(back.strides().begin(), back.strides().end()), (std::vector<std::int64_t>{6, 1}));
  EXPECT_EQ(back.data<std::int16_t>()[6], 7);
}

TEST(DLPack, ForeignMemoryIsNotSharedUntilShareMemoryCopiesIt) {
  static bool released;
  released = false;
  auto* values = new double[6]{1, 2, 3, 4, 5, 6};
  static std::int64_t shape[] = {2, 3};
  auto* managed = new DLManagedTensor{};
  managed->dl_tensor = {values, {kDLCPU, 0}, 2, {kDLFloat, 64, 1}, shape, nullptr, 0};
  managed->manager_ctx = values;
  managed->deleter = [](DLManagedTensor* m) {
    delete[] static_cast<double*>(m->manager_ctx);
    delete m;
    released = true;
  };
  Tensor t = from_dlpack(managed);
  EXPECT_FALSE(t.is_shared());
  EXPECT_EQ(t.data<double>()[4], 5.0);
  try {
    encode(t);
    FAIL() << "an unshared tensor was sent";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("share_memory_()"), std::string::npos);
  }
  t.share_memory_();
  EXPECT_TRUE(released);  // the foreign memory was let go after the copy
  EXPECT_TRUE(t.is_shared());
  EXPECT_EQ(t.data<double>()[4], 5.0);
  EXPECT_EQ(through_channel(t).data<double>()[5], 6.0);
}

int dlpack_released = 0;
float dlpack_values[5] = {1, 2, 3, 4, 5};
std::int64_t dlpack_shape[] = {4};

TEST(DLPack, ATensorThatCouldNotBeReadIsRefusedAndItsProducerReleasedOnce) {
  int& released = dlpack_released;
  released = 0;
  auto refusal = [](auto change) -> std::string {
    auto* managed = new DLManagedTensor{};
    managed->dl_tensor = {dlpack_values, {kDLCPU, 0}, 1, {kDLFloat, 32, 1}, dlpack_shape, nullptr, 0};
    managed->deleter = [](DLManagedTensor* m) {
      delete m;
      ++dlpack_released;
    };
    change(managed->dl_tensor);
    try {
      Tensor t = from_dlpack(managed);
      return "made a tensor of " + std::to_string(t.numel()) + " elements";
    } catch (const std::invalid_argument& e) {
      return e.what();
    }
  };
  auto has = [](const std::string& text, const char* words) { return text.find(words) != std::string::npos; };
  EXPECT_PRED2(has, refusal([](DLTensor& dl) { dl.data = nullptr; }), "null data");
  EXPECT_PRED2(has, refusal([](DLTensor& dl) { dl.shape = nullptr; }), "no shape");
  EXPECT_PRED2(has, refusal([](DLTensor& dl) { dl.byte_offset = 2; }), "not aligned");
  EXPECT_EQ(released, 3);
  // Still made: a whole element further on, and no elements over no memory.
  EXPECT_PRED2(has, refusal([](DLTensor& dl) { dl.byte_offset = 4; }), "made a tensor of 4");
  static std::int64_t none[] = {0};
  EXPECT_PRED2(has, refusal([](DLTensor& dl) {
                 dl.data = nullptr;
                 dl.shape = none;
               }),
               "made a tensor of 0");
  EXPECT_EQ(released, 5);
}

}  // namespace
}  // namespace forkpool

namespace forkpool {
namespace {

TEST(Tensor, AFullDescriptorTableIsAProtocolErrorAndThePoolRecovers) {
  int status = test_support::run_in_child([] {
    Pool pool({.processes = 1, .start_method = StartMethod::fork});
    pool.apply_async(make_in_worker, 4).get();  // warm: every descriptor the pool needs is open
    rlimit limit{static_cast<rlim_t>(test_support::open_fd_count() + 4), 1024};
    if (setrlimit(RLIMIT_NOFILE, &limit) != 0) throw std::runtime_error("setrlimit");
    std::vector<Tensor> held;  // each keeps its slab, and the slab's descriptor, open
    bool refused = false;
    for (int i = 0; i < 16 && !refused; ++i) {
      try {
        // Past the largest block: a slab of its own each (smaller ones share slabs that grow).
        held.push_back(pool.apply_async(make_in_worker, (65 << 20) / 4).get());
      } catch (const ProtocolError& e) {
        refused = std::string(e.what()).find("descriptor table") != std::string::npos;
        if (!refused) throw;
      }
    }
    if (!refused) throw std::runtime_error("the descriptor table never filled");
    held.clear();
    limit.rlim_cur = 1024;
    setrlimit(RLIMIT_NOFILE, &limit);
    if (pool.apply_async(make_in_worker, 8).get().data<std::int32_t>()[7] != 21)
      throw std::runtime_error("the pool did not recover");
  });
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
}

}  // namespace
}  // namespace forkpool
