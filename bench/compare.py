"""Prints the figures and ratios the issues name, from one run of bench/run_all.sh."""
import json
import os
import re
import sys

out = sys.argv[1]


def load(name):
    path = os.path.join(out, name + ".json")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        benchmarks = json.load(f)["benchmarks"]
    # Repeated benchmarks are reported by their median, under the benchmark's own name.
    found = {b["name"]: b for b in benchmarks if b.get("run_type") != "aggregate"}
    found.update({b["run_name"]: b for b in benchmarks if b.get("aggregate_name") == "median"})
    return found


def ns(b):
    scale = {"ns": 1, "us": 1e3, "ms": 1e6, "s": 1e9}[b["time_unit"]]
    return b["real_time"] * scale


def python_figure(file, pattern):
    path = os.path.join(out, file)
    if not os.path.exists(path):
        return None
    m = re.search(pattern, open(path).read())
    return float(m.group(1)) if m else None


loop, loop_epoll, ipc, pool, tensor, queue, mpi, torch_bench = (
    load(n) for n in ("loop", "loop_epoll", "ipc", "pool", "tensor", "queue", "mpi", "torch"))
rows = []


def row(what, figure, ratio=""):
    rows.append((what, figure, ratio))


if loop:
    lp, raw = loop["BM_LoopPipeWriteRead"], loop["BM_RawUringPipeWriteRead"]
    row("loop: co_await of a ready task", f"{ns(loop['BM_CoAwaitReadyTask']):.1f} ns")
    row("loop: sleep_for(0) round trip", f"{ns(loop['BM_SleepForZero']) / 1e3:.1f} us")
    row("loop: pipe write+read, io_uring loop vs raw liburing", f"{ns(lp):.0f} ns vs {ns(raw):.0f} ns",
        f"{ns(raw) / ns(lp):.2f}x raw throughput (target >= 0.8)")
    if loop_epoll:
        ep = loop_epoll["BM_LoopPipeWriteRead"]
        row("loop: pipe write+read, epoll backend", f"{ns(ep):.0f} ns", f"io_uring {ns(ep) / ns(lp):.2f}x faster")
if ipc:
    rt, raw = ipc["BM_ChannelRoundTrip64B/real_time"], ipc["BM_RawSocketpairPingPong64B/real_time"]
    row("ipc: 64 B round trip (loop) vs raw blocking ping-pong", f"{ns(rt) / 1e3:.1f} us vs {ns(raw) / 1e3:.1f} us",
        f"{ns(rt) / ns(raw):.2f}x raw (target <= 1.5)")
    p = ipc["BM_ChannelPipelined64InFlight/real_time"]
    row("ipc: 64 in flight to 2 children", f"{p['items_per_second'] / 1e3:.0f} k msg/s")
    m, s = ipc["BM_Payload64MiBViaMemfd/real_time"], ipc["BM_Payload64MiBViaStreamSocket/real_time"]
    row("ipc: 64 MiB payload, memfd vs stream socket", f"{ns(m) / 1e6:.1f} ms vs {ns(s) / 1e6:.1f} ms",
        f"memfd takes {ns(m) / ns(s):.2f}x the stream socket's time")
    for size in (4, 16, 32, 60):
        i = ipc.get(f"BM_PayloadRoundTrip/{size << 10}/0/real_time")
        f = ipc.get(f"BM_PayloadRoundTrip/{size << 10}/1/real_time")
        if i and f:
            row(f"ipc: {size} KiB payload inline vs memfd", f"{ns(i) / 1e3:.1f} us vs {ns(f) / 1e3:.1f} us")
