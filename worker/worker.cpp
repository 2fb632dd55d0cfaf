#include <forkpool/worker/private/worker.hpp>

#include <dlfcn.h>
#include <malloc.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdio>
#include <exception>
#include <optional>
#include <string>
#include <tuple>

#include <forkpool/ipc/internal/channel.hpp>
#include <forkpool/ipc/private/link.hpp>
#include <forkpool/ipc/internal/mapping.hpp>
#include <forkpool/ipc/private/memfd.hpp>
#include <forkpool/shm/private/peer_memory.hpp>
#include <forkpool/worker/worker_info.hpp>
#include <forkpool/shm/sharing.hpp>
#include <forkpool/shm/internal/storage.hpp>
#include <forkpool/runtime/error.hpp>
#include <forkpool/runtime/private/describe_exception.hpp>
#include <forkpool/runtime/private/process.hpp>
#include <forkpool/worker/internal/protocol.hpp>
#include <forkpool/worker/private/task_end.hpp>
#include <forkpool/runtime/private/loaded_objects.hpp>

namespace forkpool::detail {
namespace {

// Sends the blocks and slabs let go of here, if any.
void send_release(WorkerLink& link, PeerMemory& memory) {
  if (PeerMemory::Release release = memory.take_release(); !release.empty())
    link.send(kReleaseMessage, 0, release.encode().bytes());
}

// Throws ProtocolError when the message's blocks are not valid: the conversation is broken. A
// task the parent withdrew (RunningSlot) is read and not run.
void serve_task(WorkerLink& link, Message& task, PeerMemory& memory, RunningSlot& running,
                const ObjectTranslation& objects, const WorkerSpec& spec) {
  // Taken up from here, unless withdrawn: a crash while decoding is this task's too, never the
  // next one's.
  running.element.store(0, std::memory_order_relaxed);
  // Before the claim, whose exchange publishes it: the parent reads it after it saw the claim.
  // (Release: a parent that reads a later id sees this job's claim settled.)
  running.request_id.store(task.request_id, std::memory_order_release);
  TaskCall call = read_task(task, memory);
  if (!running.take_up(task.request_id)) return;  // runs elsewhere, or nowhere: its blocks go home
  OutgoingBlocks reply;
  Writer out(&reply);
  out.buffer() = take_spare_buffer();
  if (spec.process_name.empty()) begin_pool_task();
  try {
    Reader arguments(call.elements, task.fds, &call.blocks);
    auto invoker = reinterpret_cast<Invoker>(objects.translate(reinterpret_cast<std::uintptr_t>(call.invoker)));
    invoker(objects.translate(call.function), call.range, arguments, out, running.element);
  } catch (...) {
    if (!spec.process_name.empty()) {
      // A Process: what escaped its function is its end, as in Python.
      auto [type, message] = describe_current_exception();
      std::fprintf(stderr, "forkpool: process %s (pid %d) raised %s: %s\n", spec.process_name.c_str(), getpid(),
                   type.c_str(), message.c_str());
      exit_helper(1);
    }
    call.blocks = IncomingBlocks({});
    end_pool_task();
    send_release(link, memory);
    link.send(kErrorMessage, task.request_id, encode_current_exception().bytes());
    return;
  }
  // The arguments are gone. The result's own holds go too, once its blocks are lent and its
  // table written: a block of ours stays lent to the parent, and a block of the parent's that it
  // returns is read there before this release. What only they held goes home with the result.
  call.blocks = IncomingBlocks({});
  end_pool_task();  // what codecs kept lets go of its blocks
  std::optional<PeerMemory::Introduction> introduction = memory.lend(reply);
  reply.write_table(out);
  reply.clear();
  append_release(out, memory.take_release());
  if (introduction) link.send(kSlabMessage, 0, introduction->payload.bytes(), introduction->fds);
  link.send(kResultMessage, task.request_id, out.bytes(), out.fds());
  give_back_buffer(std::move(out.buffer()));
}

bool is_loose(std::uint16_t kind) { return kind == kReleaseMessage; }

// A worker forked from a parent (or a fork server) that ran OpenMP's parallel regions (libtorch's
// ops, say) has the OpenMP runtime's team without its threads: libgomp's next parallel region
// on the forked thread waits for them for ever (pytorch#17199). Forked workers run OpenMP on one
// thread, as torch's DataLoader workers run libtorch; the initializer, run after, may choose
// more where the fork server started clean (init() first). The runtime's own call, found where
// the program loaded it: a program without OpenMP has none to make.
void one_openmp_thread() noexcept {
  using SetThreads = void (*)(int);
  if (auto set_threads = reinterpret_cast<SetThreads>(dlsym(RTLD_DEFAULT, "omp_set_num_threads"))) set_threads(1);
}

// The parent's first message: who this worker is (worker_info()), the slot it reports its
// running task in, and its link's rings and eventfds.
struct Hello {
  Mapping slot;
  std::optional<WorkerLink> link;
};

void receive_hello(Channel& channel, Hello& hello) {
  Message message = channel.receive();
  if (message.kind != kHelloMessage || message.fds.size() != 4)
    throw ProtocolError("forkpool: the parent's first message is not a hello with four descriptors");
  HelloMessage said = decode_hello(message.payload.bytes());
  set_worker_info({said.worker_id, said.workers, getpid(), said.seed});
  set_starting_parent(said.parent);
  set_sharing_strategy(said.sharing);  // the parent's, as a forked worker would have it
  check_sealed_memfd(message.fds[0].get(), kRunningSlotBytes, "forkpool: running slot");
  hello.slot = Mapping::map(message.fds[0].get(), kRunningSlotBytes, PROT_READ | PROT_WRITE);
  hello.link.emplace(channel, map_link_rings(message.fds[1].get()), std::move(message.fds[2]),
                     std::move(message.fds[3]), said.spin, &is_loose);
}

}  // namespace

void worker_main(const WorkerSpec& spec, WorkerStart start, int index, pid_t parent, UniqueFd channel_fd,
                 ObjectTranslation objects) noexcept {
  std::string name = spec.process_name.empty() ? "forkpool-worker-" + std::to_string(index) : spec.process_name;
  int fd = become_helper_process(name, parent, channel_fd.release());
  Channel channel{UniqueFd(fd)};
  Storage::forget_inherited();
  // A worker allocates and frees a chunk's buffers (often 64 KiB – 1 MiB) per task. glibc would
  // give the top of the heap back after each (brk, with a TLB shootdown on every core) and fault
  // it in again for the next: keep it. The worker is our process; the initializer, run after,
  // may still choose otherwise.
  mallopt(M_TRIM_THRESHOLD, 256 << 20);
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  int served = 0;
  auto memory = std::make_shared<PeerMemory>();  // shared memory between the parent and us
  try {
    Hello hello;
    receive_hello(channel, hello);
    WorkerLink& link = *hello.link;
    auto& running = *reinterpret_cast<RunningSlot*>(hello.slot.data());
    if (start == WorkerStart::forked) one_openmp_thread();
    if (spec.initializer) {
      try {
        spec.initializer();
      } catch (...) {
        // The parent reports it (InitializerError) and decides whether to start another.
        link.send(kErrorMessage, 0, encode_current_exception().bytes());
        exit_helper(kExitInitializerFailed);
      }
    }
    // From here on nothing can be the initializer's: what a task sends cannot pose as its error.
    link.send(kReadyMessage, 0, {});
    for (;;) {
      // What was let go of since (a release of ours freed a slab, say) goes home before we wait.
      send_release(link, *memory);
      Message message = link.receive();
      if (message.kind == kLoadObjectMessage) {
        objects.load(decode_object(message.payload.bytes()));
        continue;
      }
      if (message.kind == kSlabMessage) {
        memory->accept_introduction(message.payload.bytes(), message.fds);
        continue;
      }
      if (message.kind == kReleaseMessage) {
        memory->accept_release(message.payload.bytes());
        continue;
      }
      if (message.kind != kTaskMessage)
        throw ProtocolError("forkpool: the parent sent a message of unknown kind " + std::to_string(message.kind));
      // Everything the task made is destroyed before the next one starts.
      // A task withdrawn counts too: the parent counted it when it sent it.
      serve_task(link, message, *memory, running, objects, spec);
      if (spec.maxtasksperchild > 0 && ++served >= spec.maxtasksperchild) break;
    }
  } catch (const ChannelClosed&) {
    // The pool closed our channel: done.
  } catch (const std::exception& e) {
    std::fprintf(stderr, "forkpool: worker %d: %s\n", index, e.what());
    exit_helper(kExitBadMessage);
  }
  exit_helper(0);
}

}  // namespace forkpool::detail
