"""forkpool.Queue, Process and spawn: torch.multiprocessing's names and meanings."""

import os
import pickle
import queue
import signal
import threading
import time

import pytest
import torch

import forkpool
from support import scaled


def put_tensor_and_exit(q, value):
    q.put({"t": torch.full((1000,), float(value)), "value": value})
    os._exit(0)  # no flush, no clean-up: the item must have left already


_inherited = {}  # what a pool's workers have from the fork that started them


def put_square(x):
    _inherited["queue"].put(x * x)
    return x


def rank_puts(rank, q):
    q.put(rank)


def rank_raises(rank):
    if rank == 1:
        raise ValueError(f"rank {rank} failed")
    time.sleep(30)


def rank_exits(rank, code):
    if rank == 0:
        os._exit(code)
    time.sleep(30)


def rank_kills_itself(rank):
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(30)


def test_put_get_and_their_empty_and_full_errors():
    q = forkpool.Queue(2)
    q.put(1)
    q.put_nowait([2, "two"])
    assert q.full() and q.qsize() == 2
    with pytest.raises(queue.Full):
        q.put(3, timeout=0.05)
    with pytest.raises(queue.Full):
        q.put_nowait(3)
    assert q.get() == 1
    assert q.get(timeout=1) == [2, "two"]
    assert q.empty()
    with pytest.raises(queue.Empty):
        q.get(timeout=0.05)
    with pytest.raises(queue.Empty):
        q.get_nowait()
    q.close()
    with pytest.raises(ValueError):
        q.put(1)


def test_a_queue_is_shared_by_inheritance_only():
    with pytest.raises(RuntimeError, match="inheritance"):
        pickle.dumps(forkpool.Queue())


def test_a_tensor_put_by_a_process_that_exits_at_once_arrives_whole():
    q = forkpool.Queue()
    processes = [forkpool.Process(target=put_tensor_and_exit, args=(q, i)) for i in range(4)]
    for p in processes:
        p.start()
    got = sorted((q.get(timeout=20) for _ in processes), key=lambda item: item["value"])
    for p in processes:
        p.join(20)
        assert p.exitcode == 0
    for i, item in enumerate(got):
        assert item["value"] == i and torch.equal(item["t"], torch.full((1000,), float(i)))
        assert forkpool.is_shared(item["t"])


def test_a_queue_in_a_pool_worker_is_a_clear_error_and_the_pool_serves_on():
    q = forkpool.Queue()
    _inherited["queue"] = q
    with forkpool.Pool(1) as pool:
        with pytest.raises(RuntimeError, match="pool's worker"):
            pool.apply(put_square, (3,))
        assert pool.apply(abs, (-3,)) == 3


def test_a_process_reports_its_exit_code_and_minus_the_signal_that_ended_it():
    p = forkpool.Process(target=time.sleep, args=(30,))
    p.start()
    assert p.is_alive() and p.pid > 0
    p.join(0.05)
    assert p.exitcode is None
    p.kill()
    p.join(20)
    assert p.exitcode == -signal.SIGKILL and not p.is_alive()
    p = forkpool.Process(target=time.sleep, args=(30,))
    p.start()
    p.terminate()
    p.join(20)
    assert p.exitcode == -signal.SIGTERM


def test_spawn_runs_each_rank_and_returns_after_all():
    q = forkpool.Queue()
    assert forkpool.spawn(rank_puts, args=(q,), nprocs=3) is None
    assert sorted(q.get(timeout=20) for _ in range(3)) == [0, 1, 2]
    context = forkpool.spawn(rank_puts, args=(q,), nprocs=2, join=False)
    assert len(context.pids()) == 2
    while not context.join(20):
        pass


def test_spawn_raises_the_first_failure_and_ends_the_other_ranks():
    with pytest.raises(forkpool.ProcessRaisedException) as raised:
        forkpool.spawn(rank_raises, nprocs=2)
    assert raised.value.error_index == 1
    assert "ValueError: rank 1 failed" in str(raised.value)
    assert raised.value is not None and isinstance(raised.value, torch.multiprocessing.ProcessRaisedException)
    with pytest.raises(forkpool.ProcessExitedException) as exited:
        forkpool.spawn(rank_exits, args=(3,), nprocs=2)
    assert exited.value.error_index == 0 and exited.value.exit_code == 3
    with pytest.raises(forkpool.ProcessExitedException) as killed:
        forkpool.spawn(rank_kills_itself, nprocs=2)
    assert killed.value.signal_name == "SIGKILL" and killed.value.error_index == 1


def test_ctrl_c_during_a_queue_get_ends_the_wait():
    q = forkpool.Queue()
    timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        q.get(timeout=20)
    assert time.monotonic() - started < scaled(5)