if pool:
    apply_ns = ns(pool.get("BM_ApplyAsyncRoundTrip/0/real_time") or pool["BM_ApplyAsyncRoundTrip/real_time"])
    raw = ns(pool["BM_RawSocketpairPingPong64B/real_time"])
    py_apply = python_figure("py_pool.txt", r"Pool.apply_async round trip: ([\d.]+) us")
    ratio = f"{apply_ns / raw:.2f}x raw ping-pong (target <= 1.5)"
    if py_apply:
        ratio += f"; {py_apply * 1e3 / apply_ns:.1f}x faster than CPython Pool ({py_apply:.0f} us; target >= 10)"
    row("pool: apply_async round trip", f"{apply_ns / 1e3:.1f} us", ratio)
    # The shared-memory rings: back to back with the spin on (Arg 0) and off (Arg 1), against the
    # spinning-futex and socket ping-pongs of the same binary, and latency/run.sh's anchors.
    spin_on, spin_off = pool.get("BM_ApplyAsyncRoundTripSpin/0/real_time"), pool.get("BM_ApplyAsyncRoundTripSpin/1/real_time")
    futex = pool.get("BM_RawSpinThenFutexPingPong/0/real_time")
    if spin_on and spin_off and futex:
        row("pool: apply_async round trip, spin on / off", f"{ns(spin_on) / 1e3:.2f} / {ns(spin_off) / 1e3:.1f} us",
            f"{raw / ns(spin_on):.1f}x faster than the socket ping-pong (target >= 20); "
            f"{ns(spin_on) / ns(futex):.1f}x the spin-then-futex ping-pong ({ns(futex):.0f} ns; target <= 20)")
    apart, futex_apart = pool.get("BM_ApplyAsyncRoundTripSpin/2/real_time"), pool.get("BM_RawSpinThenFutexPingPong/1/real_time")
    socket_apart = pool.get("BM_RawSocketpairPingPong64BApart/real_time")
    if apart and futex_apart:
        ratio = f"{ns(apart) / ns(futex_apart):.1f}x the spin-then-futex ping-pong pinned the same way ({ns(futex_apart):.0f} ns)"
        if socket_apart:
            ratio += (f"; {ns(socket_apart) / ns(apart):.1f}x faster than the socket ping-pong pinned the same way "
                      f"({ns(socket_apart) / 1e3:.1f} us; target >= 20)")
        row("pool: apply_async round trip, parent and worker pinned to two CPUs", f"{ns(apart) / 1e3:.2f} us", ratio)
    for name, label, py_label in (("BM_ApplyAsync100kInFlight/{}/2/real_time", "apply_async, 100,000 in flight", None),
                                  ("BM_ImapChunksize1/{}/real_time", "imap, chunksize 1",
                                   r"Pool.imap_unordered 1e5, chunksize 1: ([\d.]+) k")):
        on, off = pool.get(name.format(0)), pool.get(name.format(1))
        if not (on and off):
            continue
        ratio = f"spin off: {off['items_per_second'] / 1e3:.0f} k/s (target >= 1 M/s with the spin on)"
        py = python_figure("py_pool.txt", py_label) if py_label else None
        if py:
            ratio += f"; {on['items_per_second'] / (py * 1e3):.0f}x CPython's Pool ({py:.1f} k/s)"
        row(f"pool: {label}", f"{on['items_per_second'] / 1e3:.0f} k/s", ratio)
    three_on = pool.get("BM_ThreePoolsOfTwoCpuBound/0/iterations:3/real_time")
    three_off = pool.get("BM_ThreePoolsOfTwoCpuBound/1/iterations:3/real_time")
    if three_on and three_off:
        row("pool: three pools of two, CPU-bound, spin on vs off", f"{ns(three_on) / 1e6:.0f} vs {ns(three_off) / 1e6:.0f} ms",
            f"{ns(three_on) / ns(three_off):.3f}x (target <= 1.05)")
    latency = os.path.join(out, "latency.txt")
    if os.path.exists(latency) and spin_on:
        for line in open(latency):
            parts = line.split()
            if len(parts) >= 2 and not line.startswith("#"):
                try:
                    us = float(parts[-1])
                except ValueError:
                    continue
                row(f"latency anchor: {' '.join(parts[:-1])}", f"{us:.2f} us",
                    f"forkpool's spinning round trip is {us * 1e3 / ns(spin_on):.2f}x faster")
    methods = ("fork", "forkserver", "spawn")
    under = {m: pool.get(f"BM_ApplyAsyncRoundTripUnder/{i}/real_time") for i, m in enumerate(methods)}
    if all(under.values()):
        row("pool: apply_async round trip, fork / forkserver / spawn",
            " / ".join(f"{ns(under[m]) / 1e3:.1f}" for m in methods) + " us",
            f"spawn {ns(under['spawn']) / ns(under['forkserver']):.2f}x forkserver (target ~1)")
    for i, m in enumerate(methods):
        start = pool.get(f"BM_WorkerStart/{i}/iterations:20/manual_time")
        if not start:
            continue
        py = python_figure("py_start.txt", rf"Pool start to first result \({m}\): ([\d.]+) ms")
        ratio = f"{py * 1e6 / ns(start):.1f}x faster than CPython's {m} ({py:.1f} ms)" if py else ""
        row(f"pool: worker start to first result ({m})", f"{ns(start) / 1e6:.2f} ms", ratio)
    for tasks, task_ms, computing_ms in ((100, 10, 500), (1000, 1, 600)):
        overlap = pool.get(f"BM_WorkWhileTheProgramComputes/{tasks}/{task_ms}/{computing_ms}/iterations:3/real_time")
        if not overlap:
            continue
        py = python_figure("py_overlap.txt", rf"Pool, {tasks} x {task_ms} ms, then the program computes {computing_ms} ms: done at ([\d.]+) ms")
        ratio = (f"CPython's Pool {py:.0f} ms: {ns(overlap) / 1e6 / py:.2f}x ({computing_ms} ms: the work ran meanwhile)"
                 if py else "")
        row(f"pool: {tasks} x {task_ms} ms given from plain code, then {computing_ms} ms of computing: all done at",
            f"{ns(overlap) / 1e6:.0f} ms", ratio)
    timed = pool.get("BM_ApplyAsyncRoundTrip/10000/real_time")
    if timed:
        row("pool: apply_async round trip with task_timeout", f"{ns(timed) / 1e3:.1f} us",
            f"{ns(timed) / apply_ns:.3f}x without it (target <= 1.05)")
    for chunk, label, pattern in ((0, "default chunksize", r"default chunksize: ([\d.]+) M"),
                                  (10000, "chunksize 10000", r"chunksize 10000: ([\d.]+) M")):
        b = pool.get(f"BM_Map1MInts/{chunk}/real_time")
        if not b:
            continue
        rate = b["items_per_second"] / 1e6
        py = python_figure("py_pool.txt", r"Pool.map 1e6 ints, " + pattern)
        row(f"pool: map of 1e6 ints, {label}", f"{rate:.1f} M items/s",
            f"{rate / py:.1f}x CPython Pool ({py} M/s; target >= 20)" if py else "")
    longs = pool.get("BM_Map1MLongs/10000/real_time")
    py = python_figure("py_pool.txt", r"Pool.map 1e6 ints, chunksize 10000: ([\d.]+) M")
    if longs:
        rate = longs["items_per_second"] / 1e6
        row("pool: map of 1e6 longs, chunksize 10000", f"{rate:.1f} M items/s",
            f"{rate / py:.1f}x CPython Pool ({py} M/s; target >= 20)" if py else "")
    cancel = pool.get("BM_StopToReplacementServing/0/iterations:50/manual_time")
    killed = pool.get("BM_StopToReplacementServing/1/iterations:50/manual_time")
    if cancel and killed:
        row("pool: cancel() of a running task to a replacement serving", f"{ns(cancel) / 1e3:.0f} us",
            f"{ns(cancel) / ns(killed):.2f}x a plain replacement after SIGKILL ({ns(killed) / 1e3:.0f} us)")
    e = pool.get("BM_CpuBoundMapEfficiency/iterations:3/manual_time")
    if e:
        row("pool: CPU-bound map efficiency at P = cores", f"{e['efficiency'] * 100:.0f}% at P = {e['processes']:.0f}",
            "target >= 95%")
    i = pool.get("BM_Imap10MFlatMemory/iterations:1/real_time")
    if i:
        row("pool: imap over 1e7 items", f"{i['items_per_second'] / 1e6:.1f} M items/s",
            f"RSS grew {i['rss_growth_kib']:.0f} KiB")
