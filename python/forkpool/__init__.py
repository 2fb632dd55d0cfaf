"""forkpool for Python: torch.multiprocessing's Pool on forkpool's workers, rings and slabs.

    import forkpool
    with forkpool.Pool(4) as pool:
        print(pool.map(abs, range(-5, 5)))

Calls cross as pickle protocol 5; CPU tensors in them cross as forkpool shared memory (moved
there in place on their first send, as torch.multiprocessing does), never as bytes. A task whose
worker dies raises WorkerLost and the pool goes on. See docs/python.md.
"""

from multiprocessing import TimeoutError

import torch  # before _forkpool: its casters need torch's Python types

from ._forkpool import Cancelled, InitializerError, PoolTerminated, ProtocolError, WorkerLost
from ._forkpool import is_shared as _is_shared
from ._forkpool import share_memory_ as _share_memory
from ._worker import MaybeEncodingError, RemoteTraceback
from .data import DataLoader, get_worker_info
from .executor import Executor
from .pool import AsyncResult, IMapIterator, Pool
from .processes import (Process, ProcessContext, ProcessExitedException, ProcessRaisedException, spawn,
                        start_processes)
from .queues import Queue, SimpleQueue

__all__ = ["Executor", "DataLoader", "get_worker_info", "Pool", "AsyncResult", "IMapIterator", "Queue", "SimpleQueue", "Process", "spawn", "start_processes",
           "ProcessContext", "ProcessRaisedException", "ProcessExitedException", "TimeoutError", "WorkerLost", "Cancelled", "InitializerError",
           "PoolTerminated", "ProtocolError", "RemoteTraceback", "MaybeEncodingError", "is_shared",
           "share_memory_", "get_all_sharing_strategies", "get_sharing_strategy", "set_sharing_strategy"]


def is_shared(tensor: torch.Tensor) -> bool:
    """Whether `tensor`'s memory is forkpool shared memory (it then crosses without a copy)."""
    return _is_shared(tensor)


def share_memory_(tensor: torch.Tensor) -> torch.Tensor:
    """Moves `tensor`'s storage into forkpool shared memory in place; returns it."""
    with torch.no_grad():
        return _share_memory(tensor)


_strategy = "file_descriptor"


def get_all_sharing_strategies() -> set:
    """torch.multiprocessing's names. file_descriptor: blocks of sealed memfd slabs, a descriptor
    per slab (not per tensor); file_system is accepted and means the same here."""
    return {"file_descriptor", "file_system"}


def get_sharing_strategy() -> str:
    return _strategy


def set_sharing_strategy(new_strategy: str) -> None:
    global _strategy
    if new_strategy not in get_all_sharing_strategies():
        raise ValueError(f"forkpool: unknown sharing strategy {new_strategy!r}")
    _strategy = new_strategy
