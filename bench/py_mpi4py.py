"""Peer of bench/mpi_bench.cpp: mpi4py.futures.MPIPoolExecutor (Debian's python3-mpi4py) in
MPI-1 mode, started the same way:

    mpirun --mca pml ob1 --oversubscribe -n 3 python3 -m mpi4py.futures bench/py_mpi4py.py

Rank 0 runs this; ranks 1 and 2 are its workers. Prints the submit().result() round trip
(median of 3 runs) and map throughput of the same 40 µs work function at chunksize 10."""
import statistics, time
from mpi4py.futures import MPIPoolExecutor


def add(a, b):
    return a + b


def work(x):
    for _ in range(20000 // 50):  # Python is ~50x slower per step: about the same time per call
        x = (x * 6364136223846793005 + 1442695040888963407) & 0xFFFFFFFFFFFFFFFF
    return x


def main():
    with MPIPoolExecutor() as pool:
        pool.submit(add, 1, 2).result()
        runs = []
        for _ in range(3):
            n = 2000
            t = time.perf_counter()
            for _ in range(n):
                pool.submit(add, 1, 2).result()
            runs.append((time.perf_counter() - t) / n)
        print(f"mpi4py.futures submit().result() round trip: {statistics.median(runs) * 1e6:.1f} us")
        t = time.perf_counter()
        list(pool.map(work, [7] * 3000, chunksize=10))
        print(f"mpi4py.futures map: {3000 / (time.perf_counter() - t):.0f} items/s")


if __name__ == "__main__":
    main()
