// The shared-memory rings and the link over them, between real processes: order across the
// ring and the socket, a full ring, what a hostile or killed peer leaves, and sleeping peers.

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <forkpool/ipc/private/link.hpp>
#include <forkpool/ipc/private/memfd.hpp>
#include <forkpool/ipc/private/ring.hpp>
#include <forkpool/runtime/error.hpp>
#include <forkpool/runtime/private/process.hpp>
#include <forkpool/runtime/loop.hpp>
#include <forkpool/runtime/when_all.hpp>
#include "support.hpp"

namespace forkpool::detail {
namespace {

constexpr std::size_t kSmallRing = 4096;

// Two directions of `capacity` bytes in one anonymous shared mapping (inherited by fork()).
struct SharedRings {
  explicit SharedRings(std::size_t capacity = kSmallRing) : capacity(capacity) {
    size = 2 * ring_region_size(capacity);
    void* at = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (at == MAP_FAILED) std::abort();
    region = static_cast<std::byte*>(at);
  }
  ~SharedRings() { munmap(region, size); }
  RingView view(int index) const { return ring_in_region(region, capacity, index); }
  std::byte* region;
  std::size_t size;
  std::size_t capacity;
};

// Entry i's payload: (i * 37) % max bytes, each the low byte of i + its position.
std::vector<std::byte> payload_of(std::uint64_t i, std::size_t max) {
  std::vector<std::byte> bytes((i * 37) % max);
  for (std::size_t k = 0; k < bytes.size(); ++k) bytes[k] = static_cast<std::byte>((i + k) & 0xff);
  return bytes;
}

bool holds_payload_of(std::span<const std::byte> got, std::uint64_t i, std::size_t max) {
  std::vector<std::byte> want = payload_of(i, max);
  return got.size() == want.size() && std::equal(got.begin(), got.end(), want.begin());
}

TEST(Ring, TenThousandEntriesOfMixedSizesKeepTheirOrderAndBytesAcrossWraps) {
  SharedRings rings;
  RingProducer producer(rings.view(0));
  RingConsumer consumer(rings.view(0));
  const std::size_t max = ring_payload_max(kSmallRing);
  std::uint64_t pushed = 0, popped = 0;
  while (popped < 10'000) {
    // Fill to the brim, then drain a part: every wrap position gets exercised.
    while (pushed < 10'000) {
      std::vector<std::byte> payload = payload_of(pushed, max);
      if (!producer.try_push(static_cast<std::uint16_t>(1 + pushed % 5), pushed, payload)) break;
      ++pushed;
    }
    for (int k = 0; k < 3; ++k) {
      std::optional<RingRecord> record = consumer.peek();
      if (!record) break;
      ASSERT_EQ(record->request_id, popped);
      ASSERT_EQ(record->kind, 1 + popped % 5);
      ASSERT_TRUE(holds_payload_of(record->payload, popped, max)) << "entry " << popped;
      consumer.pop();
      ++popped;
    }
  }
  EXPECT_FALSE(consumer.peek());
}

TEST(Ring, AFullRingRefusesAnEntryAndTakesItOnceTheConsumerMakesRoom) {
  SharedRings rings;
  RingProducer producer(rings.view(0));
  RingConsumer consumer(rings.view(0));
  std::vector<std::byte> payload(500, std::byte{7});
  int accepted = 0;
  while (producer.try_push(1, accepted, payload)) ++accepted;
  EXPECT_GT(accepted, 0);
  EXPECT_LT(accepted * 500, static_cast<int>(kSmallRing));
  EXPECT_FALSE(producer.has_room(payload.size()));
  ASSERT_TRUE(consumer.peek());
  consumer.pop();
  EXPECT_TRUE(producer.try_push(1, accepted, payload));
  for (int i = 1; i <= accepted; ++i) {
    std::optional<RingRecord> record = consumer.peek();
    ASSERT_TRUE(record);
    EXPECT_EQ(record->request_id, static_cast<std::uint64_t>(i));
    consumer.pop();
  }
  EXPECT_FALSE(consumer.peek());
}

TEST(Ring, WrittenEntriesShowOnlyOnceTheProducerPublishesThem) {
  SharedRings rings;
  RingProducer producer(rings.view(0));
  RingConsumer consumer(rings.view(0));
  std::vector<std::byte> payload(40, std::byte{3});
  for (std::uint64_t i = 0; i < 5; ++i) ASSERT_TRUE(producer.try_write(1, i, payload));
  EXPECT_FALSE(consumer.ready());
  EXPECT_FALSE(consumer.peek());
  EXPECT_TRUE(producer.publish());
  EXPECT_FALSE(producer.publish());  // nothing new
  for (std::uint64_t i = 0; i < 5; ++i) {
    std::optional<RingRecord> record = consumer.peek();
    ASSERT_TRUE(record);
    EXPECT_EQ(record->request_id, i);
    consumer.pop();
  }
  EXPECT_FALSE(consumer.peek());
  // A published push shows what was written before it too, in order.
  ASSERT_TRUE(producer.try_write(1, 5, payload));
  ASSERT_TRUE(producer.try_push(1, 6, payload));
  EXPECT_EQ(consumer.peek()->request_id, 5u);
  consumer.pop();
  EXPECT_EQ(consumer.peek()->request_id, 6u);
}

TEST(Ring, RoomConsumedLaterShowsAtPublishOrOnceAQuarterOfTheRingIsHeldBack) {
  SharedRings rings;
  RingProducer producer(rings.view(0));
  RingConsumer consumer(rings.view(0));
  std::vector<std::byte> payload(200, std::byte{5});
  int accepted = 0;
  while (producer.try_push(1, accepted, payload)) ++accepted;
  ASSERT_GT(accepted, 8);
  // One entry consumed, its room held back: the producer still sees a full ring.
  ASSERT_TRUE(consumer.peek());
  EXPECT_FALSE(consumer.pop_later());
  EXPECT_FALSE(producer.has_room(payload.size()));
  EXPECT_TRUE(consumer.publish_room());
  EXPECT_TRUE(producer.has_room(payload.size()));
  EXPECT_FALSE(consumer.publish_room());  // nothing new
  // Without publish_room(), a quarter of the ring held back is published by pop_later itself.
  ASSERT_TRUE(producer.try_push(1, accepted, payload));
  std::size_t held = 0;
  bool published = false;
  while (!published) {
    ASSERT_TRUE(consumer.peek());
    published = consumer.pop_later();
    held += 256;  // the entry: a 32-byte header and 200 bytes, padded to 32
    ASSERT_LE(held, kSmallRing / 4 + 256) << "room held back past a quarter of the ring";
  }
  EXPECT_GE(held, kSmallRing / 4);
  EXPECT_TRUE(producer.has_room(payload.size()));
}

TEST(Ring, WhatAPeerScribblesIsAProtocolErrorNeverAReadOutsideTheRing) {
  auto broken_reader = [](auto scribble) {
    SharedRings rings;
    RingProducer producer(rings.view(0));
    std::vector<std::byte> payload(40, std::byte{1});
    for (int i = 0; i < 3; ++i) producer.try_push(1, i, payload);
    scribble(rings.view(0));
    RingConsumer consumer(rings.view(0));
    for (int i = 0; i < 4; ++i) {
      std::optional<RingRecord> record = consumer.peek();  // throws once it reaches the damage
      if (!record) return false;
      consumer.pop();
    }
    return false;
  };
  auto entry_at = [](const RingView& view, std::size_t offset) {
    return reinterpret_cast<RingEntry*>(view.entries + offset);
  };
  EXPECT_THROW(broken_reader([](RingView v) { v.control->head.store(7); }), ProtocolError);  // not aligned
  EXPECT_THROW(broken_reader([](RingView v) { v.control->head.store(kSmallRing * 3); }),
               ProtocolError);                                                                    // past the ring
  EXPECT_THROW(broken_reader([&](RingView v) { entry_at(v, 0)->sequence = 9; }), ProtocolError);  // a stale entry
  EXPECT_THROW(broken_reader([&](RingView v) { entry_at(v, 0)->size = 1u << 30; }), ProtocolError);
  EXPECT_THROW(broken_reader([&](RingView v) { entry_at(v, 0)->size = 0; }), ProtocolError);  // no progress
  EXPECT_THROW(broken_reader([&](RingView v) { entry_at(v, 0)->payload_size = 4000; }), ProtocolError);
  EXPECT_THROW(broken_reader([&](RingView v) { entry_at(v, 0)->kind = kRingWrap; }), ProtocolError);  // a wrap mid-ring
  // The producer checks the consumer's position too, when it reads it (once the room it knows of
  // runs short).
  SharedRings rings;
  RingProducer producer(rings.view(0));
  std::vector<std::byte> payload(40);
  ASSERT_TRUE(producer.try_push(1, 0, payload));
  rings.view(0).control->tail.store(1u << 20);  // past what was written
  EXPECT_THROW(for (int i = 1; i < 1000; ++i) producer.try_push(1, i, payload), ProtocolError);
}

TEST(Ring, AProducerKilledInTheMiddleOfWritingLeavesOnlyWholeEntries) {
  SharedRings rings(kLinkRingCapacity);
  const std::size_t max = 3000;
  pid_t writer = fork();
  if (writer == 0) {
    RingProducer producer(rings.view(0));
    for (std::uint64_t i = 0;; ++i) {
      std::vector<std::byte> payload = payload_of(i, max);
      while (!producer.try_push(1, i, payload)) cpu_relax();
    }
  }
  RingConsumer consumer(rings.view(0));
  std::uint64_t next = 0;
  auto read_some = [&](int count) {
    for (int k = 0; k < count; ++k) {
      std::optional<RingRecord> record = consumer.peek();
      if (!record) return;
      ASSERT_EQ(record->request_id, next);
      ASSERT_TRUE(holds_payload_of(record->payload, next, max)) << "entry " << next;
      consumer.pop();
      ++next;
    }
  };
  auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(200);
  while (std::chrono::steady_clock::now() < until) read_some(50);
  kill(writer, SIGKILL);  // wherever it is in an entry
  waitpid(writer, nullptr, 0);
  for (;;) {
    std::uint64_t before = next;
    read_some(1000);
    if (next == before) break;
  }
  EXPECT_GT(next, 100u);
  EXPECT_FALSE(consumer.peek());  // a half-written entry was never published
}

// ---- the link: a forked child is the worker's end ----

bool is_release(std::uint16_t kind) { return kind == 9; }

struct LinkPair {
  LinkResources resources;
  Mapping rings;
  LinkPair() : resources(LinkResources::create()), rings(map_link_rings(resources.rings.get())) {}
};

// What the worker's end sends for message i: small ones in the ring, every 7th with a descriptor
// and every 13th too large for the ring (both on the socket, announced by a marker).
void send_message(WorkerLink& link, std::uint64_t i) {
  std::vector<std::byte> payload = payload_of(i, 300);
  if (i % 13 == 0) payload.resize(ring_payload_max(kLinkRingCapacity) + 100, std::byte{42});
  if (i % 7 == 0) {
    UniqueFd memfd = create_memfd("link-test", 64);
    int fd = memfd.get();
    link.send(static_cast<std::uint16_t>(1 + i % 3), i, payload, std::span(&fd, 1));
  } else {
    link.send(static_cast<std::uint16_t>(1 + i % 3), i, payload);
  }
}

void check_message(const Message& m, std::uint64_t i) {
  ASSERT_EQ(m.request_id, i);
  ASSERT_EQ(m.kind, 1 + i % 3);
  EXPECT_EQ(m.fds.size(), i % 7 == 0 ? 1u : 0u) << "message " << i;
  if (i % 13 == 0)
    EXPECT_EQ(m.payload.bytes().size(), ring_payload_max(kLinkRingCapacity) + 100);
  else
    EXPECT_TRUE(holds_payload_of(m.payload.bytes(), i, 300)) << "message " << i;
}

// Forks the worker's end running `body`; returns its pid. The parent keeps its ends.
template <class Body>
pid_t start_worker_end(LinkPair& pair, Channel& theirs, std::optional<std::chrono::nanoseconds> spin, Body body) {
  pid_t pid = fork();
  if (pid == 0) {
    alarm(30);
    int status = 0;
    try {
      WorkerLink link(theirs, map_link_rings(pair.resources.rings.get()),
                      duplicate_fd(pair.resources.worker_wake.get()), duplicate_fd(pair.resources.parent_wake.get()),
                      spin, &is_release);
      body(link);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "worker end: %s\n", e.what());
      status = 1;
    }
    _exit(status);
  }
  return pid;
}

// Ends the link's watch_wakes() when the conversation ends, also by an exception.
struct StopOnExit {
  std::stop_source& stop;
  ~StopOnExit() { stop.request_stop(); }
};

// As the pool does: the worker's end exiting (here: failing, or killed by its alarm) ends the
// link, so a conversation waiting for it fails with ChannelClosed instead of waiting for ever.
Task<void> end_link_when_gone(pid_t pid, ParentLink& link, std::stop_token stop) {
  UniqueFd pidfd = open_pidfd(pid);
  int result = co_await wait_process_exit(pidfd.get(), {.stop = stop});
  if (result >= 0) link.peer_gone();
}

Task<std::optional<Message>> next_message(ParentLink& link) {
  for (;;) {
    std::optional<Message> m = link.try_receive();
    if (m) co_return m;
    co_await link.arrival();
  }
}

class LinkTest : public ::testing::TestWithParam<int> {
 protected:
  // Param 0: adaptive spinning; 1: spin = 0 (every wait sleeps: the wake-up path).
  std::optional<std::chrono::nanoseconds> spin() const {
    return GetParam() == 1 ? std::optional(std::chrono::nanoseconds{0}) : std::nullopt;
  }
};

TEST_P(LinkTest, TenThousandMixedMessagesKeepTheirOrderBothWays) {
  constexpr std::uint64_t kCount = 10'000;
  LinkPair pair;
  auto [ours, theirs] = Channel::make_pair();
  pid_t worker = start_worker_end(pair, theirs, spin(), [](WorkerLink& link) {
    for (std::uint64_t i = 0; i < kCount; ++i) send_message(link, i);
    // Then the other way: what the parent sends arrives in order, a release whenever.
    for (std::uint64_t i = 0; i < kCount;) {
      Message m = link.receive();
      if (is_release(m.kind)) continue;
      if (m.request_id != i || m.kind != 1 + i % 3 || m.fds.size() != (i % 7 == 0 ? 1u : 0u)) {
        std::fprintf(stderr, "message %llu arrived as %llu\n", static_cast<unsigned long long>(i),
                     static_cast<unsigned long long>(m.request_id));
        _exit(2);
      }
      ++i;
    }
    link.send(5, kCount, {});
  });
  ParentLink link(ours, std::move(pair.rings), duplicate_fd(pair.resources.parent_wake.get()),
                  duplicate_fd(pair.resources.worker_wake.get()), spin());
  link.set_expecting(true);
  std::stop_source stop;
  auto converse = [&]() -> Task<void> {
    StopOnExit guard{stop};
    for (std::uint64_t i = 0; i < kCount; ++i) check_message(*co_await next_message(link), i);
    UniqueFd memfd = create_memfd("link-test", 64);
    int fd = memfd.get();
    for (std::uint64_t i = 0; i < kCount; ++i) {
      std::vector<std::byte> payload = payload_of(i, 300);
      if (i % 13 == 0) payload.resize(ring_payload_max(kLinkRingCapacity) + 100);
      if (i % 11 == 0) link.try_send_now(9, 0, payload_of(i, 50));  // releases go any time
      co_await link.async_send(static_cast<std::uint16_t>(1 + i % 3), i, payload,
                               i % 7 == 0 ? std::span<const int>(&fd, 1) : std::span<const int>());
    }
    std::optional<Message> done = co_await next_message(link);
    EXPECT_EQ(done->kind, 5);
  };
  try {
    run(when_all(converse(), link.watch_wakes(stop.get_token()), end_link_when_gone(worker, link, stop.get_token())));
  } catch (const std::exception& e) {
    ADD_FAILURE() << e.what();
    kill(worker, SIGKILL);
  }
  int status = 0;
  waitpid(worker, &status, 0);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
}

TEST_P(LinkTest, AWriterFacingAFullRingSleepsAndLosesNothing) {
  constexpr std::uint64_t kCount = 2'000;  // of ~16 KiB: many times the ring
  LinkPair pair;
  auto [ours, theirs] = Channel::make_pair();
  pid_t worker = start_worker_end(pair, theirs, spin(), [](WorkerLink& link) {
    for (std::uint64_t i = 0; i < kCount; ++i) {
      std::vector<std::byte> payload = payload_of(i, 16'000);
      link.send(1, i, payload);
    }
  });
  ParentLink link(ours, std::move(pair.rings), duplicate_fd(pair.resources.parent_wake.get()),
                  duplicate_fd(pair.resources.worker_wake.get()), spin());
  // The writer fills the ring within milliseconds, then waits: 400 ms of it cost little CPU.
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  std::chrono::milliseconds before = test_support::cpu_time_of(worker);
  std::this_thread::sleep_for(std::chrono::milliseconds(400));
  EXPECT_LT(test_support::cpu_time_of(worker) - before, test_support::scaled(std::chrono::milliseconds(40)));
  std::stop_source stop;
  auto drain = [&]() -> Task<void> {
    StopOnExit guard{stop};
    for (std::uint64_t i = 0; i < kCount; ++i) {
      std::optional<Message> m = co_await next_message(link);
      EXPECT_EQ(m->request_id, i);
      EXPECT_TRUE(holds_payload_of(m->payload.bytes(), i, 16'000)) << "message " << i;
    }
  };
  run(when_all(drain(), link.watch_wakes(stop.get_token()), end_link_when_gone(worker, link, stop.get_token())));
  int status = 0;
  waitpid(worker, &status, 0);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
}

TEST_P(LinkTest, AWorkerEndThatDiesIsReadToTheEndThenClosed) {
  LinkPair pair;
  auto [ours, theirs] = Channel::make_pair();
  pid_t worker = start_worker_end(pair, theirs, spin(), [](WorkerLink& link) {
    for (std::uint64_t i = 0; i < 100; ++i) send_message(link, i);
    raise(SIGKILL);
  });
  ParentLink link(ours, std::move(pair.rings), duplicate_fd(pair.resources.parent_wake.get()),
                  duplicate_fd(pair.resources.worker_wake.get()), spin());
  waitpid(worker, nullptr, 0);
  link.peer_gone();
  for (std::uint64_t i = 0; i < 100; ++i) {
    std::optional<Message> m = link.try_receive();
    ASSERT_TRUE(m) << "message " << i;
    check_message(*m, i);
  }
  EXPECT_THROW(link.try_receive(), ChannelClosed);
}

INSTANTIATE_TEST_SUITE_P(Spin, LinkTest, ::testing::Values(0, 1),
                         [](const auto& info) { return info.param == 0 ? "adaptive" : "never"; });

}  // namespace
}  // namespace forkpool::detail
