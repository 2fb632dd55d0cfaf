"""forkpool.Pool against multiprocessing.Pool (fork context) and torch.multiprocessing's Pool, in
one run, on Debian's python3: ratios, as issue 60 asks for them. With the path of a built
bench/pool_bench, also the cost of the binding: Python's apply round trip against C++'s.

    PYTHONPATH=build/python /usr/bin/python3 bench/python_pool.py [build-release/bench/pool_bench]
"""

import json
import multiprocessing
import statistics
import subprocess
import sys
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


def many_async(pool, n=100_000):
    def run():
        results = [pool.apply_async(noop, (i,)) for i in range(n)]
        for r in results:
            r.get()
        return n
    return per_call(run, 3)


def imap_chunk1(pool, n=100_000):
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
        for name, measure in (("apply round trip", apply_round_trip), ("apply_async x100000", many_async),
                              ("imap chunksize=1 x100000", imap_chunk1)):
            theirs, mine = measure(cpython), measure(ours)
            rows.append((name, "multiprocessing.Pool", theirs, mine))
    with forkpool.Pool(2) as ours, tmp.get_context("fork").Pool(2) as torch_pool:
        for nbytes, n in ((4 << 10, 500), (1 << 20, 200), (64 << 20, 100)):
            theirs = tensor_round_trip(torch_pool, nbytes, n)
            mine = tensor_round_trip(ours, nbytes, n)
            rows.append((f"tensor round trip {nbytes >> 10} KiB", "torch.multiprocessing.Pool", theirs, mine))
    if len(sys.argv) > 1:  # the binding's cost: C++'s own round trip (2 workers, as above)
        with forkpool.Pool(2) as ours:
            python = apply_round_trip(ours)
        out = subprocess.run([sys.argv[1], "--benchmark_filter=^BM_ApplyAsyncRoundTrip/0/", "--benchmark_format=json",
                              "--benchmark_min_time=0.5"], capture_output=True, text=True, check=True).stdout
        cpp = json.loads(out)["benchmarks"][0]["real_time"] * 1e-9
        rows.append(("apply round trip: binding cost", "forkpool.Pool vs C++ Pool", python, cpp))
    print(f"{'case':32} {'peer':28} {'peer us':>10} {'forkpool us':>12} {'ratio':>7}")
    for name, peer, theirs, mine in rows:
        print(f"{name:32} {peer:28} {theirs * 1e6:10.1f} {mine * 1e6:12.1f} {theirs / mine:6.1f}x")


if __name__ == "__main__":
    main()
