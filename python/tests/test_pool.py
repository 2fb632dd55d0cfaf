"""forkpool.Pool: CPython's Pool methods and meanings, forkpool's failure handling, tensors as
shared memory. Each test is bounded (get timeouts, pytest's own run by meson's timeout)."""

import multiprocessing
import os
import pickle
import signal
import threading
import time

import pytest
import torch

import forkpool
from support import scaled

pytestmark = pytest.mark.parametrize("start_method", ["fork", "forkserver", "spawn"])


def square(x):
    return x * x


def add(a, b):
    return a + b


def raise_value_error(x):
    raise ValueError("bad input", x)


def sleep_then(seconds, value=None):
    time.sleep(seconds)
    return value


def kill_myself(x):
    os.kill(os.getpid(), signal.SIGKILL)


def fill_in_place(t, value):
    t.fill_(value)
    return t.sum().item()


def same_tensor(t):
    return t


def make_tensor(n):
    return torch.arange(n, dtype=torch.float64)


def return_unpicklable(x):
    return lambda: x


_initialized = None


def set_initialized(value):
    global _initialized
    _initialized = value


def read_initialized(_):
    return _initialized


@pytest.fixture
def pool(start_method):
    with forkpool.Pool(2, start_method=start_method) as p:
        yield p


def test_apply_map_starmap_imap_return_what_cpython_returns(pool):
    assert pool.apply(add, (2, 3)) == 5
    assert pool.apply(add, (), {"a": 1, "b": 2}) == 3
    assert pool.apply_async(square, (7,)).get(10) == 49
    assert pool.map(square, range(100)) == [x * x for x in range(100)]
    assert pool.map(square, range(100), chunksize=7) == [x * x for x in range(100)]
    assert pool.map(square, []) == []
    assert pool.map_async(square, range(10)).get(10) == [x * x for x in range(10)]
    assert pool.starmap(add, [(1, 2), (3, 4)]) == [3, 7]
    assert pool.starmap_async(add, [(1, 2), (3, 4)]).get(10) == [3, 7]
    assert list(pool.imap(square, range(50))) == [x * x for x in range(50)]
    assert list(pool.imap(square, range(50), chunksize=8)) == [x * x for x in range(50)]
    assert sorted(pool.imap_unordered(square, range(50), chunksize=3)) == [x * x for x in range(50)]
    assert list(pool.imap(square, iter(range(5)))) == [0, 1, 4, 9, 16]


def test_a_task_that_raises_reraises_its_type_and_arguments_with_the_workers_traceback(pool):
    with pytest.raises(ValueError) as raised:
        pool.apply(raise_value_error, (3,))
    assert raised.value.args == ("bad input", 3)
    assert isinstance(raised.value.__cause__, forkpool.RemoteTraceback)
    assert "raise_value_error" in str(raised.value.__cause__)
    with pytest.raises(ValueError):
        pool.map(raise_value_error, range(4))
    assert pool.apply(square, (4,)) == 16, "the pool serves on"


def test_ready_successful_wait_and_a_get_that_times_out(pool):
    result = pool.apply_async(sleep_then, (0.5, "done"))
    assert not result.ready()
    with pytest.raises(ValueError):
        result.successful()
    with pytest.raises(multiprocessing.TimeoutError):
        result.get(timeout=0.05)
    assert forkpool.TimeoutError is multiprocessing.TimeoutError
    result.wait(10)
    assert result.ready() and result.successful()
    assert result.get() == "done"
    failed = pool.apply_async(raise_value_error, (1,))
    failed.wait(10)
    assert not failed.successful()


def test_get_and_wait_take_timeout_by_place_or_keyword_and_nothing_else(pool):
    result = pool.apply_async(sleep_then, (0.2, "done"))
    with pytest.raises(multiprocessing.TimeoutError):
        result.get(0.01)
    result.wait(timeout=10)
    assert result.get(timeout=None) == "done" and result.get(10) == "done"
    with pytest.raises(TypeError, match="at most 1 argument"):
        result.get(1, 2)
    with pytest.raises(TypeError, match="unexpected keyword argument 'seconds'"):
        result.wait(seconds=1)
    with pytest.raises(TypeError):
        result.get("soon")
    with pytest.raises(TypeError):  # made by apply_async only
        type(result)()


def test_callbacks_run_with_the_result_or_the_error(pool):
    results, errors = [], []
    pool.apply_async(square, (3,), callback=results.append).wait(10)
    pool.apply_async(raise_value_error, (1,), error_callback=errors.append).wait(10)
    pool.map_async(square, range(3), callback=results.append).wait(10)
    assert results == [9, [0, 1, 4]]
    assert len(errors) == 1 and isinstance(errors[0], ValueError)


def test_callbacks_of_work_not_waited_for_run_by_join(start_method):
    results = []
    pool = forkpool.Pool(2, start_method=start_method)
    for x in range(20):
        pool.apply_async(square, (x,), callback=results.append)
    pool.close()
    pool.join()
    assert sorted(results) == [x * x for x in range(20)]


