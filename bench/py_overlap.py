"""CPython's Pool while the program computes (the peer of pool_bench's
BM_WorkWhileTheProgramComputes): N tasks of M ms on 2 workers, then C ms of the program's own
computing without a call into the pool, then every result; 100 x 10 ms then 500 ms, and
1000 x 1 ms then 600 ms. The mean of 3 rounds in one pool (as the benchmark's 3 iterations) of
the time from the first submit to the last result."""
import multiprocessing as mp, statistics, time


def sleep_ms_then(ms, x):
    time.sleep(ms / 1e3)
    return x


def done_after(pool, tasks, task_ms, computing_ms):
    start = time.monotonic()
    results = [pool.apply_async(sleep_ms_then, (task_ms, i)) for i in range(tasks)]
    s = 0.0
    while time.monotonic() - start < computing_ms / 1e3:
        s += 1.0
    for r in results:
        r.get()
    return time.monotonic() - start


if __name__ == "__main__":
    with mp.Pool(2) as pool:
        for tasks, task_ms, computing_ms in ((100, 10, 500), (1000, 1, 600)):
            pool.apply(sleep_ms_then, (task_ms, 0))
            done = statistics.mean(done_after(pool, tasks, task_ms, computing_ms) for _ in range(3))
            print(f"Pool, {tasks} x {task_ms} ms, then the program computes {computing_ms} ms: done at {done * 1e3:.1f} ms")