if tensor:
    sizes = [(4 << 10, "4 KiB", "4 KiB"), (1 << 20, "1 MiB", "1024 KiB"), (64 << 20, "64 MiB", "65536 KiB"),
             (1 << 30, "1 GiB", "1048576 KiB")]
    small = None
    for size, label, py_label in sizes:
        b = tensor.get(f"BM_TensorRoundTrip/{size}/real_time")
        if not b:
            continue
        t = ns(b)
        small = small or t
        py = python_figure("py_torch.txt", r"shared tensor " + py_label.split()[0] + r" KiB round trip: ([\d.]+) us")
        ratio = f"{t / small:.2f}x the 4 KiB time"
        if py:
            ratio += f"; {py * 1e3 / t:.0f}x faster than torch.multiprocessing ({py:.0f} us; target >= 50)"
        row(f"tensor: round trip, {label}", f"{t / 1e3:.1f} us", ratio)
    for size, label in ((4 << 10, "4 KiB"), (1 << 20, "1 MiB")):
        f = tensor.get(f"BM_FreshTensorRoundTrip/{size}/real_time")
        if f and small:
            row(f"tensor: a new tensor every round trip, {label}", f"{ns(f) / 1e3:.1f} us",
                f"{ns(f) / small:.1f}x the round trip of a tensor sent before")
    crossover = None
    for size in (256, 1 << 10, 4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 64 << 20):
        s = tensor.get(f"BM_SerializedBytesRoundTrip/{size}/real_time")
        t = tensor.get(f"BM_TensorRoundTrip/4096/real_time")
        if s and t and crossover is None and ns(s) > ns(t):
            crossover = size
    if crossover:
        label = f"{crossover >> 10} KiB" if crossover >= 1 << 10 else f"{crossover} B"
        row("tensor: serialized bytes become slower than a shared tensor at", label)

