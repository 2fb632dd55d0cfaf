"""forkpool.Pool: multiprocessing.Pool's methods and meanings, on forkpool's workers and rings.

Each call (apply_async's, or a chunk of a map) is one forkpool task: the function and its
arguments are pickled (protocol 5, tensors out of band as shared memory, forkpool._pickling) and
the single-threaded C++ loop of the thread that made the pool sends it to a worker. There are no
helper threads: the loop runs while the program waits (get, wait, map, join, iterating imap), with
the GIL released. So callbacks run on the pool's thread, inside such a wait, and a pool is used
from the thread that made it (another thread gets RuntimeError).

A task whose worker dies fails alone with WorkerLost; the pool starts a new worker and goes on.
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
import pickle
import time
import warnings
from typing import Any, Callable, Iterable, Iterator, Optional

from . import _forkpool, _pickling, _spawn, _worker

__all__ = ["Pool", "AsyncResult", "ApplyResult", "MapResult", "IMapIterator", "TimeoutError", "WorkerLost"]

TimeoutError = multiprocessing.TimeoutError
WorkerLost = _forkpool.WorkerLost

_RUN, _CLOSE, _TERMINATE = "RUN", "CLOSE", "TERMINATE"

# The most a side polls for the other's message before it sleeps, in seconds (PoolOptions::spin:
# adaptive within it, off while the CPUs are oversubscribed). C++'s default (50 us) is shorter
# than a Python call takes to pickle, run and unpickle: its waits would all end asleep.
_DEFAULT_SPIN = 200e-6


class AsyncResult:
    """The result of apply_async, or of map_async (one call a chunk): CPython's ApplyResult."""

    __slots__ = ("_pool", "_calls", "_unpack", "_callback", "_error_callback", "_outcome", "_left", "__weakref__")

    def __init__(self, pool: "Pool", calls: list, callback: Optional[Callable], error_callback: Optional[Callable],
                 unpack: Optional[Callable[[list], Any]]) -> None:
        self._pool = pool
        self._calls = calls
        self._unpack = unpack  # None: the one call's value itself
        self._callback = callback
        self._error_callback = error_callback
        self._outcome: Optional[tuple] = None  # ("ok", value) or ("error", exception)
        self._left = len(calls)
        if not calls:
            self._settle()
        elif callback is not None or error_callback is not None:
            # Told as each call is ready (inside a wait on the pool's thread), to run the
            # callbacks; a result without them is settled when it is asked.
            for call in calls:
                call.when_ready(self._one_ready)

    def _one_ready(self) -> None:
        self._left -= 1
        if self._left == 0 or (self._outcome is None and not self._ok_so_far()):
            self._settle()

    def _ok_so_far(self) -> bool:
        return all(self._peek(call)[0] == "ok" for call in self._calls if call.ready())

    @staticmethod
    def _peek(call: Any) -> tuple:
        try:
            data, tensors = call.get()
        except BaseException as error:  # WorkerLost, PoolTerminated, Cancelled...
            return ("error", error)
        ok, value = _worker.outcome_of(data, tensors)
        return ("ok", value) if ok else ("error", value)

    def _settle(self) -> None:
        if self._outcome is not None:
            return
        values = []
        for call in self._calls:
            if not call.ready():
                continue
            outcome = self._peek(call)
            if outcome[0] != "ok":
                self._outcome = outcome
                break
            values.append(outcome[1])
        else:
            if len(values) < len(self._calls):
                return
            if self._unpack is None:
                self._outcome = ("ok", values[0])
            else:
                try:
                    self._outcome = ("ok", self._unpack(values))
                except BaseException as error:
                    self._outcome = ("error", error)
        if self._callback is None and self._error_callback is None:
            return
        self._pool._settled(self)
        if self._outcome[0] == "ok" and self._callback is not None:
            self._callback(self._outcome[1])
        if self._outcome[0] == "error" and self._error_callback is not None:
            self._error_callback(self._outcome[1])

    def ready(self) -> bool:
        if self._outcome is None:
            for call in self._calls:
                if not call.ready():
                    return False
            self._settle()
        return self._outcome is not None

    def successful(self) -> bool:
        if not self.ready():
            raise ValueError(f"{self!r} not ready")
        return self._outcome[0] == "ok"

    def wait(self, timeout: Optional[float] = None) -> None:
        if self._outcome is not None:
            return
        if len(self._calls) == 1:
            self._calls[0].wait(timeout)
        else:
            deadline = None if timeout is None else time.monotonic() + timeout
            for call in self._calls:
                left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
                if self._outcome is not None or not call.wait(left):
                    return
        self.ready()

    def get(self, timeout: Optional[float] = None) -> Any:
        if self._outcome is None:
            self.wait(timeout)
            if not self.ready():
                raise TimeoutError
        if self._outcome[0] == "ok":
            return self._outcome[1]
        raise self._outcome[1]  # its __cause__: the worker's traceback (_peek)

    def cancel(self) -> None:
        """forkpool's: stops the work behind this result (a running task's worker is replaced);
        get() then raises forkpool.Cancelled."""
        for call in self._calls:
            call.cancel()