def test_work_after_close_or_terminate_is_pool_not_running(start_method):
    pool = forkpool.Pool(1, start_method=start_method)
    pool.close()
    with pytest.raises(ValueError, match="Pool not running"):
        pool.apply_async(square, (1,))
    with pytest.raises(ValueError, match="Pool not running"):
        pool.map(square, [1])
    pool.join()
    pool = forkpool.Pool(1, start_method=start_method)
    with pytest.raises(ValueError):
        pool.join()  # still running
    pool.terminate()
    with pytest.raises(ValueError, match="Pool not running"):
        pool.imap(square, [1])
    pool.join()


def test_the_context_manager_terminates_its_workers(start_method):
    with forkpool.Pool(2, start_method=start_method) as pool:
        pids = pool.worker_pids()
        assert pool.map(square, range(4)) == [0, 1, 4, 9]
    pool.join()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_a_killed_worker_fails_only_its_task_and_the_pool_goes_on(pool):
    others = [pool.apply_async(sleep_then, (0.2, i)) for i in range(4)]
    doomed = pool.apply_async(kill_myself, (0,))
    with pytest.raises(forkpool.WorkerLost):
        doomed.get(20)
    assert [r.get(20) for r in others] == [0, 1, 2, 3]
    assert pool.map(square, range(20)) == [x * x for x in range(20)]
    assert len(pool.worker_pids()) == 2


def test_what_cannot_be_pickled_is_an_error_at_the_call_or_at_get_never_a_hang(pool):
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        pool.apply_async(square, (lambda: 1,))
    with pytest.raises(forkpool.MaybeEncodingError):
        pool.apply_async(return_unpicklable, (1,)).get(10)
    assert pool.apply(square, (5,)) == 25, "the pool serves on"


def test_the_initializer_runs_in_every_worker_before_its_tasks(start_method):
    with forkpool.Pool(2, initializer=set_initialized, initargs=("ready",), start_method=start_method) as pool:
        assert set(pool.map(read_initialized, range(8), chunksize=1)) == {"ready"}


def test_maxtasksperchild_replaces_workers(start_method):
    with forkpool.Pool(1, maxtasksperchild=2, start_method=start_method) as pool:
        pids = {pool.apply(os.getpid) for _ in range(6)}
        assert len(pids) == 3


def test_task_timeout_stops_a_task_that_runs_too_long(start_method):
    with forkpool.Pool(1, task_timeout=0.3, start_method=start_method) as pool:
        with pytest.raises(multiprocessing.TimeoutError):
            pool.apply(sleep_then, (30,))
        assert pool.apply(square, (3,)) == 9


def test_ctrl_c_during_get_ends_the_wait_at_once(pool):
    result = pool.apply_async(sleep_then, (30,))
    timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        result.get(20)
    assert time.monotonic() - started < scaled(5)
    pids = pool.worker_pids()
    pool.terminate()
    pool.join()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_a_workers_writes_to_a_tensor_argument_are_seen_by_the_caller(pool):
    t = torch.zeros(1000)
    assert not forkpool.is_shared(t)
    assert pool.apply(fill_in_place, (t, 2.0)) == 2000.0
    assert forkpool.is_shared(t), "moved into shared memory in place on its first send"
    assert torch.equal(t, torch.full((1000,), 2.0))
    nested = {"a": [t, (t,)]}
    assert pool.apply(fill_in_place, (nested["a"][1][0], 5.0)) == 5000.0
    assert t[0].item() == 5.0


def test_a_result_keeps_dtype_shape_strides_offset_and_shares_storage_with_its_views(pool):
    base = torch.arange(24, dtype=torch.int32).reshape(4, 6)
    view = base[1:, ::2]
    back = pool.apply(same_tensor, (view,))
    assert back.dtype == torch.int32 and back.shape == view.shape
    assert back.stride() == view.stride() and back.storage_offset() == view.storage_offset()
    assert torch.equal(back, view)
    assert back.data_ptr() == view.data_ptr(), "the parent's own memory came home"
    a, b = pool.apply(same_tensor, ((base[0], base[1]),))
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() if hasattr(a, "untyped_storage") \
        else a.storage().data_ptr() == b.storage().data_ptr()
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
                  torch.int16, torch.int64, torch.bool, torch.complex64):
        t = torch.ones(3, dtype=dtype)
        assert torch.equal(pool.apply(same_tensor, (t,)), t)


def test_tensors_made_by_workers_arrive_whole_and_kept_ones_cost_few_descriptors(pool):
    before = len(os.listdir("/proc/self/fd"))
    kept = [pool.apply_async(make_tensor, (256,)) for _ in range(2000)]
    kept = [r.get(30) for r in kept]
    assert all(torch.equal(t, torch.arange(256, dtype=torch.float64)) for t in kept)
    assert len(os.listdir("/proc/self/fd")) - before < 64


def test_cuda_sparse_and_quantized_tensors_are_refused_before_anything_is_sent(pool):
    with pytest.raises(TypeError, match="sparse"):
        pool.apply_async(same_tensor, (torch.eye(3).to_sparse(),))
    with pytest.raises(TypeError, match="quantized"):
        pool.apply_async(same_tensor, (torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.quint8),))
    assert pool.apply(square, (2,)) == 4