batch_sizes = [(64 << 10, "64 KiB"), (1 << 20, "1024 KiB"), (12 << 20, "12288 KiB")]
loader = {}  # batch bytes -> (forkpool, torch, warm fill) in batches/s
if tensor:
    for size, label in batch_sizes:
        imap_loader = tensor.get(f"BM_DataLoader/{size}/real_time")
        if not imap_loader:
            continue
        r = imap_loader["items_per_second"]
        torch = python_figure("py_dataloader.txt", r"batch " + label.split()[0] + r" KiB: ([\d.]+) batches/s")
        fill = python_figure("fill.txt", r"fill a warm " + label.split()[0] + r" KiB batch: ([\d.]+) batches/s")
        loader[size] = (r, torch, fill)
        ratio = []
        if torch:
            ratio.append(f"{r / torch:.1f}x torch DataLoader ({torch:.0f}/s; target >= 10)")
        if fill:
            ratio.append(f"{r / fill:.2f}x one core's warm fill ({fill:.0f}/s; target >= 0.5 at 1 and 12 MiB)")
        threads = python_figure("libtorch_dataloader.txt", r"batch " + label.split()[0] + r" KiB: ([\d.]+) batches/s")
        if threads:
            ratio.append(f"{r / threads:.2f}x libtorch's thread DataLoader ({threads:.0f}/s; target >= 1)")
        row(f"tensor: DataLoader pattern, {label.split()[0]} KiB batches", f"{r:.0f} batches/s", "; ".join(ratio))
        for prefetch in (2, 16):
            loader_class = tensor.get(f"BM_DataLoaderClass/{size}/{prefetch}/real_time")
            if not loader_class:
                continue
            c = loader_class["items_per_second"]
            ratio = [f"{c / r:.2f}x the imap pattern" + ("" if prefetch == 2 else " (target >= 0.95)")]
            if torch:
                ratio.append(f"{c / torch:.1f}x torch DataLoader")
            if threads:
                ratio.append(f"{c / threads:.2f}x libtorch's thread DataLoader")
            row(f"tensor: forkpool::DataLoader, {label.split()[0]} KiB batches, prefetch_factor {prefetch}",
                f"{c:.0f} batches/s", "; ".join(ratio))
            iterable = tensor.get(f"BM_IterableDataLoader/{size}/{prefetch}/real_time")
            if iterable:
                i = iterable["items_per_second"]
                row(f"tensor: forkpool::DataLoader over an iterable dataset, {label.split()[0]} KiB, "
                    f"prefetch_factor {prefetch}", f"{i:.0f} batches/s", f"{i / c:.2f}x the map-style loader")