# apply_async's result without callbacks: AsyncResult's methods in C++ (ready, wait, get,
# successful, cancel), with no Python frame per call and nothing for the collector to scan.
ApplyResult = _forkpool.ApplyResult
MapResult = AsyncResult


# imap's and imap_unordered's results, in C++ (the input read as the workers take it, up to
# _IMAP_WINDOW calls ahead of the results handed out; CPython reads it all at once): __next__ and
# next(timeout).
IMapIterator = _forkpool.IMapIterator

# How many calls imap keeps sent ahead of what was handed out: enough that a worker never waits
# for the next while the parent hands results out.
_IMAP_WINDOW = 256


def _chunks(iterable: Iterable, size: int) -> Iterator[list]:
    it = iter(iterable)
    while True:
        chunk = list(itertools.islice(it, size))
        if not chunk:
            return
        yield chunk


def worker_setup(start_method: str, initializer: Optional[Callable], initargs: Iterable) -> Optional[bytes]:
    """What each worker runs before its first task (forkpool._worker.initialize): under spawn,
    CPython's preparation; then the initializer. None when there is nothing to run."""
    pickled_initializer = None
    if initializer is not None:
        pickled_initializer, tensors = _pickling.dumps((initializer, tuple(initargs)), out_of_band=False)
        if tensors:
            raise TypeError("forkpool: an initializer's arguments cannot hold tensors")
    preparation = None
    if start_method == "spawn":
        preparation = _spawn.preparation()
        _forkpool.set_spawn_program(_spawn.spawn_command())
    if preparation is None and pickled_initializer is None:
        return None
    return pickle.dumps((preparation, pickled_initializer), 5)


