"""CPython's worker start, per start method: make a Pool of one worker and get its first result
(the peer of pool_bench's BM_WorkerStart). The median of 7; forkserver's server is started once,
before the timed runs, as forkpool::init() starts ours."""
import multiprocessing as mp, statistics, time


def ident(x):
    return x


def start_ms(ctx):
    t = time.perf_counter()
    with ctx.Pool(1) as pool:
        pool.apply(ident, (1,))
        took = time.perf_counter() - t
    return took * 1e3


if __name__ == "__main__":
    for method in ("fork", "forkserver", "spawn"):
        ctx = mp.get_context(method)
        start_ms(ctx)  # warm: imports, and the fork server
        print(f"Pool start to first result ({method}): {statistics.median(start_ms(ctx) for _ in range(7)):.2f} ms")