if tensor:  # batches of 64 samples collated in the worker
    for size, label in batch_sizes:
        kib = label.split()[0]
        imap = tensor.get(f"BM_CollatedBatches/{size}/0/real_time")
        if not imap:
            continue
        m = imap["items_per_second"]
        torch = python_figure("py_dataloader_collated.txt", r"collated batch " + kib + r" KiB: ([\d.]+) batches/s")
        row(f"tensor: 64 samples collated per batch, {kib} KiB, the imap loop", f"{m:.0f} batches/s",
            f"{m / torch:.1f}x torch DataLoader's batch_size=64 ({torch:.0f}/s)" if torch else "")
        for prefetch in (2, 16):
            collated = tensor.get(f"BM_CollatedBatches/{size}/{prefetch}/real_time")
            if not collated:
                continue
            c = collated["items_per_second"]
            ratio = [f"{c / m:.2f}x the imap loop (target >= 0.95)"]
            if torch:
                ratio.append(f"{c / torch:.1f}x torch DataLoader (target >= 10)")
            row(f"tensor: forkpool::DataLoader, batch_size 64, {kib} KiB, prefetch_factor {prefetch}",
                f"{c:.0f} batches/s", "; ".join(ratio))

if torch_bench:
    for size, label in [(4 << 10, "4 KiB"), (1 << 20, "1024 KiB")]:
        for apart, placed in ((0, ""), (1, ", parent and worker pinned apart")):
            t = torch_bench.get(f"BM_TorchTensorRoundTrip/{size}/1/{apart}/real_time")
            f = torch_bench.get(f"BM_TorchTensorRoundTrip/{size}/0/{apart}/real_time")
            if t and f:
                row(f"torch: torch::Tensor round trip, {label}{placed}", f"{ns(t) / 1e3:.2f} us",
                    f"{ns(t) / ns(f):.2f}x fp::Tensor's ({ns(f) / 1e3:.2f} us; target <= 1.1)")
        alternated = torch_bench.get(f"BM_TorchOverFpRoundTrip/{size}/real_time")
        if alternated:
            row(f"torch: torch::Tensor round trip, {label}, alternated with fp::Tensor's in one pool",
                f"{alternated['torch_ns'] / 1e3:.2f} us",
                f"{alternated['torch_over_fp']:.2f}x fp::Tensor's ({alternated['fp_ns'] / 1e3:.2f} us; target <= 1.1)")
    # What the round trip's difference is made of: each side's tensor decoded and dropped, and encoded.
    made = [torch_bench.get(f"BM_TensorOverABlockMadeAndDropped/{arg}") for arg in range(3)]
    encoded = [torch_bench.get(f"BM_SharedTensorEncoded/{arg}") for arg in range(2)]
    if all(made) and all(encoded):
        row("torch: a torch::Tensor decoded over a block and dropped, worker / parent side",
            f"{ns(made[1]):.0f} / {ns(made[2]):.0f} ns",
            f"+{ns(made[1]) - ns(made[0]):.0f} / +{ns(made[2]) - ns(made[0]):.0f} ns over fp::Tensor's ({ns(made[0]):.0f} ns); "
            f"encoded: +{ns(encoded[1]) - ns(encoded[0]):.0f} ns ({ns(encoded[1]):.0f} vs {ns(encoded[0]):.0f} ns)")
    work = [torch_bench.get(f"BM_RoundTripWorkWithoutTheTrip/{arg}") for arg in range(2)]
    if all(work):
        row("torch: a round trip's work without the trip (both ends, one process)",
            f"{ns(work[1]):.0f} ns", f"+{ns(work[1]) - ns(work[0]):.0f} ns over fp::Tensor's ({ns(work[0]):.0f} ns)")
    for size, label in batch_sizes:
        b = torch_bench.get(f"BM_TorchDataLoader/{size}/real_time")
        if not b:
            continue
        r = b["items_per_second"]
        kib = label.split()[0]
        ratio = []
        torch = python_figure("py_dataloader.txt", r"batch " + kib + r" KiB: ([\d.]+) batches/s")
        if torch:
            ratio.append(f"{r / torch:.1f}x torch DataLoader (target >= 10)")
        threads = python_figure("libtorch_dataloader.txt", r"batch " + kib + r" KiB: ([\d.]+) batches/s")
        if threads:
            ratio.append(f"{r / threads:.2f}x libtorch's thread DataLoader")
        row(f"torch: DataLoader pattern, {kib} KiB torch::Tensor batches", f"{r:.0f} batches/s", "; ".join(ratio))