class Pool:
    """multiprocessing.Pool on forkpool. start_method: 'fork' (the default, as CPython's on Linux),
    'forkserver' (workers forked from a server forked when the pool is made) or 'spawn' (each
    worker a fresh interpreter that imports the main module as __mp_main__, as CPython's). forkpool's own
    options are keywords: task_timeout (seconds), max_retries, seed, spin (seconds)."""

    def __init__(self, processes: Optional[int] = None, initializer: Optional[Callable] = None,
                 initargs: Iterable = (), maxtasksperchild: Optional[int] = None,
                 start_method: Optional[str] = None, *, context: Any = None, task_timeout: Optional[float] = None,
                 max_retries: int = 0, seed: int = 0, spin: Optional[float] = None) -> None:
        if processes is None:
            processes = os.cpu_count() or 1
        if processes < 1:
            raise ValueError("Number of processes must be at least 1")
        if maxtasksperchild is not None and (not isinstance(maxtasksperchild, int) or maxtasksperchild <= 0):
            raise ValueError("maxtasksperchild must be a positive int or None")
        if initializer is not None and not callable(initializer):
            raise TypeError("initializer must be a callable")
        if start_method is None and context is not None:
            start_method = context.get_start_method()
        self._processes = processes
        self._state = _RUN
        self._pending: set = set()
        start_method = start_method or "fork"
        setup = worker_setup(start_method, initializer, initargs)
        if spin is None:
            spin = _DEFAULT_SPIN
        self._core = _forkpool.CorePool(processes=processes, maxtasksperchild=maxtasksperchild or 0,
                                        setup=setup, start_method=start_method,
                                        max_retries=max_retries, task_timeout=task_timeout or 0.0, seed=seed,
                                        spin=spin)

    # What CPython's Pool raises for work after close() or terminate().
    def _check_running(self) -> None:
        if self._state != _RUN:
            raise ValueError("Pool not running")

    def _submit(self, kind: int, func: Callable, argument: Any) -> Any:
        """Sends func's call (_worker.CALL, MAP or STARMAP) on `argument`; its CallResult."""
        return self._core.submit(*self._pickle_call(kind, func, argument))

    @staticmethod
    def _pickle_call(kind: int, func: Callable, argument: Any) -> tuple:
        """What a call sends: (kind, the function's kept pickle or b"", the pickle of the argument,
        or of the function and the argument, the tensors it names)."""
        function = _pickling.pickled_function(func)
        if function is None:
            return (kind, b"", *_pickling.dumps((func, argument)))
        # apply(f, (1, "a")), imap(f, range(n)): plain values, pickled by pickle itself.
        if _pickling.is_plain(argument[0]) and not argument[1] if kind == _worker.CALL else _pickling.is_plain(argument):
            return (kind, function, pickle.dumps(argument, 5), [])
        return (kind, function, *_pickling.dumps(argument))

    def _settled(self, result: AsyncResult) -> None:
        self._pending.discard(result)

    def _track(self, result: AsyncResult) -> AsyncResult:
        if (result._callback is not None or result._error_callback is not None) and not result.ready():
            self._pending.add(result)  # join() runs its callbacks if nobody waited for it
        return result

    def apply(self, func: Callable, args: tuple = (), kwds: dict = {}) -> Any:
        return self.apply_async(func, args, kwds).get()

    def apply_async(self, func: Callable, args: tuple = (), kwds: dict = {}, callback: Optional[Callable] = None,
                    error_callback: Optional[Callable] = None) -> AsyncResult:
        if self._state != _RUN:
            raise ValueError("Pool not running")
        if callback is None and error_callback is None:
            return self._core.apply_call(func, args, kwds)
        call = self._submit(_worker.CALL, func, (args, kwds))
        return self._track(AsyncResult(self, [call], callback, error_callback, None))

    def _map_async(self, func: Callable, iterable: Iterable, kind: int, chunksize: Optional[int],
                   callback: Optional[Callable], error_callback: Optional[Callable]) -> AsyncResult:
        self._check_running()
        if not hasattr(iterable, "__len__"):
            iterable = list(iterable)
        if chunksize is None:
            chunksize, extra = divmod(len(iterable), self._processes * 4)
            if extra:
                chunksize += 1
        if len(iterable) == 0:
            chunksize = 0
        calls = [self._submit(kind, func, chunk) for chunk in _chunks(iterable, max(chunksize, 1))]
        flatten = lambda values: list(itertools.chain.from_iterable(values))  # noqa: E731
        return self._track(AsyncResult(self, calls, callback, error_callback, flatten))

    def map(self, func: Callable, iterable: Iterable, chunksize: Optional[int] = None) -> list:
        return self._map_async(func, iterable, _worker.MAP, chunksize, None, None).get()

    def map_async(self, func: Callable, iterable: Iterable, chunksize: Optional[int] = None,
                  callback: Optional[Callable] = None, error_callback: Optional[Callable] = None) -> AsyncResult:
        return self._map_async(func, iterable, _worker.MAP, chunksize, callback, error_callback)

    def starmap(self, func: Callable, iterable: Iterable, chunksize: Optional[int] = None) -> list:
        return self._map_async(func, iterable, _worker.STARMAP, chunksize, None, None).get()

    def starmap_async(self, func: Callable, iterable: Iterable, chunksize: Optional[int] = None,
                      callback: Optional[Callable] = None, error_callback: Optional[Callable] = None) -> AsyncResult:
        return self._map_async(func, iterable, _worker.STARMAP, chunksize, callback, error_callback)

    def imap(self, func: Callable, iterable: Iterable, chunksize: int = 1) -> IMapIterator:
        return self._imap(func, iterable, chunksize, True)

    def imap_unordered(self, func: Callable, iterable: Iterable, chunksize: int = 1) -> IMapIterator:
        return self._imap(func, iterable, chunksize, False)

    def _imap(self, func: Callable, iterable: Iterable, chunksize: int, ordered: bool) -> IMapIterator:
        self._check_running()
        if chunksize < 1:
            raise ValueError(f"Chunksize must be 1+, not {chunksize:n}")
        function = _pickling.pickled_function(func)
        if function is None:  # pickled with each chunk
            return self._core.imap(_worker.MAP, b"", lambda chunk: _pickling.dumps((func, chunk)), iter(iterable),
                                   chunksize, ordered, _IMAP_WINDOW)
        return self._core.imap(_worker.MAP, function, _pickling.dumps, iter(iterable), chunksize, ordered,
                               _IMAP_WINDOW)

    def close(self) -> None:
        if self._state == _RUN:
            self._state = _CLOSE
            self._core.close()

    def terminate(self) -> None:
        self._state = _TERMINATE
        self._core.terminate()

    def join(self) -> None:
        if self._state == _RUN:
            raise ValueError("Pool is still running")
        self._core.join()
        for result in list(self._pending):  # their callbacks, as CPython's result handler runs them
            result.ready()

    def worker_pids(self) -> list:
        """forkpool's: the pids of the workers now."""
        return self._core.worker_pids()

    def __del__(self, _warn: Callable = warnings.warn) -> None:
        if getattr(self, "_state", None) == _RUN:
            _warn(f"unclosed running multiprocessing pool {self!r}", ResourceWarning, source=self)

    def __enter__(self) -> "Pool":
        self._check_running()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.terminate()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} state={self._state} pool_size={self._processes}>"

    def __reduce__(self) -> Any:
        raise NotImplementedError("pool objects cannot be passed between processes or pickled")
