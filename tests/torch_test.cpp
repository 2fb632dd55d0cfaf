// forkpool-torch: libtorch tensors crossing to real workers as shared memory.

#include <gtest/gtest.h>
// The parts of <torch/torch.h> used here: it compiles in a third of the time.
#include <ATen/ATen.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <limits>
#include <memory>
#include <random>
#include <optional>
#include <numeric>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <forkpool/forkpool.hpp>
#include <forkpool/torch.hpp>
#include <forkpool/ipc/internal/channel.hpp>
#include <forkpool/shm/internal/block_table.hpp>
#include <forkpool/shm/private/peer_memory.hpp>
#include <forkpool/shm/tensor_codec.hpp>

#include "support.hpp"

namespace forkpool {
namespace {

using namespace std::chrono_literals;
namespace fpt = forkpool::torch;

at::Tensor fill_with_sevens(at::Tensor t) {
  t.fill_(7);
  return t;
}

// The message of the `E` that `call` throws; "no error" when it throws none.
template <class E = Error, class F>
std::string what_it_throws(F call) {
  try {
    call();
  } catch (const E& e) {
    return e.what();
  }
  return "no error";
}

TEST(TorchTest, ASharedTensorCrossesBothWaysWithoutACopy) {
  Pool pool({.processes = 1});
  at::Tensor t = fpt::zeros({64, 64});
  EXPECT_TRUE(fpt::is_shared(t));
  at::Tensor back = pool.apply_async(fill_with_sevens, t).get();
  EXPECT_EQ(t.sum().item<float>(), 7.0f * 64 * 64);  // the worker wrote our memory
  EXPECT_TRUE(fpt::is_shared(back));
  EXPECT_EQ(back.data_ptr(), t.data_ptr());  // and its result is the same memory again
}

at::Tensor make_a_view() {
  at::Tensor base = fpt::empty({4, 6}, at::kDouble);
  for (int i = 0; i < 24; ++i) base.view({-1})[i] = i;
  return base.t().slice(0, 1, 4);  // non-contiguous, with a storage offset
}

TEST(TorchTest, AWorkersResultArrivesWithDtypeShapeStridesAndOffsetIntact) {
  Pool pool({.processes = 1});
  at::Tensor got = pool.apply_async(make_a_view).get();
  at::Tensor expected = ::torch::arange(24, at::kDouble).view({4, 6}).t().slice(0, 1, 4);
  EXPECT_TRUE(fpt::is_shared(got));
  EXPECT_EQ(got.scalar_type(), at::kDouble);
  EXPECT_EQ(got.sizes(), expected.sizes());
  EXPECT_EQ(got.strides(), expected.strides());
  EXPECT_EQ(got.storage_offset(), expected.storage_offset());
  EXPECT_TRUE(::torch::equal(got, expected));
}

double sum_and_scribble(at::Tensor t) {
  double sum = t.sum().item<double>();
  t.fill_(-1);
  return sum;
}

TEST(TorchTest, AnOrdinaryTensorIsCopiedOnceAndTheWorkerWritesTheCopy) {
  Pool pool({.processes = 1});
  at::Tensor ordinary = ::torch::ones({10});
  EXPECT_FALSE(fpt::is_shared(ordinary));
  EXPECT_EQ(pool.apply_async(sum_and_scribble, ordinary).get(), 10.0);
  EXPECT_EQ(ordinary.sum().item<float>(), 10.0f);
}

TEST(TorchTest, ShareMemoryMovesTheStorageInPlaceForEveryTensorOnIt) {
  at::Tensor t = ::torch::arange(12, at::kFloat);
  at::Tensor view = t.view({3, 4});
  fpt::share_memory(t);
  EXPECT_TRUE(fpt::is_shared(t));
  EXPECT_TRUE(fpt::is_shared(view));
  EXPECT_EQ(view[2][3].item<float>(), 11.0f);
  Pool pool({.processes = 1});
  pool.apply_async(fill_with_sevens, view).get();
  EXPECT_EQ(t[0].item<float>(), 7.0f);
  // As torch's share_memory_(): shared storage cannot grow (a grown one would leave shared memory
  // for memory of its own, unseen by the workers).
  EXPECT_THROW(t.resize_({1000}), c10::Error);
  EXPECT_TRUE(fpt::is_shared(t));
}

at::Tensor identity(at::Tensor t) { return t; }

// As torch::empty: a memory format lays the block out its way, and the layout crosses.
TEST(TorchTest, SharedTensorsTakeTheMemoryFormatTheyAreMadeWith) {
  auto channels_last = at::TensorOptions().memory_format(at::MemoryFormat::ChannelsLast);
  at::Tensor image = fpt::zeros({2, 3, 4, 5}, channels_last);
  EXPECT_EQ(image.strides(), ::torch::empty({2, 3, 4, 5}, channels_last).strides());
  EXPECT_TRUE(image.is_contiguous(at::MemoryFormat::ChannelsLast));
  EXPECT_EQ(image.sum().item<float>(), 0.0f);
  auto volume = at::TensorOptions().dtype(at::kDouble).memory_format(at::MemoryFormat::ChannelsLast3d);
  EXPECT_TRUE(fpt::empty({1, 2, 3, 4, 5}, volume).is_contiguous(at::MemoryFormat::ChannelsLast3d));
  Pool pool({.processes = 1});
  at::Tensor back = pool.apply_async(identity, image).get(20s);
  EXPECT_EQ(back.strides(), image.strides());
  EXPECT_EQ(back.data_ptr(), image.data_ptr());

  EXPECT_NE(what_it_throws([&] {
              fpt::empty({3, 4, 5}, channels_last);
            }).find("channels_last needs 4"),
            std::string::npos);
  EXPECT_NE(what_it_throws([] { fpt::empty({3}, at::TensorOptions().layout(at::kSparse)); }).find("sparse"),
            std::string::npos);
}

std::vector<at::Tensor> add_one_to_each(std::vector<at::Tensor> tensors) {
  ::torch::NoGradGuard no_grad;
  for (at::Tensor& t : tensors) t.add_(1);
  return {};
}

// As torch's Module.share_memory(): every parameter and buffer, submodules' too, moves; what a
// worker does to them the module sees.
TEST(TorchTest, SharingAModuleSharesEveryParameterAndBufferInPlace) {
  ::torch::nn::Sequential model(::torch::nn::Linear(4, 3), ::torch::nn::BatchNorm1d(3),
                                ::torch::nn::Linear(::torch::nn::LinearOptions(3, 2).bias(false)));
  ASSERT_EQ(model->buffers().size(), 3u);  // the batch norm's running mean, variance and count
  std::vector<at::Tensor> before;
  for (const at::Tensor& t : model->parameters()) before.push_back(t.detach().clone());
  for (const at::Tensor& t : model->buffers()) before.push_back(t.clone());
  fpt::share_memory(*model);
  std::vector<at::Tensor> tensors;
  for (const at::Tensor& t : model->parameters()) tensors.push_back(t.detach());
  for (const at::Tensor& t : model->buffers()) tensors.push_back(t);
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    EXPECT_TRUE(fpt::is_shared(tensors[i])) << i;
    EXPECT_TRUE(::torch::equal(tensors[i], before[i])) << i;
  }
  Pool pool({.processes = 1});
  pool.apply_async(add_one_to_each, tensors).get(20s);
  std::size_t i = 0;
  for (const at::Tensor& t : model->parameters()) EXPECT_TRUE(::torch::equal(t.detach(), before[i++] + 1));
  for (const at::Tensor& t : model->buffers()) EXPECT_TRUE(::torch::equal(t, before[i++] + 1));
}

int threads_after_a_parallel_sum() {
  (void)::torch::ones({1 << 22}).sum().item<float>();  // ATen's parallel_for over 4M elements
  return at::get_num_threads();
}

void two_threads() { at::set_num_threads(2); }

// libgomp keeps the parent's OpenMP team across a fork without its threads: a forked worker's
// first parallel op waited for them for ever (pytorch#17199). Forked workers run libtorch on one
// thread, as torch's DataLoader workers; an initializer runs after and may choose more where the
// fork server started clean (main's init(), as here).
TEST(TorchTest, AForkedWorkerRunsParallelOpsAfterTheParentRanThem) {
  int before = at::get_num_threads();
  at::set_num_threads(2);  // (one core's VM defaults to 1: make the parent's team)
  EXPECT_EQ(threads_after_a_parallel_sum(), 2);
  for (StartMethod method : {StartMethod::fork, StartMethod::forkserver}) {
    SCOPED_TRACE(static_cast<int>(method));
    Pool pool({.processes = 1, .start_method = method});
    AsyncResult<int> threads = pool.apply_async(threads_after_a_parallel_sum);
    ASSERT_TRUE(threads.wait(20s)) << "the worker's parallel sum never finished";
    EXPECT_EQ(threads.get(), 1);
  }
  Pool chosen({.processes = 1, .initializer = two_threads, .start_method = StartMethod::forkserver});
  EXPECT_EQ(chosen.apply_async(threads_after_a_parallel_sum).get(20s), 2);
  at::set_num_threads(before);
}

// As torch.multiprocessing, which moves the storage: an ordinary tensor whose elements are dense
// keeps its strides (a transpose, channels_last); one that is not (a slice) arrives dense, in
// its memory format.
TEST(TorchTest, AnOrdinaryTensorArrivesLaidOutAsItWas) {
  Pool pool({.processes = 1});
  at::Tensor values = ::torch::arange(120, at::kFloat).view({2, 3, 4, 5});
  at::Tensor image = values.contiguous(at::MemoryFormat::ChannelsLast);
  at::Tensor slice = image.slice(1, 0, 2);
  for (const at::Tensor& sent : {values.view({6, 20}).t(), image, values.permute({3, 1, 0, 2}), slice}) {
    ASSERT_FALSE(fpt::is_shared(sent));
    at::Tensor back = pool.apply_async(identity, sent).get(20s);
    EXPECT_TRUE(::torch::equal(back, sent));
    if (sent.is_non_overlapping_and_dense())
      EXPECT_EQ(back.strides(), sent.strides());
    else
      EXPECT_EQ(back.strides(), sent.contiguous(sent.suggest_memory_format()).strides());
  }
  EXPECT_TRUE(pool.apply_async(identity, slice).get(20s).is_contiguous(at::MemoryFormat::ChannelsLast));
}

TEST(TorchTest, WhatCannotCrossIsAnErrorBeforeAnythingIsSent) {
  Pool pool({.processes = 1});
  // Refused at the call, before a task exists: nothing is sent.
  auto refused = [&](const at::Tensor& t) { return what_it_throws([&] { (void)pool.apply_async(identity, t); }); };
  EXPECT_NE(refused(::torch::ones({2, 2}).to_sparse()).find("sparse"), std::string::npos);
  EXPECT_NE(refused(at::quantize_per_tensor(::torch::ones({2}), 0.1, 0, at::kQInt8)).find("quantized"),
            std::string::npos);
  at::Tensor leaf = ::torch::ones({2}, ::torch::requires_grad());
  EXPECT_NE(refused(leaf * 2).find("requires grad"), std::string::npos);
  // What a tensor is beyond its memory and view: values read through a negation or conjugation
  // bit, names, nested tensors, and zero tensors with no memory. Each is refused, shared or not
  // (torch.multiprocessing refuses names; the bits it would lose).
  at::Tensor shared = fpt::zeros({2, 3});
  EXPECT_NE(refused(shared._neg_view()).find("negative view"), std::string::npos);
  EXPECT_NE(refused(::torch::ones({2})._neg_view()).find("negative view"), std::string::npos);
  at::Tensor complex = fpt::zeros({2, 3}, at::kComplexFloat);
  EXPECT_NE(refused(complex.conj()).find("conjugate view"), std::string::npos);
  EXPECT_NE(refused(::torch::ones({2}, at::kComplexDouble).conj()).find("conjugate view"), std::string::npos);
  EXPECT_EQ(refused(complex.conj().resolve_conj()), "no error");
  EXPECT_NE(refused(complex.as_strided({1, 2}, {std::numeric_limits<std::int64_t>::max() / 2 + 1, 1})).find("64 bits"),
            std::string::npos);
  std::vector<at::Dimname> names{at::Dimname::fromSymbol(at::Symbol::dimname("rows")),
                                 at::Dimname::fromSymbol(at::Symbol::dimname("columns"))};
  EXPECT_NE(refused(shared.rename(names)).find("named"), std::string::npos);
  EXPECT_NE(refused(at::_nested_tensor_from_tensor_list({::torch::ones({2}), ::torch::ones({3})})).find("nested"),
            std::string::npos);
  EXPECT_NE(refused(at::_efficientzerotensor({4})).find("zero tensor"), std::string::npos);
  at::Tensor back = pool.apply_async(identity, leaf).get(20s);  // a leaf crosses with its flag
  EXPECT_TRUE(back.requires_grad());
}

// Whether `a` and `b` hold the same values (complex ones compared by their parts: libtorch 1.13
// has no equal() for complex halves).
bool same_values(const at::Tensor& a, const at::Tensor& b) {
  if (!a.is_complex()) return ::torch::equal(a, b);
  return b.is_complex() && ::torch::equal(at::view_as_real(a).to(at::kDouble), at::view_as_real(b).to(at::kDouble));
}

// 24 values of `dtype`, shaped {2, 3, 4} (complex ones with imaginary parts that differ from
// their real parts).
at::Tensor values_of(at::ScalarType dtype) {
  at::Tensor reals = ::torch::arange(24).remainder(dtype == at::kBool ? 2 : 100).view({2, 3, 4});
  if (!at::isComplexType(dtype)) return reals.to(dtype);
  at::Tensor parts = reals.to(at::kFloat);
  return at::complex(parts, parts * -2 + 1).to(dtype);
}

// Every dtype libtorch and DLPack share, shared and ordinary, to a worker and back: complex ones
// too, which forkpool has no DType for (they cross as their real and imaginary parts).
TEST(TorchTest, EveryDtypeRoundTripsWithItsValues) {
  Pool pool({.processes = 1});
  for (at::ScalarType dtype :
       {at::kByte, at::kChar, at::kShort, at::kInt, at::kLong, at::kHalf, at::kBFloat16, at::kFloat, at::kDouble,
        at::kBool, at::kComplexHalf, at::kComplexFloat, at::kComplexDouble}) {
    SCOPED_TRACE(c10::toString(dtype));
    at::Tensor values = values_of(dtype);
    at::Tensor shared = fpt::empty({2, 3, 4}, at::TensorOptions().dtype(dtype));
    EXPECT_TRUE(fpt::is_shared(shared));
    shared.copy_(values);
    for (const at::Tensor& sent : {shared, values}) {
      at::Tensor back = pool.apply_async(identity, sent).get(20s);
      EXPECT_EQ(back.scalar_type(), dtype);
      EXPECT_EQ(back.sizes(), values.sizes());
      EXPECT_EQ(back.strides(), values.strides());
      EXPECT_TRUE(same_values(back, values));
    }
  }
}

at::Tensor conjugate_in_place(at::Tensor t) { return t.conj_physical_(); }

// A complex tensor is two parts an element, as at::view_as_real lays them out: its views cross
// as views of the same memory, a worker's writes reach the caller, and as a forkpool::Tensor
// it is its parts (forkpool has no complex DType).
TEST(TorchTest, ComplexTensorsCrossAsTheSameMemoryViewedAsTheyWere) {
  Pool pool({.processes = 1});
  at::Tensor base = fpt::empty({6, 8}, at::kComplexFloat);
  base.copy_(at::complex(::torch::arange(48, at::kFloat), ::torch::arange(48, at::kFloat) * 3).view({6, 8}));
  for (const at::Tensor& sent : {base.slice(1, 2, 7), base.t(), base.as_strided({3, 2}, {1, 16}, 5), base[2][3]}) {
    at::Tensor back = pool.apply_async(identity, sent).get(20s);
    EXPECT_EQ(back.scalar_type(), at::kComplexFloat);
    EXPECT_EQ(back.sizes(), sent.sizes());
    EXPECT_EQ(back.strides(), sent.strides());
    EXPECT_EQ(back.storage_offset(), sent.storage_offset());
    EXPECT_EQ(back.data_ptr(), sent.data_ptr());
    EXPECT_TRUE(same_values(back, sent));
  }
  at::Tensor expected = base.conj().resolve_conj();
  pool.apply_async(conjugate_in_place, base.t()).get(20s);  // the worker writes our memory
  EXPECT_TRUE(same_values(base, expected));

  // Made in a memory format, it keeps it; moved into shared memory in place, it is shared.
  at::Tensor image = fpt::zeros(
      {2, 3, 4, 5}, at::TensorOptions().dtype(at::kComplexDouble).memory_format(at::MemoryFormat::ChannelsLast));
  EXPECT_TRUE(pool.apply_async(identity, image).get(20s).is_contiguous(at::MemoryFormat::ChannelsLast));
  at::Tensor ordinary = at::complex(::torch::ones({3}), ::torch::zeros({3}));
  fpt::share_memory(ordinary);
  EXPECT_TRUE(fpt::is_shared(ordinary));
  EXPECT_EQ(pool.apply_async(identity, ordinary).get(20s).data_ptr(), ordinary.data_ptr());
  at::Tensor leaf = fpt::zeros({2}, at::TensorOptions().dtype(at::kComplexFloat).requires_grad(true));
  EXPECT_TRUE(pool.apply_async(identity, leaf).get(20s).requires_grad());  // complex ones may require grad

  at::Tensor batch = fpt::collate({base[0], base[1]});  // a DataLoader's batch of complex samples
  EXPECT_TRUE(fpt::is_shared(batch));
  EXPECT_TRUE(same_values(batch, base.slice(0, 0, 2)));

  EXPECT_NE(what_it_throws([&] { (void)fpt::to_forkpool(base); }).find("view_as_real"), std::string::npos);
  Tensor parts = fpt::to_forkpool(at::view_as_real(base));
  EXPECT_EQ(parts.dtype(), DType::f32);
  EXPECT_EQ(parts.data<float>()[2 * 9 + 1], -27.0f);  // element [1][1]'s imaginary part, conjugated
}

// A message that says its tensor is complex must carry its parts as parts_of writes them: a last
// dimension of 2 parts with stride 1, of a dtype with a complex counterpart; and a flag byte that
// names nothing else.
TEST(TorchTest, AComplexTensorMessageWhosePartsAreNotLaidOutAsPartsIsAProtocolError) {
  auto decoded = [](const Tensor& view, std::uint8_t flags) {
    auto [a, b] = detail::Channel::make_pair();
    Writer w = encode(view);
    w.write(flags);
    a.send(1, 1, w.bytes(), w.fds());
    detail::Message m = b.receive();
    Reader r = m.reader();
    return what_it_throws<ProtocolError>([&] { (void)r.read<at::Tensor>(); });
  };
  constexpr std::uint8_t kComplex = 2;
  Tensor floats = Tensor::zeros({4, 6}, DType::f32);
  EXPECT_EQ(decoded(floats.view({4, 3, 2}), kComplex), "no error");
  EXPECT_EQ(decoded(floats.view({4, 3, 2}), 0), "no error");  // the same parts, as floats
  const char* misread = "not two of a floating dtype";
  auto viewed = [&](std::int64_t byte_offset, std::vector<std::int64_t> shape, std::vector<std::int64_t> strides) {
    return Tensor::from_storage(floats.storage(), byte_offset, std::move(shape), std::move(strides), DType::f32);
  };
  EXPECT_NE(decoded(floats, kComplex).find(misread), std::string::npos);                     // 6 in the last dimension
  EXPECT_NE(decoded(viewed(0, {3, 2}, {2, 6}), kComplex).find(misread), std::string::npos);  // parts 6 apart
  EXPECT_NE(decoded(viewed(0, {3, 2}, {3, 1}), kComplex).find(misread), std::string::npos);  // elements 1.5 apart
  EXPECT_NE(decoded(viewed(4, {11, 2}, {2, 1}), kComplex).find("whole element of 8 bytes"),  // from an imaginary part
            std::string::npos);
  EXPECT_NE(decoded(Tensor::zeros({3, 2}, DType::bf16), kComplex).find(misread), std::string::npos);
  EXPECT_NE(decoded(Tensor::zeros({3, 2}, DType::i32), kComplex).find(misread), std::string::npos);
  EXPECT_NE(decoded(floats, 4).find("name nothing"), std::string::npos);
}

// Views keep their shape, strides and offset; empty and 0-dim tensors cross too; a shared
// tensor comes back as the same memory.
TEST(TorchTest, ViewsEmptyAndZeroDimTensorsRoundTripAsTheSameMemory) {
  Pool pool({.processes = 1});
  at::Tensor base = fpt::empty({6, 8}, at::kFloat);
  base.copy_(::torch::arange(48, at::kFloat).view({6, 8}));
  at::Tensor empty = fpt::empty({0, 3}, at::kFloat);
  at::Tensor scalar = fpt::empty({}, at::kDouble).fill_(2.5);
  for (const at::Tensor& sent : {base.slice(1, 2, 7), base.t(), base.as_strided({3, 2}, {1, 16}, 5), empty, scalar}) {
    at::Tensor back = pool.apply_async(identity, sent).get();
    EXPECT_EQ(back.sizes(), sent.sizes());
    EXPECT_EQ(back.strides(), sent.strides());
    EXPECT_EQ(back.storage_offset(), sent.storage_offset());
    EXPECT_TRUE(::torch::equal(back, sent));
    if (sent.numel() > 0) {
      EXPECT_EQ(back.data_ptr(), sent.data_ptr());
    }
  }
}

// A forkpool view may start inside an element (its offset counts bytes); a torch one cannot
// (its offset counts elements). Such a view is an error, from_forkpool's or the decoder's, and
// never a tensor shifted to the element before.
TEST(TorchTest, AViewStartingInsideAnElementIsAnErrorAndNeverAShiftedTensor) {
  Tensor bytes = Tensor::empty({16}, DType::u8);
  Tensor inside = Tensor::from_storage(bytes.storage(), 2, {2}, {1}, DType::f32);
  EXPECT_NE(what_it_throws([&] { (void)fpt::from_forkpool(inside); }).find("not at a whole element of 4 bytes"),
            std::string::npos);
  EXPECT_EQ(fpt::from_forkpool(Tensor::from_storage(bytes.storage(), 4, {2}, {1}, DType::f32)).storage_offset(), 1);

  // The same view in a message, as a torch::Tensor's bytes: the forkpool view, then its
  // requires_grad flag.
  auto [a, b] = detail::Channel::make_pair();
  Writer w = encode(inside);
  w.write(std::uint8_t{0});
  a.send(1, 1, w.bytes(), w.fds());
  detail::Message m = b.receive();
  Reader r = m.reader();
  // (its offset counts from the start of the block's slab, which crosses whole)
  EXPECT_NE(
      what_it_throws<ProtocolError>([&] { (void)r.read<at::Tensor>(); }).find("not at a whole element of 4 bytes"),
      std::string::npos);
}

// The last byte a decoded tensor reaches, read (ASan, or the mapping's end, would catch a tensor
// that reaches past its memory).
void touch_the_last_byte(const at::Tensor& t) {
  if (t.numel() == 0) return;
  std::int64_t last = t.storage_offset();
  for (std::int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
  auto* bytes = static_cast<const volatile std::byte*>(t.storage().data());
  (void)bytes[(last + 1) * static_cast<std::int64_t>(t.element_size()) - 1];
}

// Every decoder is fuzzed, but libFuzzer's compiler (clang 14) cannot build libtorch 1.13's
// headers as C++20, so codec<at::Tensor> meets mangled messages here (and under ASan in CI):
// real messages of both storage kinds (a memfd, and blocks of a peer's slab with their table),
// with bytes changed, boundary values written over their fields, and their ends cut. Each either
// decodes into a tensor within its memory or is a ProtocolError, and no descriptor is kept.
TEST(TorchTest, MangledTensorMessagesDecodeWithinTheirMemoryOrAreProtocolErrors) {
  at::Tensor base = fpt::empty({6, 8}, at::kFloat);
  at::Tensor leaf = fpt::zeros({3}, at::TensorOptions().dtype(at::kDouble).requires_grad(true));
  std::vector<at::Tensor> seeds{base,
                                base.t().slice(0, 2, 5),
                                base.as_strided({3, 2}, {1, 16}, 5),
                                fpt::empty({}, at::kLong),
                                fpt::empty({0, 3}, at::kHalf),
                                fpt::empty({3, 4}, at::kComplexFloat).t(),
                                leaf};
  // A peer (the worker's side of the conversation) lends the blocks; we map its slab.
  auto worker = std::make_shared<detail::PeerMemory>();
  auto parent = std::make_shared<detail::PeerMemory>();
  struct Seed {
    std::vector<std::byte> bytes;
    bool tabled;  // blocks and their table; else a memfd
  };
  std::vector<Seed> messages;
  for (const at::Tensor& t : seeds) {
    Writer plain = encode(t);
    ASSERT_EQ(plain.fds().size(), 1u);
    messages.push_back({{plain.bytes().begin(), plain.bytes().end()}, false});
    detail::OutgoingBlocks blocks;
    Writer tabled(&blocks);
    tabled.write(t);
    if (auto introduction = worker->lend(blocks)) {
      std::vector<UniqueFd> fds;
      for (int fd : introduction->fds) fds.emplace_back(dup(fd));
      parent->accept_introduction(introduction->payload.bytes(), fds);
    }
    blocks.write_table(tabled);
    messages.push_back({{tabled.bytes().begin(), tabled.bytes().end()}, true});
  }
  UniqueFd memfd(dup(encode(base).fds()[0]));

  int fds_before = test_support::open_fd_count();
  std::mt19937_64 random(24);
  const std::int64_t boundaries[] = {
      0, 1, -1, 2, 3, 7, 1 << 20, std::numeric_limits<std::int64_t>::max(), std::numeric_limits<std::int64_t>::min()};
  int decoded = 0, refused = 0;
  for (int i = 0; i < 30000; ++i) {
    const Seed& seed = messages[random() % messages.size()];
    std::vector<std::byte> bytes = seed.bytes;
    switch (random() % 4) {
      case 0:  // a few bytes changed
        for (int n = 1 + random() % 3; n > 0; --n) bytes[random() % bytes.size()] = std::byte(random());
        break;
      case 1: {  // a boundary value over a field
        std::int64_t value = boundaries[random() % std::size(boundaries)];
        std::size_t width = std::size_t{1} << (random() % 4);
        std::size_t at = random() % (bytes.size() - width + 1);
        std::memcpy(bytes.data() + at, &value, width);
        break;
      }
      case 2: bytes.resize(random() % bytes.size()); break;  // cut short
      default: bytes.insert(bytes.begin() + random() % bytes.size(), std::byte(random()));
    }
    try {
      if (seed.tabled) {
        detail::TabledPayload payload = detail::split_block_table(bytes);
        detail::IncomingBlocks blocks = parent->accept_blocks(payload.table);
        Reader r(payload.body, {}, &blocks);
        touch_the_last_byte(r.read<at::Tensor>());
        r.expect_end();
      } else {
        std::vector<UniqueFd> fds;
        fds.emplace_back(dup(memfd.get()));
        Reader r(bytes, fds);
        touch_the_last_byte(r.read<at::Tensor>());
        r.expect_end();
      }
      ++decoded;
    } catch (const ProtocolError&) {
      ++refused;
    }
    (void)parent->take_release();  // what was let go would go back to the peer
  }
  EXPECT_EQ(decoded + refused, 30000);
  EXPECT_GT(refused, 1000);  // the mangling reached the checks
  EXPECT_GT(decoded, 1000);  // and left many messages whole enough to decode
  EXPECT_EQ(test_support::open_fd_count(), fds_before);
}

// As torch.multiprocessing's shared_cache: a block that comes back to this process while a
// tensor made here over it lives arrives on that tensor's torch storage.
TEST(TorchTest, ATensorThatComesBackIsOnTheStorageItLeft) {
  Pool pool({.processes = 1});
  at::Tensor t = fpt::zeros({16});
  at::Tensor back = pool.apply_async(identity, t.slice(0, 4, 12)).get();
  EXPECT_EQ(back.storage().unsafeGetStorageImpl(), t.storage().unsafeGetStorageImpl());
  EXPECT_EQ(back.storage_offset(), 4);
  Tensor forkpool_side = fpt::to_forkpool(t);
  EXPECT_EQ(fpt::from_forkpool(forkpool_side).storage().unsafeGetStorageImpl(), t.storage().unsafeGetStorageImpl());
  at::Tensor ordinary = ::torch::arange(4, at::kFloat);
  fpt::share_memory(ordinary);
  at::Tensor ordinary_back = pool.apply_async(identity, ordinary).get();
  EXPECT_EQ(ordinary_back.storage().unsafeGetStorageImpl(), ordinary.storage().unsafeGetStorageImpl());
  // Once no tensor uses that storage, the next one over the block gets a storage of its own.
  Tensor kept = fpt::to_forkpool(back);
  t = at::Tensor();
  back = at::Tensor();
  at::Tensor again = fpt::from_forkpool(kept);
  EXPECT_TRUE(fpt::is_shared(again));
  EXPECT_EQ(again.numel(), 8);
}

// What a worker sees of its argument, beside a tensor it makes itself: whether the two have the
// same dispatch keys, and the argument is an inference tensor.
std::vector<bool> keys_beside_a_new_tensor(at::Tensor t) {
  return {t.key_set() == at::empty({1}).key_set(), t.is_inference()};
}

// forkpool builds a tensor's TensorImpl with its dispatch keys given, not worked out: they must be
// the keys libtorch gives any new CPU tensor in the InferenceMode that is on, so that autograd,
// in-place versions and inference tensors behave as on a tensor at::empty made.
TEST(TorchTest, ATensorMadeOrDecodedHereHasTheKeysOfANewTensorInEitherInferenceMode) {
  Pool pool({.processes = 1});
  for (bool inference : {false, true}) {
    SCOPED_TRACE(inference ? "in InferenceMode" : "outside InferenceMode");
    c10::InferenceMode mode(inference);
    c10::DispatchKeySet new_keys = at::empty({1}).key_set();
    at::Tensor made = fpt::zeros({8});
    at::Tensor back = pool.apply_async(identity, made).get(20s);
    at::Tensor other = fpt::from_forkpool(Tensor::zeros({8}, DType::f32));
    for (const at::Tensor& t : {made, back, other}) {
      EXPECT_EQ(t.key_set(), new_keys);
      EXPECT_EQ(t.is_inference(), inference);
    }
    if (!inference) {
      EXPECT_EQ(back._version(), 0u);  // a version counter of its own, as a new tensor's
      back.add_(1);
      EXPECT_EQ(back._version(), 1u);
      at::Tensor weights = ::torch::ones({8}, ::torch::requires_grad());
      (weights * back).sum().backward();  // autograd sees a tensor it knows
      EXPECT_TRUE(weights.grad().equal(back));
    }
  }
  // A worker's argument, decoded outside InferenceMode there, beside the worker's own tensor.
  EXPECT_EQ(pool.apply_async(keys_beside_a_new_tensor, fpt::zeros({8})).get(20s), (std::vector<bool>{true, false}));
}

int a_number() { return 42; }

// The parent makes its next TensorImpl while its loop waits for a worker, with the view the last
// decode set and the keys of the waiting thread's InferenceMode. Each tensor given one must still
// arrive with its own view and dtype, and the keys of a new tensor in its own mode.
TEST(TorchTest, ATensorImplMadeWhileTheLoopWaitedArrivesAsNewWhateverItsViewOrMode) {
  Pool pool({.processes = 1});
  at::Tensor longs = fpt::empty({10}, at::kLong);
  for (int i = 0; i < 10; ++i) longs[i] = i;
  // The same view twice (the second on a spare made with it), then others.
  for (auto [from, to] : std::vector<std::pair<std::int64_t, std::int64_t>>{{3, 7}, {3, 7}, {5, 9}, {0, 10}, {9, 10}}) {
    SCOPED_TRACE("elements " + std::to_string(from) + " to " + std::to_string(to));
    at::Tensor back = pool.apply_async(identity, longs.slice(0, from, to)).get(20s);
    EXPECT_EQ(back.storage_offset(), from);
    EXPECT_EQ(back.sizes(), at::IntArrayRef({to - from}));
    EXPECT_TRUE(back.equal(longs.slice(0, from, to)));
    EXPECT_EQ(back._version(), 0u);
  }
  at::Tensor transposed = fpt::zeros({3, 4}, at::kDouble).t();
  at::Tensor back = pool.apply_async(identity, transposed).get(20s);
  EXPECT_EQ(back.scalar_type(), at::kDouble);
  EXPECT_EQ(back.strides(), transposed.strides());
  EXPECT_FALSE(back.is_contiguous());

  // A spare made while the loop waited in InferenceMode (for a result without a tensor) has an
  // inference tensor's keys: a tensor made outside the mode is not given it, nor the reverse.
  c10::DispatchKeySet outside_keys = at::empty({1}).key_set(), inside_keys;
  {
    c10::InferenceMode mode;
    inside_keys = at::empty({1}).key_set();
    EXPECT_EQ(pool.apply_async(a_number).get(20s), 42);
  }
  at::Tensor outside = fpt::from_forkpool(Tensor::zeros({8}, DType::f32));
  EXPECT_EQ(outside.key_set(), outside_keys);
  EXPECT_FALSE(outside.is_inference());
  outside.add_(1);
  EXPECT_EQ(outside._version(), 1u);
  EXPECT_EQ(pool.apply_async(a_number).get(20s), 42);
  c10::InferenceMode mode;
  at::Tensor inside = fpt::from_forkpool(Tensor::zeros({8}, DType::f32));
  EXPECT_EQ(inside.key_set(), inside_keys);
  EXPECT_TRUE(inside.is_inference());
}

// Loops on two threads, one in InferenceMode, make and take the parent's spare TensorImpl at
// once (TSan runs this): each tensor arrives whole, with its own thread's keys.
TEST(TorchTest, PoolsOnTwoThreadsDecodeTensorsAtOnce) {
  std::vector<std::thread> threads;
  for (int thread = 0; thread < 2; ++thread)
    threads.emplace_back([inference = thread == 1] {
      try {  // (an exception escaping a thread would end the whole suite)
        Pool pool({.processes = 1});
        c10::InferenceMode mode(inference);
        for (int i = 0; i < 200; ++i) {
          at::Tensor sent = fpt::zeros({1 + i % 3 + (inference ? 4 : 0)});
          sent.fill_(i);
          at::Tensor back = pool.apply_async(identity, sent).get(20s);
          EXPECT_TRUE(back.equal(sent));
          EXPECT_EQ(back.is_inference(), inference);
        }
      } catch (const std::exception& e) {
        ADD_FAILURE() << e.what();
      }
    });
  for (std::thread& thread : threads) thread.join();
}

// A torch storage made here is named in its block (a weak handle) and holds the block: the
// block must still go back when the last tensor goes, the handle notwithstanding.
TEST(TorchTest, ABlockGoesBackWhenTheLastTorchTensorOverItGoes) {
  Pool pool({.processes = 1});
  std::size_t before = shared_memory_stats().in_use_bytes;
  {
    at::Tensor t = fpt::zeros({1 << 16});
    at::Tensor view = t.slice(0, 8, 64);
    at::Tensor back = pool.apply_async(identity, view).get(10s);
    EXPECT_EQ(back.storage().unsafeGetStorageImpl(), t.storage().unsafeGetStorageImpl());
    EXPECT_GE(shared_memory_stats().in_use_bytes, before + (1 << 18));
  }
  EXPECT_EQ(shared_memory_stats().in_use_bytes, before);
}

at::Tensor write_threes_then_die(at::Tensor t) {
  t.fill_(3);
  std::_Exit(9);
}

// A worker killed while it holds the caller's torch tensor: its writes stay (the memory is
// shared), the pool goes on with the same tensor, and the block still goes back at the end.
TEST(TorchTest, AWorkerThatDiesHoldingATensorLeavesItWholeAndItsBlockStillGoesBack) {
  Pool pool({.processes = 1});
  std::size_t before = shared_memory_stats().in_use_bytes;
  {
    at::Tensor t = fpt::zeros({1 << 12});
    EXPECT_THROW(pool.apply_async(write_threes_then_die, t).get(30s), WorkerLost);
    EXPECT_EQ(t.sum().item<float>(), 3.0f * (1 << 12));
    at::Tensor back = pool.apply_async(fill_with_sevens, t).get(30s);
    EXPECT_EQ(back.storage().unsafeGetStorageImpl(), t.storage().unsafeGetStorageImpl());
    EXPECT_EQ(t.sum().item<float>(), 7.0f * (1 << 12));
  }
  EXPECT_EQ(shared_memory_stats().in_use_bytes, before);
}

at::Tensor a_new_tensor(int index) { return fpt::empty({16}).fill_(index); }

// Each result is a block of a recycled slab, not a descriptor of its own.
TEST(TorchTest, TwentyThousandTensorsFromWorkersKeptByTheParentHoldUnder64Descriptors) {
  int before = test_support::open_fd_count();
  Pool pool({.processes = 2});
  std::vector<int> indices(20'000);
  std::iota(indices.begin(), indices.end(), 0);
  std::vector<at::Tensor> kept = pool.map_async(a_new_tensor, indices).get();
  EXPECT_LT(test_support::open_fd_count() - before, 64);
  for (int i = 0; i < 20'000; i += 997) EXPECT_EQ(kept[i][15].item<float>(), static_cast<float>(i));
}

// Each worker runs one task and is replaced: the tensors it made stay valid in the parent after
// it is gone (the parent maps its slabs), and the parent lets go of that memory when they go.
TEST(TorchTest, TensorsAWorkerMadeOutliveTheWorker) {
  std::size_t mapped_before = shared_memory_stats().mapped_bytes;
  std::vector<at::Tensor> kept;
  {
    Pool pool({.processes = 1, .maxtasksperchild = 1});
    std::vector<int> indices(12);
    std::iota(indices.begin(), indices.end(), 0);
    kept = pool.map_async(a_new_tensor, indices, 1).get(60s);
  }
  ASSERT_EQ(kept.size(), 12u);
  for (int i = 0; i < 12; ++i) {
    EXPECT_TRUE(fpt::is_shared(kept[i]));
    EXPECT_EQ(kept[i].sum().item<float>(), 16.0f * i) << "tensor " << i;
  }
  EXPECT_GT(shared_memory_stats().mapped_bytes, mapped_before);
  kept.clear();
  EXPECT_EQ(shared_memory_stats().mapped_bytes, mapped_before);
}

void produce(Queue<at::Tensor> q) {
  for (int i = 0; i < 3; ++i) q.put(fpt::zeros({8}).fill_(i));
}

TEST(TorchTest, TensorsCrossAQueueFromAnotherProcess) {
  Queue<at::Tensor> q;
  Process p = start_process(produce, q);
  for (int i = 0; i < 3; ++i) {
    std::optional<at::Tensor> got = q.get(30s);  // a producer that never puts fails, not hangs
    ASSERT_TRUE(got) << "tensor " << i << " did not arrive";
    at::Tensor t = *got;
    EXPECT_TRUE(fpt::is_shared(t));
    EXPECT_EQ(t.sum().item<float>(), 8.0f * i);
  }
  EXPECT_TRUE(p.join(10s));
}

struct Rows {
  std::size_t size() const { return 6; }
  at::Tensor get(std::size_t index) const { return ::torch::full({3}, static_cast<double>(index), at::kFloat); }
};

TEST(TorchTest, ADataLoaderOfTorchSamplesStacksThemIntoSharedBatches) {
  DataLoader loader(Rows{}, {.batch_size = 4}, &fpt::collate);
  std::vector<at::Tensor> batches;
  for (at::Tensor& batch : loader) batches.push_back(batch);
  ASSERT_EQ(batches.size(), 2u);
  EXPECT_TRUE(fpt::is_shared(batches[0]));
  EXPECT_EQ(batches[0].sizes(), (std::vector<std::int64_t>{4, 3}));
  EXPECT_EQ(batches[1].sizes(), (std::vector<std::int64_t>{2, 3}));
  EXPECT_EQ(batches[1][1][2].item<float>(), 5.0f);
}

struct LabelledRows {
  std::size_t size() const { return 6; }
  std::pair<at::Tensor, std::int64_t> get(std::size_t index) const {
    return {::torch::full({2, 3}, static_cast<double>(index), at::kFloat), static_cast<std::int64_t>(10 + index)};
  }
};
struct Measurements {
  std::size_t size() const { return 5; }
  std::tuple<double, at::Tensor, bool> get(std::size_t index) const {
    return {0.5 * static_cast<double>(index), ::torch::arange(4, at::kInt) + static_cast<int>(index), index % 2 == 1};
  }
};

// As torch's default_collate takes (image, label) samples: one shared batch tensor per field.
TEST(TorchTest, ADataLoaderOfPairsOrTuplesCollatesEachFieldIntoASharedBatch) {
  DataLoader labelled(LabelledRows{}, {.batch_size = 4, .timeout = 20s},
                      &fpt::collate_fields<std::pair<at::Tensor, std::int64_t>>);
  std::vector<std::pair<at::Tensor, at::Tensor>> batches;
  for (auto& [images, labels] : labelled) batches.emplace_back(images, labels);
  ASSERT_EQ(batches.size(), 2u);
  auto& [images, labels] = batches[1];
  EXPECT_TRUE(fpt::is_shared(images) && fpt::is_shared(labels));
  EXPECT_EQ(images.sizes(), (std::vector<std::int64_t>{2, 2, 3}));
  EXPECT_EQ(images[1][1][2].item<float>(), 5.0f);
  EXPECT_EQ(labels.scalar_type(), at::kLong);
  EXPECT_TRUE(::torch::equal(labels, ::torch::tensor({14, 15}, at::kLong)));

  DataLoader measured(Measurements{}, {.batch_size = 5, .timeout = 20s},
                      &fpt::collate_fields<std::tuple<double, at::Tensor, bool>>);
  for (auto& [scale, values, odd] : measured) {
    EXPECT_TRUE(::torch::equal(scale, ::torch::tensor({0.0, 0.5, 1.0, 1.5, 2.0}, at::kDouble)));
    EXPECT_TRUE(::torch::equal(values[4], ::torch::arange(4, at::kInt) + 4));
    EXPECT_TRUE(::torch::equal(odd, ::torch::tensor({false, true, false, true, false})));
  }
}

// Issue 58.12: with no collate given, a DataLoader of libtorch samples collates as torch's
// default_collate does (it gave a std::vector): tensors stacked, pairs and tuples field by field.
TEST(TorchTest, ADataLoaderWithoutACollateStacksTensorsAndCollatesPairsAndTuplesByField) {
  DataLoader rows(Rows{}, {.batch_size = 4, .timeout = 20s});
  std::vector<at::Tensor> stacked;
  for (at::Tensor& batch : rows) stacked.push_back(batch);
  ASSERT_EQ(stacked.size(), 2u);
  EXPECT_EQ(stacked[0].sizes(), (std::vector<std::int64_t>{4, 3}));
  EXPECT_EQ(stacked[1][1][2].item<float>(), 5.0f);

  DataLoader labelled(LabelledRows{}, {.batch_size = 4, .num_workers = 2, .timeout = 20s});
  std::vector<std::pair<at::Tensor, at::Tensor>> batches;
  for (auto& [images, labels] : labelled) batches.emplace_back(images, labels);
  ASSERT_EQ(batches.size(), 2u);
  EXPECT_EQ(batches[1].first.sizes(), (std::vector<std::int64_t>{2, 2, 3}));
  EXPECT_TRUE(::torch::equal(batches[1].second, ::torch::tensor({14, 15}, at::kLong)));
  EXPECT_TRUE(fpt::is_shared(batches[0].first));

  DataLoader measured(Measurements{}, {.batch_size = 5, .timeout = 20s});
  for (auto& [scale, values, odd] : measured) {
    EXPECT_TRUE(::torch::equal(scale, ::torch::tensor({0.0, 0.5, 1.0, 1.5, 2.0}, at::kDouble)));
    EXPECT_EQ(values.sizes(), (std::vector<std::int64_t>{5, 4}));
    EXPECT_TRUE(::torch::equal(odd, ::torch::tensor({false, true, false, true, false})));
  }
}

at::Tensor a_batch(int index) {
  at::Tensor t = fpt::empty({4096});
  t.fill_(index);
  return t;
}

// libtorch tensors over forkpool blocks, dropped on other threads while the pool works: each
// deleter gives its block back from its own thread (CI runs this file under TSan).
TEST(TorchTest, TensorsFromWorkersMayBeDroppedOnOtherThreadsWhileThePoolWorks) {
  Pool pool({.processes = 2});
  std::vector<int> indices(400);
  std::iota(indices.begin(), indices.end(), 0);
  std::vector<at::Tensor> batches = pool.map_async(a_batch, indices).get();
  std::vector<std::thread> droppers;
  for (std::size_t first = 0; first < 2; ++first)
    droppers.emplace_back([&batches, first] {
      for (std::size_t i = first; i < batches.size(); i += 2) {
        EXPECT_EQ(batches[i][0].item<float>(), static_cast<float>(i));
        batches[i] = at::Tensor();
      }
    });
  std::vector<at::Tensor> more = pool.map_async(a_batch, indices).get();  // meanwhile
  for (std::thread& dropper : droppers) dropper.join();
  for (std::size_t i = 0; i < more.size(); ++i) EXPECT_EQ(more[i][4095].item<float>(), static_cast<float>(i));
}

// What a worker's task sees of its tensor argument, as numbers: where its TensorImpl is, its
// version, whether it requires grad, its dtype, offset and element count, and its sum. The task
// then writes it in place, so its version moves.
std::vector<std::int64_t> look_then_add_one(at::Tensor t) {
  std::vector<std::int64_t> seen{reinterpret_cast<std::int64_t>(t.unsafeGetTensorImpl()),
                                 t._version(),
                                 t.requires_grad(),
                                 static_cast<std::int64_t>(t.scalar_type()),
                                 t.storage_offset(),
                                 t.numel(),
                                 static_cast<std::int64_t>(t.sum().item<double>())};
  at::NoGradGuard no_grad;  // (in place on a leaf that requires grad)
  t.add_(1);
  return seen;
}

// In the worker: takes the memory a TensorImpl just freed would be (malloc hands out what was
// freed last first), so a TensorImpl made after is elsewhere, and only a kept one is where it was.
std::vector<std::unique_ptr<char[]>> taken;
int take_freed_memory() {
  for (int i = 0; i < 8; ++i) taken.push_back(std::make_unique<char[]>(sizeof(c10::TensorImpl)));
  return 0;
}

std::vector<at::Tensor> kept_by_tasks;  // in the worker: tensors a task kept past its end
std::int64_t keep_it(at::Tensor t) {
  kept_by_tasks.push_back(t);
  return reinterpret_cast<std::int64_t>(t.unsafeGetTensorImpl());
}
double sum_of_kept() {
  double sum = 0;
  for (const at::Tensor& t : kept_by_tasks) sum += t.sum().item<double>();
  return sum;
}

// A worker keeps the libtorch objects its tasks decoded and reuses them for the next task's
// tensors (a TensorImpl and a storage made and destroyed per task were most of a torch::Tensor
// trip's cost over a forkpool::Tensor one). Each reused tensor must be as a new one would be,
// and the reuse must neither hold the caller's block nor touch a tensor the task kept.
TEST(TorchTest, AWorkerReusesItsTensorsFromTaskToTaskAndEachArrivesAsNew) {
  Pool pool({.processes = 1});
  std::size_t before = shared_memory_stats().in_use_bytes;
  std::int64_t first_impl = 0;
  {
    at::Tensor floats = fpt::zeros({1 << 16});
    std::vector<std::int64_t> seen = pool.apply_async(look_then_add_one, floats).get(20s);
    first_impl = seen[0];
    EXPECT_EQ(seen[1], 0);
    EXPECT_EQ(floats.sum().item<float>(), 1 << 16);  // the worker wrote our memory
  }
  // The caller's block went home with the result, though the worker keeps the tensor's objects.
  EXPECT_EQ(shared_memory_stats().in_use_bytes, before);

  // Another dtype, a view with an offset, another block: the same TensorImpl, as new.
  pool.apply_async(take_freed_memory).get(20s);
  at::Tensor longs = fpt::empty({10}, at::kLong);
  for (int i = 0; i < 10; ++i) longs[i] = i;
  std::vector<std::int64_t> seen = pool.apply_async(look_then_add_one, longs.slice(0, 3, 7)).get(20s);
  EXPECT_EQ(seen[0], first_impl);
  EXPECT_EQ(seen[1], 0) << "a reused tensor's version starts again, as a new one's";
  EXPECT_EQ(seen[2], 0);
  EXPECT_EQ(seen[3], static_cast<std::int64_t>(at::kLong));
  EXPECT_EQ(seen[4], 3);
  EXPECT_EQ(seen[5], 4);
  EXPECT_EQ(seen[6], 3 + 4 + 5 + 6);
  EXPECT_EQ(longs[3].item<std::int64_t>(), 4);
  // The same shape and strides at another offset (the reuse keeps a view it has already), then
  // the same view again: each at its own offset, with its own values.
  for (std::int64_t sum : {6 + 7 + 7 + 8, 7 + 8 + 8 + 9}) {
    seen = pool.apply_async(look_then_add_one, longs.slice(0, 5, 9)).get(20s);
    EXPECT_EQ(seen[0], first_impl);
    EXPECT_EQ(seen[4], 5);
    EXPECT_EQ(seen[5], 4);
    EXPECT_EQ(seen[6], sum);
  }

  // One that requires grad arrives so; the next, which does not, arrives without.
  at::Tensor leaf = fpt::zeros({4}, at::TensorOptions().dtype(at::kDouble).requires_grad(true));
  EXPECT_EQ(pool.apply_async(look_then_add_one, leaf).get(20s)[2], 1);
  seen = pool.apply_async(look_then_add_one, fpt::zeros({6}, at::kDouble)).get(20s);
  EXPECT_EQ(seen[2], 0);
  EXPECT_EQ(seen[5], 6);

  // Within one task (a chunk of three), each element reuses the one before it, which the task
  // let go of: a long task holds no more blocks it dropped than the worker keeps.
  std::vector<at::Tensor> three{fpt::zeros({2}), fpt::zeros({3}), fpt::zeros({4})};
  std::vector<std::vector<std::int64_t>> looks = pool.map_async(look_then_add_one, three, 3).get(20s);
  for (const std::vector<std::int64_t>& look : looks) EXPECT_EQ(look[0], looks[0][0]);
  EXPECT_EQ(looks[2][5], 4);

  // A tensor the task keeps is the task's: the next tensor is another, and the kept one keeps
  // its memory and values.
  at::Tensor nines = fpt::empty({5}).fill_(9);
  std::int64_t kept_impl = pool.apply_async(keep_it, nines).get(20s);
  at::Tensor twos = fpt::empty({3}).fill_(2);
  seen = pool.apply_async(look_then_add_one, twos).get(20s);
  EXPECT_NE(seen[0], kept_impl);
  EXPECT_EQ(seen[6], 6);
  EXPECT_EQ(pool.apply_async(sum_of_kept).get(20s), 45.0);
}

}  // namespace
}  // namespace forkpool
