"""forkpool.Executor under concurrent.futures' and asyncio's use, and a killed worker."""

import asyncio
import concurrent.futures
import os
import signal
import time

import pytest

import forkpool
from support import scaled


def square(x):
    return x * x


def fail(x):
    raise ValueError(x)


def kill_myself():
    os.kill(os.getpid(), signal.SIGKILL)


def test_submit_map_as_completed_and_wait():
    with forkpool.Executor(max_workers=2) as executor:
        futures = [executor.submit(square, i) for i in range(50)]
        assert sorted(f.result(timeout=20) for f in concurrent.futures.as_completed(futures, timeout=20)) == \
            sorted(i * i for i in range(50))
        done, not_done = concurrent.futures.wait(futures, timeout=20)
        assert len(done) == 50 and not not_done
        assert list(executor.map(square, range(20))) == [i * i for i in range(20)]
        assert list(executor.map(pow, range(20), [2] * 20, chunksize=6)) == [i * i for i in range(20)]


def test_an_exception_reaches_its_future_and_a_killed_worker_fails_only_its_own():
    with forkpool.Executor(max_workers=2) as executor:
        with pytest.raises(ValueError):
            executor.submit(fail, 3).result(timeout=20)
        others = [executor.submit(square, i) for i in range(10)]
        with pytest.raises(forkpool.WorkerLost):
            executor.submit(kill_myself).result(timeout=20)
        assert [f.result(timeout=20) for f in others] == [i * i for i in range(10)]
        assert executor.submit(square, 7).result(timeout=20) == 49, "the executor goes on"


def test_asyncio_run_in_executor_and_wrap_future():
    async def main(executor):
        loop = asyncio.get_running_loop()
        results = await asyncio.gather(*(loop.run_in_executor(executor, square, i) for i in range(10)))
        wrapped = await asyncio.wrap_future(executor.submit(square, 12))
        return results, wrapped

    with forkpool.Executor(max_workers=2) as executor:
        assert asyncio.run(main(executor)) == ([i * i for i in range(10)], 144)


def test_shutdown_refuses_new_work_and_cancels_what_waits():
    executor = forkpool.Executor(max_workers=1)
    slow = executor.submit(time.sleep, 0.3)
    queued = [executor.submit(square, i) for i in range(200)]
    executor.shutdown(wait=True, cancel_futures=True)
    assert slow.done()
    assert all(f.done() for f in queued)
    with pytest.raises(RuntimeError, match="after shutdown"):
        executor.submit(square, 1)


def test_a_future_cancelled_before_its_result_stays_cancelled():
    with forkpool.Executor(max_workers=1) as executor:
        slow = executor.submit(time.sleep, 0.5)
        behind = executor.submit(square, 3)
        assert behind.cancel() and behind.cancelled()
        slow.result(timeout=20)
        concurrent.futures.wait([behind], timeout=20)
        assert behind.cancelled()
        with pytest.raises(concurrent.futures.CancelledError):
            behind.result(timeout=0)
        assert executor.submit(square, 4).result(timeout=20) == 16


def test_threads_submit_at_once_and_each_gets_its_own_results():
    import threading

    with forkpool.Executor(max_workers=2) as executor:
        results = {}

        def submit_many(base):
            results[base] = [f.result(timeout=20) for f in [executor.submit(square, base + i) for i in range(300)]]

        threads = [threading.Thread(target=submit_many, args=(1000 * t,)) for t in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert {base: values for base, values in results.items()} == {
            1000 * t: [(1000 * t + i) ** 2 for i in range(300)] for t in range(4)}


def test_an_argument_that_cannot_be_pickled_fails_its_future_only():
    with forkpool.Executor(max_workers=1) as executor:
        future = executor.submit(square, threading_lock())
        with pytest.raises(TypeError):
            future.result(timeout=20)
        assert executor.submit(square, 5).result(timeout=20) == 25


def threading_lock():
    import threading

    return threading.Lock()


def test_a_program_that_exits_without_shutdown_waits_for_its_calls(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "main.py"
    script.write_text(
        "import time, forkpool\n"
        "def slow(x):\n"
        "    time.sleep(0.3)\n"
        "    return x\n"
        "if __name__ == '__main__':\n"
        "    executor = forkpool.Executor(2)\n"
        "    future = executor.submit(slow, 7)\n"
        "    future.add_done_callback(lambda f: print('settled', f.result(), flush=True))\n")
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60,
                            env=os.environ.copy())
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "settled 7"


def sleep_then(seconds, value):
    time.sleep(seconds)
    return value


def test_futures_are_concurrent_futures_the_collector_hardly_sees():
    import gc
    with forkpool.Executor(max_workers=1) as executor:
        future = executor.submit(square, 3)
        assert isinstance(future, concurrent.futures.Future)
        assert future.result(timeout=20) == 9
        # A threading.Condition is eight objects the cyclic collector tracks; forkpool's is none.
        assert not gc.is_tracked(future._condition)
        slow = executor.submit(sleep_then, 0.5, "late")
        with pytest.raises(concurrent.futures.TimeoutError):
            slow.result(timeout=0.05)
        assert slow.exception(timeout=20) is None and slow.result() == "late"


def test_the_futures_condition_is_a_reentrant_lock_and_a_condition():
    import threading
    condition = forkpool._forkpool.FutureCondition()
    with pytest.raises(RuntimeError, match="un-acquired"):
        condition.release()
    with pytest.raises(RuntimeError, match="un-acquired"):
        condition.notify_all()
    with condition:
        assert condition.acquire() and condition.acquire(blocking=False)  # reentrant
        condition.release()
        condition.release()
        taken = []
        other = threading.Thread(target=lambda: taken.append(condition.acquire(True, 0.05)))
        other.start()
        other.join()
        assert taken == [False]  # held here: another thread waits its timeout out
        assert condition.wait(0.01) is False  # nobody notified
    woken = []

    def waiter():
        with condition:
            woken.append(condition.wait(20))

    thread = threading.Thread(target=waiter)
    thread.start()
    while not woken:
        with condition:
            condition.notify_all()
        time.sleep(0.01)
    thread.join(20)
    assert woken == [True]
    assert condition.acquire(blocking=False)  # free again, after the waiter let go
    condition.release()


def test_ctrl_c_during_a_futures_result_ends_the_wait_at_once():
    with forkpool.Executor(max_workers=1) as executor:
        future = executor.submit(sleep_then, 2, "late")
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        previous = signal.signal(signal.SIGALRM, lambda *_: os.kill(os.getpid(), signal.SIGINT))
        try:
            start = time.monotonic()
            with pytest.raises(KeyboardInterrupt):
                future.result(timeout=20)
            assert time.monotonic() - start < scaled(1.5)
        finally:
            signal.signal(signal.SIGALRM, previous)
        future.cancel()
        with future._condition:  # the interrupted wait let the lock go
            pass
