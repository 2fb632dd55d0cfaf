// Lent storages (pool/internal/loans.hpp): a tensor crosses to a worker with its descriptor once,
// stays mapped there while the parent holds it, and is dropped there once the parent lets go.

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include <forkpool/ipc/internal/channel.hpp>
#include <forkpool/pool/pool.hpp>
#include <forkpool/runtime/internal/process.hpp>
#include <forkpool/shm/sharing.hpp>
#include <forkpool/pool/internal/loans.hpp>
#include <forkpool/shm/tensor.hpp>
#include <forkpool/shm/tensor_codec.hpp>
#include "support.hpp"

namespace forkpool {
namespace {

using test_support::eventually;

using detail::PeerLoans;
using detail::MessageLoan;
using detail::BorrowedStorages;

using namespace std::chrono_literals;

// The worker's own Storage object for the tensor: a new one would mean it was adopted again.
std::uint64_t storage_id_in_worker(Tensor t) { return t.storage()->id(); }
Tensor same_tensor(Tensor t) { return t; }
Tensor second_half(Tensor t) { return t.slice(0, t.shape()[0] / 2, t.shape()[0]); }
int nothing(int x) { return x; }
std::int32_t first_int(Tensor t) { return t.data<std::int32_t>()[0]; }
Tensor touch_first(Tensor t) {
  t.data<float>()[0] += 1;
  return t;
}

// How many mappings of tensor memfds process `pid` has.
int tensor_mappings_of(pid_t pid) {
  std::ifstream maps("/proc/" + std::to_string(pid) + "/maps");
  int count = 0;
  for (std::string line; std::getline(maps, line);)
    if (line.find("memfd:forkpool-tensor") != std::string::npos) ++count;
  return count;
}

TEST(Loans, ATensorSentAgainIsNotAdoptedAgainByTheWorker) {
  Pool pool({.processes = 1});
  Tensor t = Tensor::zeros({1024}, DType::f32);
  std::uint64_t first = pool.apply_async(storage_id_in_worker, t).get();
  for (int i = 0; i < 5; ++i) EXPECT_EQ(pool.apply_async(storage_id_in_worker, t).get(), first);
  EXPECT_EQ(tensor_mappings_of(pool.worker_pids().at(0)), 1);
}

TEST(Loans, AReturnedTensorIsTheParentsOwnStorage) {
  Pool pool({.processes = 1});
  Tensor t = Tensor::zeros({1024}, DType::f32);
  Tensor back = pool.apply_async(same_tensor, t).get();
  EXPECT_EQ(back.storage(), t.storage());
  Tensor half = pool.apply_async(second_half, t).get();
  EXPECT_EQ(half.storage(), t.storage());
  EXPECT_EQ(half.storage_offset(), 512 * 4);
  EXPECT_EQ(half.shape()[0], 512);
}

TEST(Loans, ATensorTheParentLetsGoIsUnmappedInTheWorker) {
  Pool pool({.processes = 1});
  pid_t worker = pool.worker_pids().at(0);
  std::optional<Tensor> t = Tensor::zeros({1 << 20}, DType::f32);
  pool.apply_async(storage_id_in_worker, *t).get();
  EXPECT_EQ(tensor_mappings_of(worker), 1);
  t.reset();  // the last holder in the parent: the worker is told at once
  EXPECT_TRUE(eventually([&] { return tensor_mappings_of(worker) == 0; })) << "the worker still maps it";
}

TEST(Loans, ATensorReleasedOnAnotherThreadIsUnmappedInTheWorker) {
  Pool pool({.processes = 1});
  pid_t worker = pool.worker_pids().at(0);
  std::optional<Tensor> t = Tensor::zeros({1 << 20}, DType::f32);
  pool.apply_async(storage_id_in_worker, *t).get();
  std::thread([&] { t.reset(); }).join();  // the pool's loop is not running meanwhile
  EXPECT_TRUE(eventually([&] { return tensor_mappings_of(worker) == 0; })) << "the worker still maps it";
}

TEST(Loans, StoragesReleasedOnManyThreadsWhileThePoolRunsAreAllDropped) {
  Pool pool({.processes = 1});
  pid_t worker = pool.worker_pids().at(0);
  constexpr int kThreads = 4, kEach = 16;
  std::vector<std::vector<Tensor>> batches(kThreads);
  for (auto& batch : batches)
    for (int i = 0; i < kEach; ++i) batch.push_back(Tensor::zeros({16}, DType::f32));
  for (auto& batch : batches) pool.map_async(storage_id_in_worker, batch).get();
  ASSERT_EQ(tensor_mappings_of(worker), kThreads * kEach);
  std::vector<std::thread> threads;
  for (auto& batch : batches)
    threads.emplace_back([&batch] {
      while (!batch.empty()) batch.pop_back();
    });
  for (int i = 0; i < 50; ++i) EXPECT_EQ(pool.apply_async(nothing, i).get(), i);  // meanwhile
  for (auto& thread : threads) thread.join();
  EXPECT_TRUE(eventually([&] { return tensor_mappings_of(worker) == 0; })) << "the worker still maps some";
}

int sleep_ms(int ms) {
  std::this_thread::sleep_for(std::chrono::milliseconds(ms));
  return ms;
}

// The kernel queues few datagrams per socket (net.unix.max_dgram_qlen): releases sent while the
// worker is busy fill it, and later jobs must still arrive in order and complete.
TEST(Loans, ReleasesThatFillABusyWorkersSocketLoseNothing) {
  Pool pool({.processes = 1});
  pid_t worker = pool.worker_pids().at(0);
  std::vector<Tensor> dropped;
  for (int i = 0; i < 40; ++i) dropped.push_back(Tensor::zeros({16}, DType::f32));
  pool.map_async(storage_id_in_worker, dropped).get();
  auto busy = pool.apply_async(sleep_ms, 200);
  dropped.clear();  // 40 releases while the worker sleeps
  Tensor kept = Tensor::zeros({16}, DType::f32);
  std::vector<AsyncResult<Tensor>> results;
  for (int i = 0; i < 8; ++i) results.push_back(pool.apply_async(touch_first, kept));
  EXPECT_EQ(busy.get(), 200);
  for (auto& result : results) EXPECT_EQ(result.get().storage(), kept.storage());
  EXPECT_EQ(kept.data<float>()[0], 8.0f);
  EXPECT_TRUE(eventually([&] { return tensor_mappings_of(worker) == 1; })) << tensor_mappings_of(worker);
}

// A worker keeps a descriptor per storage it holds for the parent: the parent's releases must
// keep that bounded by what the parent holds, not by what it ever sent.
TEST(Loans, AWorkerLentThousandsOfTensorsOverItsLifeNeverRunsOutOfDescriptors) {
  Pool pool({.processes = 1, .initializer = [] {
               rlimit limit{64, 64};
               if (setrlimit(RLIMIT_NOFILE, &limit) != 0) std::abort();
             }});
  for (int i = 0; i < 5'000; ++i) {
    Tensor t = Tensor::zeros({4}, DType::i32);
    t.data<std::int32_t>()[0] = i;
    ASSERT_EQ(pool.apply_async(first_int, t).get(), i);
  }
  EXPECT_EQ(pool.worker_pids().size(), 1u);
}

// file_system storages are not lent: a worker killed while holding a segment could not give
// back its count of holders, and the name would outlive every user until the parent exits.
TEST(Loans, ASegmentSentToAPoolThatIsTerminatedKeepsNoName) {
  set_sharing_strategy(SharingStrategy::file_system);
  std::optional<Tensor> t = Tensor::zeros({1024}, DType::f32);
  set_sharing_strategy(SharingStrategy::file_descriptor);
  std::string segment = t->storage()->name();
  {
    Pool pool({.processes = 1});
    EXPECT_EQ(pool.apply_async(same_tensor, *t).get().storage(), t->storage());
  }  // ~Pool terminates: the worker is killed
  t.reset();
  EXPECT_TRUE(eventually([&] { return !std::filesystem::exists("/dev/shm/" + segment); })) << segment << " kept its name";
}

TEST(Loans, AReplacementWorkerIsLentTheStorageAfresh) {
  Pool pool({.processes = 1});
  Tensor t = Tensor::zeros({1024}, DType::f32);
  pool.apply_async(storage_id_in_worker, t).get();
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

TEST(Loans, ManyTensorsInOneChunkAreEachLentOnce) {
  Pool pool({.processes = 1});
  std::vector<Tensor> tensors;
  for (int i = 0; i < 20; ++i) tensors.push_back(Tensor::zeros({16}, DType::f32));
  tensors.push_back(tensors[3]);  // the same storage twice in one message
  std::vector<Tensor> back = pool.map_async(same_tensor, tensors, 7).get();
  ASSERT_EQ(back.size(), tensors.size());
  for (std::size_t i = 0; i < back.size(); ++i) EXPECT_EQ(back[i].storage(), tensors[i].storage());
  EXPECT_EQ(tensor_mappings_of(pool.worker_pids().at(0)), 20);
}

// The protocol pieces on their own.

TEST(Loans, APeerIsHandedEachStorageOnceAndToldWhenItIsReleased) {
  auto peer = std::make_shared<PeerLoans>();
  int callbacks = 0;
  peer->on_release([&](PeerLoans&) { ++callbacks; });
  std::optional<Tensor> t = Tensor::zeros({4}, DType::f32);
  MessageLoan loan;
  std::uint64_t id = loan.lend(t->storage());
  loan.lend(t->storage());
  EXPECT_EQ(loan.storages().size(), 1u);
  PeerLoans::Handover first = peer->lend(loan);
  EXPECT_EQ(first.fds, std::vector<int>{t->storage()->fd()});
  EXPECT_EQ(first.new_ids, std::vector<std::uint64_t>{id});
  EXPECT_TRUE(peer->lend(loan).fds.empty());
  loan = MessageLoan();
  t.reset();
  EXPECT_EQ(callbacks, 1);
  EXPECT_EQ(peer->take_released(), std::vector<std::uint64_t>{id});
  EXPECT_TRUE(peer->take_released().empty());
}

TEST(Loans, AnUndeliveredLoanIsHandedOverAgain) {
  auto peer = std::make_shared<PeerLoans>();
  Tensor t = Tensor::zeros({4}, DType::f32);
  MessageLoan loan;
  loan.lend(t.storage());
  PeerLoans::Handover handover = peer->lend(loan);
  peer->unlend(handover.new_ids);
  EXPECT_EQ(peer->lend(loan).fds.size(), 1u);
}

TEST(Loans, ABorrowerRefusesIdsItWasNeverLent) {
  BorrowedStorages borrowed;
  std::vector<std::uint64_t> ids{42};
  EXPECT_THROW(borrowed.begin_message(ids, {}), ProtocolError);
  EXPECT_THROW(borrowed.release(ids), ProtocolError);
}

TEST(Loans, ALentTensorOutsideALendingConversationIsAProtocolError) {
  Tensor t = Tensor::zeros({4}, DType::f32);
  MessageLoan loan;
  Writer w(&loan);
  w.write(t);
  EXPECT_TRUE(w.fds().empty());  // lent: no descriptor in the message itself
  Reader plain(w.bytes());
  EXPECT_THROW(plain.read<Tensor>(), ProtocolError);
  MessageLoan other;
  Reader wrong_reply(w.bytes(), {}, &other);
  EXPECT_THROW(wrong_reply.read<Tensor>(), ProtocolError);
}

TEST(Loans, ABorrowerResolvesOnlyWhatTheCurrentMessageLends) {
  auto [lender, borrower] = Channel::make_pair();
  Tensor t = Tensor::zeros({4}, DType::f32);
  t.data<float>()[2] = 7;
  MessageLoan loan;
  Writer w(&loan);
  w.write(t);
  auto handover = std::make_shared<PeerLoans>()->lend(loan);
  lender.send(1, 1, w.bytes(), handover.fds);
  Message m = borrower.receive();

  BorrowedStorages borrowed;
  std::vector<std::uint64_t> ids{t.storage()->id()};
  EXPECT_EQ(borrowed.begin_message(ids, m.fds), 1u);
  Reader r(m.payload.bytes(), {}, &borrowed);
  Tensor received = r.read<Tensor>();
  EXPECT_EQ(received.data<float>()[2], 7);
  EXPECT_EQ(borrowed.lent_id_of(*received.storage()), t.storage()->id());

  // A reply names it by id, and only the lending message's loan resolves that id.
  Writer reply(&borrowed);
  reply.write(received);
  EXPECT_TRUE(reply.fds().empty());
  Reader back(reply.bytes(), {}, &loan);
  EXPECT_EQ(back.read<Tensor>().storage(), t.storage());

  // The next message lends nothing: the id no longer resolves.
  borrowed.begin_message({}, {});
  Reader stale(w.bytes(), {}, &borrowed);
  EXPECT_THROW(stale.read<Tensor>(), ProtocolError);
}

}  // namespace
}  // namespace forkpool
