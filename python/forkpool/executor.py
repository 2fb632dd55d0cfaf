"""forkpool.Executor: a concurrent.futures.Executor on a forkpool Pool.

submit() gives a concurrent.futures.Future, so as_completed, wait, asyncio's run_in_executor and
wrap_future work. A pool belongs to the thread that made it and runs its loop while that thread
waits; so the Executor's pool lives on a thread of its own, which takes submissions and settles
futures, while the program's threads submit and wait as they like.

A killed worker fails its own future (forkpool.WorkerLost) and the executor goes on, where
CPython's ProcessPoolExecutor breaks for good (BrokenProcessPool).
"""

from __future__ import annotations

import concurrent.futures
import itertools
import os
import queue
import threading
from typing import Any, Callable, Iterable, Iterator, Optional

from . import _forkpool, _worker
from .pool import AsyncResult, Pool

__all__ = ["Executor"]

# How long the executor's thread drives the pool before it looks for new submissions.
_POLL = 0.001


def _process_chunk(fn: Callable, chunk: list) -> list:
    return [fn(*args) for args in chunk]


def _chain_results(chunks: Iterator) -> Iterator:
    for chunk in chunks:
        yield from chunk


class Executor(concurrent.futures.Executor):
    def __init__(self, max_workers: Optional[int] = None, mp_context: Any = None,
                 initializer: Optional[Callable] = None, initargs: tuple = ()) -> None:
        if max_workers is None:
            max_workers = os.cpu_count() or 1
        if max_workers <= 0:
            raise ValueError("max_workers must be greater than 0")
        if mp_context is not None and not isinstance(mp_context, str):
            mp_context = mp_context.get_start_method()
        self._max_workers = max_workers
        self._submissions: queue.SimpleQueue = queue.SimpleQueue()
        self._shutdown_lock = threading.Lock()
        self._shutdown = False
        started: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name="forkpool.Executor", daemon=True,
                                        args=(mp_context, initializer, initargs, started))
        self._thread.start()
        error = started.get()
        if error is not None:
            self._thread.join()
            raise error

    def submit(self, fn: Callable, /, *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        with self._shutdown_lock:
            if self._shutdown:
                raise RuntimeError("cannot schedule new futures after shutdown")
            future: concurrent.futures.Future = concurrent.futures.Future()
            self._submissions.put((future, fn, args, kwargs))
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
            if not self._shutdown:
                self._shutdown = True
                self._submissions.put(("shutdown", cancel_futures))
        if wait:
            self._thread.join()

    # The executor's thread: owns the pool, sends what is submitted, settles what finishes.
    def _serve(self, mp_context: Optional[str], initializer: Optional[Callable], initargs: tuple,
               started: queue.SimpleQueue) -> None:
        try:
            pool = Pool(self._max_workers, initializer=initializer, initargs=initargs, start_method=mp_context)
        except BaseException as error:  # noqa: B036 - told to the constructor
            started.put(error)
            return
        started.put(None)
        self._running: dict = {}  # token -> (the call, its Future), sent and not settled
        self._tokens = itertools.count()
        self._done = _forkpool.DoneTokens()
        closing = False
        with pool:
            while not (closing and not self._running):
                closing = self._take_submissions(pool, block=not self._running) or closing
                if self._running:
                    self._settle(pool)

    def _take_submissions(self, pool: Pool, block: bool) -> bool:
        """Sends what was submitted; True once shutdown was asked for."""
        closing = False
        while True:
            try:
                item = self._submissions.get(block=block)
            except queue.Empty:
                return closing
            block = False
            if item[0] == "shutdown":
                closing = True
                if item[1]:  # cancel_futures: what has not been sent never runs
                    while True:
                        try:
                            pending = self._submissions.get_nowait()
                        except queue.Empty:
                            break
                        pending[0].cancel()
                continue
            future, fn, args, kwargs = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                call = pool._submit(_worker.CALL, fn, (args, kwargs))
            except BaseException as error:  # noqa: B036 - cannot be pickled, say
                future.set_exception(error)
                continue
            token = next(self._tokens)
            call.notify_done(self._done, token)
            self._running[token] = (call, future)

    def _settle(self, pool: Pool) -> None:
        """Drives the pool a while; settles the futures whose results came."""
        for token in pool._core.take_done(self._done, _POLL):
            call, future = self._running.pop(token)
            outcome = AsyncResult._peek(call)
            if outcome[0] == "ok":
                future.set_result(outcome[1])
            else:
                future.set_exception(outcome[1])