# Hogwild (examples/torch_hogwild, run by run_all.sh): 2 processes on halves of the data against
# 1 process on all of it, the same samples seen in all.
hogwild = {p: (python_figure("hogwild.txt", rf"hogwild: {p} processes x \d+ steps in ([\d.]+) s"),
               python_figure("hogwild.txt", rf"hogwild: {p} processes x .*accuracy [\d.]+ -> ([\d.]+)"))
           for p in (1, 2)}
if all(None not in figures for figures in hogwild.values()):
    (t1, a1), (t2, a2) = hogwild[1], hogwild[2]
    row("torch: hogwild, 2 processes vs 1 (same samples in all)", f"{t2:.2f} vs {t1:.2f} s",
        f"{t1 / t2:.2f}x faster; accuracy {a2:.3f} vs {a1:.3f} (target: as accurate, in less time)")


def plot():
    """PNG plots beside the results: the tensor round trip against size, and DataLoader throughput
    against batch size; forkpool beside torch and the machine's limit."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(no plots: python3-matplotlib is not installed)")
        return
    if tensor:
        sizes, ours, theirs = [], [], []
        for size, py_label in ((4 << 10, 4), (1 << 20, 1024), (64 << 20, 65536), (1 << 30, 1048576)):
            b = tensor.get(f"BM_TensorRoundTrip/{size}/real_time")
            if not b:
                continue
            sizes.append(size)
            ours.append(ns(b) / 1e3)
            theirs.append(python_figure("py_torch.txt", r"shared tensor " + str(py_label) + r" KiB round trip: ([\d.]+) us"))
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot(sizes, ours, "o-", label="forkpool")
        if all(theirs):
            ax.plot(sizes, theirs, "s--", label="torch.multiprocessing")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tensor size (bytes)")
        ax.set_ylabel("round trip through a worker (us)")
        ax.set_title("Shared tensor round trip")
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(out, "tensor_round_trip.png"), dpi=100)
    if loader:
        xs = sorted(loader)
        fig, ax = plt.subplots(figsize=(6, 4))
        series = [(0, "forkpool", "o-"), (1, "torch DataLoader", "s--"), (2, "warm fill, one core (limit)", "k-")]
        for index, label, style in series:
            ys = [loader[x][index] for x in xs]
            if all(ys):
                ax.plot(xs, ys, style, label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch size (bytes)")
        ax.set_ylabel("batches per second")
        ax.set_title("DataLoader pattern, 2 workers")
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(out, "dataloader.png"), dpi=100)
    print(f"plots: {out}/tensor_round_trip.png, {out}/dataloader.png")


if queue:
    for name, label, pattern, unit, target in (
            ("BM_QueueInts/real_time", "queue: ints, producer process to consumer",
             r"multiprocessing.Queue ints: ([\d.]+) k", 1e3, ""),
            ("BM_QueueTensors64KiB/real_time", "queue: new 64 KiB tensors, producer to consumer",
             r"Queue 64 KiB tensors: ([\d.]+) items", 1, " (target >= 10)"),
            ("BM_QueueTensors1MiB/real_time", "queue: new 1 MiB tensors, producer to consumer",
             r"Queue 1 MiB tensors: ([\d.]+) items", 1, " (target >= 10)"),
            ("BM_LockUncontended/real_time", "lock: uncontended lock+unlock",
             r"Lock uncontended: ([\d.]+) k", 1e3, ""),
            ("BM_LockContendedByTwoProcesses/real_time", "lock: two processes taking turns",
             r"Lock contended by 2 processes: ([\d.]+) k", 1e3, "")):
        b = queue.get(name)
        if not b:
            continue
        rate = b["items_per_second"]
        py = python_figure("py_queue.txt", pattern)
        ratio = f"{rate / (py * unit):.1f}x the Python peer ({py * unit:,.0f}/s){target}" if py else ""
        row(label, f"{rate:,.0f}/s", ratio)

    def trip_us(name):
        b = queue.get(name)
        return ns(b) / 1e3 if b else None

    for pipe, over_queue, label, pattern in (
            ("BM_PipeRoundTrip64B/real_time", "BM_QueueRoundTrip64B/real_time", "pipe: 64 B round trip",
             r"multiprocessing.Pipe round trip 64 B: ([\d.]+) us"),
            ("BM_PipeRoundTripTensor1MiB/real_time", "BM_QueueRoundTripTensor1MiB/real_time",
             "pipe: 1 MiB tensor round trip", r"Pipe round trip 1 MiB tensor: ([\d.]+) us")):
        us, queue_us = trip_us(pipe), trip_us(over_queue)
        if not us:
            continue
        ratio = []
        if queue_us:
            ratio.append(f"{queue_us / us:.2f}x faster than a pair of Queues ({queue_us:.1f} us)")
        py = python_figure("py_queue.txt", pattern)
        if py:
            ratio.append(f"{py / us:.1f}x faster than Python's Pipe ({py:.1f} us)")
        row(label, f"{us:.1f} us", "; ".join(ratio))
    socket_us, futex_us = trip_us("BM_RawSocketpairPingPong64B/real_time"), trip_us(
        "BM_RawSpinThenFutexPingPong/0/real_time")
    for name, label in (("BM_SemaphoreHandOff/real_time", "semaphore: hand-off there and back"),
                        ("BM_SemaphoreHandOffOnTheLoop/real_time", "semaphore: the same, awaited on the loop"),
                        ("BM_ConditionHandOff/real_time", "condition: hand-off there and back")):
        us = trip_us(name)
        if not us:
            continue
        ratio = []
        if socket_us:
            ratio.append(f"{us / socket_us:.2f}x the socket ping-pong ({socket_us:.1f} us)")
        if futex_us:
            ratio.append(f"{us / futex_us:.1f}x the spin-then-futex ping-pong ({futex_us:.2f} us)")
        row(label, f"{us:.1f} us", "; ".join(ratio))

if mpi:
    trip = mpi.get("BM_MpiApplyAsyncRoundTrip/real_time")
    if trip:
        py = python_figure("py_mpi4py.txt", r"round trip: ([\d.]+) us")
        ratio = f"{py * 1e3 / ns(trip):.1f}x faster than mpi4py.futures ({py:.1f} us; target >= 10)" if py else ""
        row("mpi: apply_async round trip, 3 ranks", f"{ns(trip) / 1e3:.1f} us", ratio)
    over, local = mpi.get("BM_MpiMapOverNodes/real_time"), mpi.get("BM_LocalMapSameWorkers/real_time")
    if over and local:
        row("mpi: map over 3 nodes vs a local pool of as many workers",
            f"{over['items_per_second'] / 1e3:.1f} k vs {local['items_per_second'] / 1e3:.1f} k calls/s",
            f"{over['items_per_second'] / local['items_per_second']:.2f}x")

width = max(len(r[0]) for r in rows) if rows else 0
for what, figure, ratio in rows:
    print(f"{what:<{width}}  {figure:<28} {ratio}")
plot()
