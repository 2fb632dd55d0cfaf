"""Peers of bench/queue_bench.cpp: torch.multiprocessing.Queue and Pipe (tensors shared, as
torch does), multiprocessing.Lock and Pipe, on the same patterns. A producer process puts N
items when told to; the parent gets them. A Pipe's echo process sends back what it gets. Fork
start method, median of 3 runs."""
import statistics, time
import multiprocessing as mp

try:
    import torch, torch.multiprocessing as tmp
except ImportError:
    torch = None


def producer(go, q, make):
    while True:
        n = go.get()
        if n < 0:
            return
        for i in range(n):
            q.put(make(i))


def make_int(i):
    return i


def make_tensor_64k(i):
    return torch.full((16384,), float(i))


def make_tensor_1m(i):
    return torch.full((262144,), float(i))


def rate(ctx, make, n):
    go, q = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=producer, args=(go, q, make))
    p.start()
    go.put(50)
    for _ in range(50):
        q.get()
    runs = []
    for _ in range(3):
        t = time.perf_counter()
        go.put(n)
        for _ in range(n):
            item = q.get()
            del item
        runs.append(n / (time.perf_counter() - t))
    go.put(-1)
    p.join()
    return statistics.median(runs)


def lock_loop(lock, n):
    for _ in range(n):
        lock.acquire()
        lock.release()


def pipe_echo(conn):
    while True:
        item = conn.recv()
        if item is None:
            return
        conn.send(item)


def pipe_round_trip_us(ctx, item, n):
    """One item to an echo process and back over ctx.Pipe(): median of 3 runs, in µs."""
    here, there = ctx.Pipe()
    p = ctx.Process(target=pipe_echo, args=(there,))
    p.start()
    for _ in range(100):
        here.send(item)
        here.recv()
    runs = []
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(n):
            here.send(item)
            here.recv()
        runs.append((time.perf_counter() - t) / n * 1e6)
    here.send(None)
    p.join()
    return statistics.median(runs)


def lock_rates(ctx, n=200000):
    lock = ctx.Lock()
    t = time.perf_counter()
    lock_loop(lock, n)
    alone = n / (time.perf_counter() - t)
    p = ctx.Process(target=lock_loop, args=(lock, n))
    t = time.perf_counter()
    p.start()
    lock_loop(lock, n)
    p.join()
    contended = 2 * n / (time.perf_counter() - t)
    return alone, contended


if __name__ == "__main__":
    ctx = mp.get_context("fork")
    print(f"multiprocessing.Queue ints: {rate(ctx, make_int, 20000) / 1e3:.1f} k items/s")
    if torch is not None:
        tctx = tmp.get_context("fork")
        print(f"torch.multiprocessing.Queue 64 KiB tensors: {rate(tctx, make_tensor_64k, 1000):.0f} items/s")
        print(f"torch.multiprocessing.Queue 1 MiB tensors: {rate(tctx, make_tensor_1m, 300):.0f} items/s")
    print(f"multiprocessing.Pipe round trip 64 B: {pipe_round_trip_us(ctx, bytes(64), 5000):.1f} us")
    if torch is not None:
        t = torch.zeros(262144)
        t.share_memory_()
        print(f"torch.multiprocessing.Pipe round trip 1 MiB tensor: {pipe_round_trip_us(tctx, t, 1000):.1f} us")
    alone, contended = lock_rates(ctx)
    print(f"multiprocessing.Lock uncontended: {alone / 1e3:.0f} k pairs/s")
    print(f"multiprocessing.Lock contended by 2 processes: {contended / 1e3:.0f} k pairs/s")
