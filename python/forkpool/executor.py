"""forkpool.Executor: a concurrent.futures.Executor on a forkpool pool.

submit() gives a concurrent.futures.Future, so as_completed, wait, asyncio's run_in_executor and
wrap_future work. The pool lives on a C++ thread of its own (forkpool._forkpool.CoreExecutor),
whose loop sends the calls and settles their futures, taking the GIL once for each batch of
finished calls; the program's threads pickle their calls and submit from wherever they are.

A killed worker fails its own future (forkpool.WorkerLost) and the executor goes on, where
CPython's ProcessPoolExecutor breaks for good (BrokenProcessPool). A future is set running when
its result is there: until then cancel() succeeds (the call's result is then dropped), and
shutdown(cancel_futures=True) cancels every future not yet settled and stops its call.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import os
import threading
import weakref
from typing import Any, Callable, Iterable, Iterator, Optional

from . import _forkpool
from .pool import _DEFAULT_SPIN, worker_setup

__all__ = ["Executor"]


def _process_chunk(fn: Callable, chunk: list) -> list:
    return [fn(*args) for args in chunk]


def _chain_results(chunks: Iterator) -> Iterator:
    for chunk in chunks:
        yield from chunk


class Future(concurrent.futures.Future):
    """A concurrent.futures.Future whose condition is a _forkpool.FutureCondition: one object the
    cyclic collector does not track, where threading.Condition is eight (with 100,000 futures
    alive, the collector's passes over them were most of a submit's time)."""

    def __init__(self) -> None:
        self._condition = _forkpool.FutureCondition()
        self._state = concurrent.futures._base.PENDING
        self._result = None
        self._exception = None
        self._waiters: list = []
        self._done_callbacks: list = []


# Future.__init__ sets these and no more (CPython 3.11): one that sets others is used as it is.
if set(vars(concurrent.futures.Future())) != set(vars(Future())):
    Future = concurrent.futures.Future  # type: ignore[misc] # noqa: F811


# Executors still running at the interpreter's exit: shut down (waiting for their calls) before it
# finalizes, as CPython's executors are; their threads take the GIL to settle futures.
_live: "weakref.WeakSet[Executor]" = weakref.WeakSet()


def _shutdown_all() -> None:
    for executor in list(_live):
        executor.shutdown(wait=True)


threading._register_atexit(_shutdown_all)  # (CPython's concurrent.futures does the same)


class Executor(concurrent.futures.Executor):
    def __init__(self, max_workers: Optional[int] = None, mp_context: Any = None,
                 initializer: Optional[Callable] = None, initargs: tuple = ()) -> None:
        if max_workers is None:
            max_workers = os.cpu_count() or 1
        if max_workers <= 0:
            raise ValueError("max_workers must be greater than 0")
        if initializer is not None and not callable(initializer):
            raise TypeError("initializer must be a callable")
        if mp_context is not None and not isinstance(mp_context, str):
            mp_context = mp_context.get_start_method()
        start_method = mp_context or "fork"
        self._max_workers = max_workers
        self._core = _forkpool.CoreExecutor(processes=max_workers,
                                            setup=worker_setup(start_method, initializer, initargs),
                                            start_method=start_method, spin=_DEFAULT_SPIN)
        self._shutdown_lock = threading.Lock()
        self._shutdown = False
        _live.add(self)

    def submit(self, fn: Callable, /, *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        with self._shutdown_lock:
            if self._shutdown:
                raise RuntimeError("cannot schedule new futures after shutdown")
            future: concurrent.futures.Future = Future()
            try:
                self._core.submit(future, fn, args, kwargs)
            except Exception as error:  # cannot be pickled, say: the future says so
                future.set_exception(error)
            return future

    def map(self, fn: Callable, *iterables: Iterable, timeout: Optional[float] = None,
            chunksize: int = 1) -> Iterator:
        if chunksize < 1:
            raise ValueError("chunksize must be >= 1.")
        if chunksize == 1:
            return super().map(fn, *iterables, timeout=timeout)
        zipped = zip(*iterables)
        chunks = iter(lambda: list(itertools.islice(zipped, chunksize)), [])
        return _chain_results(super().map(_process_chunk, itertools.repeat(fn), chunks, timeout=timeout))

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._shutdown_lock:
            self._shutdown = True
        self._core.shutdown(wait, cancel_futures)
        if wait:
            _live.discard(self)
