"""forkpool.DataLoader against torch's DataLoader, and forkpool.Executor against CPython's
ProcessPoolExecutor, in one run, on Debian's python3: ratios, as issue 61 asks for them.

    PYTHONPATH=build/python /usr/bin/python3 bench/python_data.py
"""

import concurrent.futures
import gc
import multiprocessing
import time

import torch
import torch.utils.data

import forkpool


class NewTensors(torch.utils.data.Dataset):
    """Each sample a new tensor of `sample_bytes`; 16 make a batch."""

    def __init__(self, sample_bytes, n):
        self.numel = sample_bytes // 4
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.full((self.numel,), float(i))


def noop(x):
    return x


def per_batch(loader, epochs=2, keep=False):
    kept = []
    list(loader)  # warm: workers started, slabs made
    start = time.perf_counter()
    batches = 0
    for _ in range(epochs):
        for batch in loader:
            batches += 1
            if keep:
                kept.append(batch)
    return (time.perf_counter() - start) / batches


def main():
    rows = []
    for batch_bytes, n_batches in ((64 << 10, 1000), (1 << 20, 300), (12 << 20, 40)):
        dataset = NewTensors(batch_bytes // 16, 16 * n_batches)
        args = dict(batch_size=16, num_workers=2, persistent_workers=True)
        theirs = per_batch(torch.utils.data.DataLoader(dataset, **args))
        ours = per_batch(forkpool.DataLoader(dataset, **args))
        rows.append((f"DataLoader {batch_bytes >> 10} KiB batches", "torch DataLoader", theirs, ours))
    dataset = NewTensors(4 << 10, 16 * 2500)  # 64 KiB batches, all kept: 10,000 over 4 epochs
    args = dict(batch_size=16, num_workers=2, persistent_workers=True)
    theirs = per_batch(torch.utils.data.DataLoader(dataset, **args), epochs=4, keep=True)
    ours = per_batch(forkpool.DataLoader(dataset, **args), epochs=4, keep=True)
    rows.append(("DataLoader 64 KiB, 10,000 kept", "torch DataLoader", theirs, ours))

    n = 100_000
    for name, make in (("ProcessPoolExecutor", lambda: concurrent.futures.ProcessPoolExecutor(
            2, mp_context=multiprocessing.get_context("fork"))), ("forkpool.Executor", lambda: forkpool.Executor(2))):
        with make() as executor:
            list(executor.map(noop, range(100)))
            gc.collect()  # (each starts clean: not collecting what the one before left)
            start = time.perf_counter()
            futures = [executor.submit(noop, i) for i in range(n)]
            for f in futures:
                f.result()
            rows.append(("submit x100000", name, (time.perf_counter() - start) / n, None))
    theirs, ours = rows[-2][2], rows[-1][2]
    rows[-2:] = [("Executor submit x100000", "ProcessPoolExecutor", theirs, ours)]

    print(f"{'case':34} {'peer':22} {'peer us':>10} {'forkpool us':>12} {'ratio':>7}")
    for name, peer, theirs, mine in rows:
        print(f"{name:34} {peer:22} {theirs * 1e6:10.1f} {mine * 1e6:12.1f} {theirs / mine:6.1f}x")


if __name__ == "__main__":
    main()
