"""CPython's Pool while the program computes (the peer of pool_bench's
BM_WorkWhileTheProgramComputes): 100 tasks of 10 ms on 2 workers, then 500 ms of the program's
own computing without a call into the pool, then every result. The median of 3 of the time from
the first submit to the last result."""
import multiprocessing as mp, statistics, time


def sleep_10ms(x):
    time.sleep(0.01)
    return x


def done_after(pool):
    start = time.monotonic()
    results = [pool.apply_async(sleep_10ms, (i,)) for i in range(100)]
    s = 0.0
    while time.monotonic() - start < 0.5:
        s += 1.0
    for r in results:
        r.get()
    return time.monotonic() - start


if __name__ == "__main__":
    with mp.Pool(2) as pool:
        pool.apply(sleep_10ms, (0,))
        print(f"Pool work while the program computes 500 ms: done at {statistics.median(done_after(pool) for _ in range(3)) * 1e3:.1f} ms")
