"""forkpool.Queue: multiprocessing.Queue's methods on a forkpool Queue (a socket of messages and
a page of shared state). Objects cross by pickle, CPU tensors beside them as shared memory
(forkpool._pickling), with no feeder thread: put() has sent the item when it returns, so a tensor
put by a process that then exits still arrives whole.

A Queue is shared with another process by inheritance: made before the fork that starts a
Process, or passed in a Process's arguments (as CPython's rule says). A pool's workers close the
descriptors they inherit: there a Queue raises RuntimeError.
"""

from __future__ import annotations

import os
import queue
from typing import Any, Optional

from . import _forkpool, _pickling

__all__ = ["Queue", "SimpleQueue"]


class Queue:
    def __init__(self, maxsize: int = 0) -> None:
        if maxsize < 0:
            maxsize = 0
        self._core = _forkpool.CoreQueue(maxsize)
        self._closed = False
        self._maker = os.getpid()

    def _check_reachable(self) -> None:
        # A pool's worker closes the descriptors it inherited: a Queue it has from the fork that
        # started it no longer reaches the others.
        if os.getpid() != self._maker and _forkpool.in_pool_worker():
            raise RuntimeError("forkpool: a Queue cannot be used in a pool's worker (it closes what it inherits); "
                               "use it in a Process, or return the values as the task's result")

    def put(self, obj: Any, block: bool = True, timeout: Optional[float] = None) -> None:
        if self._closed:
            raise ValueError(f"Queue {self!r} is closed")
        self._check_reachable()
        data, tensors = _pickling.dumps(obj)
        if not self._core.put(data, tensors, timeout if block else 0.0):
            raise queue.Full

    def get(self, block: bool = True, timeout: Optional[float] = None) -> Any:
        self._check_reachable()
        item = self._core.get(timeout if block else 0.0)
        if item is None:
            raise queue.Empty
        return _pickling.loads(*item)

    def put_nowait(self, obj: Any) -> None:
        self.put(obj, False)

    def get_nowait(self) -> Any:
        return self.get(False)

    def qsize(self) -> int:
        return self._core.qsize()

    def empty(self) -> bool:
        return self.qsize() == 0

    def full(self) -> bool:
        return self._core.maxsize > 0 and self.qsize() >= self._core.maxsize

    def close(self) -> None:
        """This process puts no more."""
        self._closed = True
        self._core.close()

    def join_thread(self) -> None:
        """CPython's waits for its feeder thread; forkpool's Queue has none."""

    def cancel_join_thread(self) -> None:
        """CPython's lets its feeder thread go; forkpool's Queue has none."""

    def __reduce__(self) -> Any:
        raise RuntimeError("Queue objects should only be shared between processes through inheritance")


class SimpleQueue(Queue):
    """multiprocessing.SimpleQueue: get, put, empty, close."""

    def __init__(self) -> None:
        super().__init__(0)
