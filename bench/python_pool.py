"""forkpool.Pool against multiprocessing.Pool (fork context) and torch.multiprocessing's Pool, in
one run, on Debian's python3: ratios, as issue 60 asks for them.

    PYTHONPATH=build/python /usr/bin/python3 bench/python_pool.py
"""

import multiprocessing
import statistics
import time

import torch
import torch.multiprocessing as tmp

import forkpool


def noop(x):
    return x


def same(t):
    return t


def per_call(fn, repeats=5):
    """The median over `repeats` of fn()'s seconds per call (fn returns its number of calls)."""
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        calls = fn()
        samples.append((time.perf_counter() - start) / calls)
    return statistics.median(samples)


def apply_round_trip(pool, n=2000):
    def run():
        for i in range(n):
            pool.apply(noop, (i,))
        return n
    return per_call(run)


def many_async(pool, n=20000):
    def run():
        results = [pool.apply_async(noop, (i,)) for i in range(n)]
        for r in results:
            r.get()
        return n
    return per_call(run, 3)


def imap_chunk1(pool, n=20000):
    def run():
        for _ in pool.imap(noop, range(n), chunksize=1):
            pass
        return n
    return per_call(run, 3)


def tensor_round_trip(pool, nbytes, n):
    t = torch.ones(nbytes // 4)
    def run():
        for _ in range(n):
            pool.apply(same, (t,))
        return n
    return per_call(run, 3)


def main():
    fork = multiprocessing.get_context("fork")
    rows = []
    with forkpool.Pool(2) as ours, fork.Pool(2) as cpython:
        for name, measure in (("apply round trip", apply_round_trip), ("apply_async x20000", many_async),
                              ("imap chunksize=1 x20000", imap_chunk1)):
            theirs, mine = measure(cpython), measure(ours)
            rows.append((name, "multiprocessing.Pool", theirs, mine))
    with forkpool.Pool(2) as ours, tmp.get_context("fork").Pool(2) as torch_pool:
        for nbytes, n in ((4 << 10, 500), (1 << 20, 200), (64 << 20, 10)):
            theirs = tensor_round_trip(torch_pool, nbytes, n)
            mine = tensor_round_trip(ours, nbytes, n)
            rows.append((f"tensor round trip {nbytes >> 10} KiB", "torch.multiprocessing.Pool", theirs, mine))
    print(f"{'case':32} {'peer':28} {'peer us':>10} {'forkpool us':>12} {'ratio':>7}")
    for name, peer, theirs, mine in rows:
        print(f"{name:32} {peer:28} {theirs * 1e6:10.1f} {mine * 1e6:12.1f} {theirs / mine:6.1f}x")


if __name__ == "__main__":
    main()
