"""forkpool.DataLoader: torch.utils.data.DataLoader's arguments and meanings, its batches made in
forked workers and sent as forkpool shared memory (a descriptor per slab, not one per tensor).

Indices are drawn as torch's DataLoader draws them (its own samplers, in the same order from the
same generator), so the same dataset, sampler and generator give the same batches.

- Map-style datasets: each batch is one task of a forkpool Pool, `collate_fn([dataset[i] for i in
  indices])` in a worker; at most prefetch_factor * num_workers batches are in flight, and they
  are handed out in order. A worker killed mid-epoch fails the epoch naming it.
- Iterable datasets: each worker is a Process iterating its own copy of the dataset (shard it
  with get_worker_info()), its batches taken round robin, as torch's.

Workers are forked from the loader's process (so lambdas and closures work as datasets and
collate functions): made for each epoch, or once with persistent_workers. Leaving an epoch
early, or dropping the loader, ends them at once.
"""

from __future__ import annotations

import itertools
import multiprocessing
import pickle
import queue
import random
import traceback
import weakref
from typing import Any, Callable, Optional

import torch
import torch.utils.data
from torch.utils.data import IterableDataset
from torch.utils.data._utils import collate as torch_collate
from torch.utils.data._utils import worker as torch_worker

from . import _forkpool
from .pool import Pool
from .processes import Process
from .queues import Queue

__all__ = ["DataLoader", "get_worker_info"]

get_worker_info = torch.utils.data.get_worker_info

def _collate_tensors_into_a_slab(batch: list, *, collate_fn_map: Any = None) -> torch.Tensor:
    # torch's collate_tensor_fn stacks into new shared memory of torch's own (a descriptor and a
    # mapping per batch), which would then be copied into a slab to cross: stack into one here.
    elem = batch[0]
    shape = (len(batch), *elem.shape)
    numel = len(batch) * elem.numel()
    out = _forkpool.empty_bytes(max(numel * elem.element_size(), 1))[:numel * elem.element_size()]
    return torch.stack(batch, 0, out=out.view(elem.dtype).view(shape))


_collate_map = dict(torch_collate.default_collate_fn_map)
_collate_map[torch.Tensor] = _collate_tensors_into_a_slab


def _default_collate(batch: list) -> Any:
    """torch's default_collate, its tensors stacked into forkpool shared memory."""
    return torch_collate.collate(batch, collate_fn_map=_collate_map)


# What workers find by key: a loader's dataset and functions, inherited through the fork that
# started them (so nothing of them is pickled), or, in a spawned worker, installed from a pickle.
_loaders: dict = {}
_next_key = itertools.count()


def _install_loader(key: int, state: bytes) -> None:
    """A spawned worker's initializer: its copy of loader `key`'s dataset and functions."""
    _loaders[key] = pickle.loads(state)


def _become_worker(state: dict, worker_id: int, num_workers: int, base_seed: int) -> Any:
    """Seeds this worker and tells torch who it is, as torch's worker loop does."""
    seed = base_seed + worker_id
    random.seed(seed)
    torch.manual_seed(seed)
    dataset = state["dataset"]
    torch_worker._worker_info = torch_worker.WorkerInfo(id=worker_id, num_workers=num_workers, seed=seed,
                                                         dataset=dataset)
    if state["worker_init_fn"] is not None:
        state["worker_init_fn"](worker_id)
    return dataset


def _fetch(dataset: Any, indices: Any, state: dict) -> Any:
    if not state["auto_collation"]:
        return state["collate_fn"](_sample(dataset, indices))
    return state["collate_fn"]([_sample(dataset, i) for i in indices])


def _sample(dataset: Any, index: Any) -> Any:
    try:
        return dataset[index]
    except Exception as error:
        error.add_note(f"forkpool.DataLoader: raised by the sample at index {index!r} "
                       f"(worker {torch_worker._worker_info.id if torch_worker._worker_info else 'main'})")
        raise


# The task of a map-style batch, in a pool's worker.
_worker_epoch: dict = {}


def _map_batch(job: tuple) -> Any:
    key, base_seed, indices = job
    state = _loaders[key]
    if _worker_epoch.get(key) != base_seed:  # this worker's first batch of the epoch
        worker_id, num_workers, _ = _forkpool.worker_info()
        _become_worker(state, worker_id, num_workers, base_seed)
        _worker_epoch[key] = base_seed
    return _fetch(state["dataset"], indices, state)


class _WorkerDone:
    pass


class _WorkerFailed:
    def __init__(self, error: BaseException) -> None:
        self.error = error
        self.tb = "".join(traceback.format_exception(type(error), error, error.__traceback__))


def _iterable_worker(key: int, worker_id: int, num_workers: int, base_seed: int, out: Queue) -> None:
    state = _loaders[key]
    try:
        dataset = _become_worker(state, worker_id, num_workers, base_seed)
        it = iter(dataset)
        batch_size = state["batch_size"]
        while True:
            if not state["auto_collation"]:
                item = next(it, _WorkerDone)
                if item is _WorkerDone:
                    break
                out.put(state["collate_fn"](item))
                continue
            batch = list(itertools.islice(it, batch_size))
            if not batch or (len(batch) < batch_size and state["drop_last"]):
                break
            out.put(state["collate_fn"](batch))
        out.put(_WorkerDone())
    except BaseException as error:  # noqa: B036 - the worker's end, whatever it is
        try:
            out.put(_WorkerFailed(error))
        except Exception:
            out.put(_WorkerFailed(RuntimeError(f"{type(error).__name__}: {error}")))


class DataLoader:
    def __init__(self, dataset: Any, batch_size: Optional[int] = 1, shuffle: Optional[bool] = None,
                 sampler: Any = None, batch_sampler: Any = None, num_workers: int = 0,
                 collate_fn: Optional[Callable] = None, pin_memory: bool = False, drop_last: bool = False,
                 timeout: float = 0, worker_init_fn: Optional[Callable] = None, multiprocessing_context: Any = None,
                 generator: Optional[torch.Generator] = None, *, prefetch_factor: int = 2,
                 persistent_workers: bool = False) -> None:
        # torch's own checks and samplers: the same errors, and indices drawn the same way.
        self._torch = torch.utils.data.DataLoader(
            dataset, batch_size=batch_size, shuffle=shuffle, sampler=sampler, batch_sampler=batch_sampler,
            num_workers=num_workers, collate_fn=collate_fn, drop_last=drop_last, timeout=timeout,
            worker_init_fn=worker_init_fn, generator=generator, prefetch_factor=prefetch_factor,
            persistent_workers=persistent_workers)
        if multiprocessing_context is not None and not isinstance(multiprocessing_context, str):
            multiprocessing_context = multiprocessing_context.get_start_method()
        supported = ("fork", "forkserver") if isinstance(dataset, IterableDataset) else ("fork", "forkserver", "spawn")
        if multiprocessing_context not in (None,) + supported:
            raise ValueError(f"forkpool.DataLoader: multiprocessing_context {multiprocessing_context!r} is not "
                             f"supported for this dataset ({', '.join(supported)})")
        self.dataset = dataset
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.drop_last = drop_last
        self.timeout = timeout
        self.pin_memory = pin_memory  # no CUDA here: nothing to pin into
        self.generator = generator
        self.prefetch_factor = prefetch_factor
        self.persistent_workers = persistent_workers
        self.multiprocessing_context = multiprocessing_context or "fork"
        self.collate_fn = self._torch.collate_fn
        self.sampler = self._torch.sampler
        self.batch_sampler = self._torch.batch_sampler
        self._iterable = isinstance(dataset, IterableDataset)
        self._key = next(_next_key)
        worker_collate = _default_collate if collate_fn is None and self._torch._auto_collation else self.collate_fn
        _loaders[self._key] = {"dataset": dataset, "collate_fn": worker_collate, "worker_init_fn": worker_init_fn,
                               "auto_collation": self._torch._auto_collation, "batch_size": batch_size,
                               "drop_last": drop_last}
        self._pool: Optional[Pool] = None  # persistent workers (map-style)
        self._base_seed: Optional[int] = None
        self._epoch: Optional[weakref.ref] = None

    def __len__(self) -> int:
        return len(self._torch)

    def __iter__(self) -> "_Epoch":
        previous = self._epoch and self._epoch()
        if previous is not None:
            previous.close()
        if self.num_workers == 0:
            return iter(self._torch)  # in this process, as torch's
        sampler_iter = None if self._iterable else iter(self._torch._index_sampler)
        if self._base_seed is None or not self.persistent_workers:
            self._base_seed = torch.empty((), dtype=torch.int64).random_(generator=self.generator).item()
        epoch = _Epoch(self, sampler_iter, self._base_seed)
        self._epoch = weakref.ref(epoch)  # the loop holds it: leaving the loop ends the epoch
        return epoch

    def _workers(self) -> Pool:
        if self._pool is None:
            if self.multiprocessing_context == "spawn":
                # A fresh interpreter inherits nothing: each worker gets a pickled copy of the
                # dataset and functions, as torch's spawned workers do.
                state = pickle.dumps(_loaders[self._key], 5)
                self._pool = Pool(self.num_workers, start_method="spawn", initializer=_install_loader,
                                  initargs=(self._key, state))
            else:
                self._pool = Pool(self.num_workers, start_method=self.multiprocessing_context)
        return self._pool

    def _release_workers(self) -> None:
        if self._pool is not None:
            self._pool.terminate()
            self._pool.join()
            self._pool = None

    def close(self) -> None:
        """Ends the workers now (as dropping the loader does)."""
        epoch = getattr(self, "_epoch", None) and self._epoch()
        if epoch is not None:
            epoch.close()
        if getattr(self, "_pool", None) is not None:
            self._release_workers()

    def __del__(self) -> None:
        try:
            self.close()
        finally:
            _loaders.pop(getattr(self, "_key", None), None)


class _Epoch:
    """One pass over a DataLoader with workers."""

    def __init__(self, loader: DataLoader, sampler_iter: Any, base_seed: int) -> None:
        self._loader = loader
        self._timeout = loader.timeout if loader.timeout > 0 else None
        self._ended = False
        if loader._iterable:
            self._queues = [Queue(loader.prefetch_factor) for _ in range(loader.num_workers)]
            self._processes = [Process(target=_iterable_worker, daemon=True,
                                       args=(loader._key, w, loader.num_workers, base_seed, self._queues[w]))
                               for w in range(loader.num_workers)]
            for process in self._processes:
                process.start()
            self._live = list(range(loader.num_workers))
            self._turn = 0
        else:
            self._sampler_iter = sampler_iter
            self._base_seed = base_seed
            self._pool = loader._workers()
            self._in_flight: list = []
            self._window = loader.prefetch_factor * loader.num_workers
            self._fill()

    def __iter__(self) -> "_Epoch":
        return self

    def __len__(self) -> int:
        return len(self._loader)

    # Map-style: batches as pool tasks.
    def _fill(self) -> None:
        while len(self._in_flight) < self._window:
            indices = next(self._sampler_iter, None)
            if indices is None:
                return
            self._in_flight.append(self._pool.apply_async(_map_batch, ((self._loader._key, self._base_seed, indices),)))

    def _next_map_batch(self) -> Any:
        if not self._in_flight:
            raise StopIteration
        result = self._in_flight.pop(0)
        try:
            batch = result.get(self._timeout)
        except _forkpool.WorkerLost as lost:
            raise RuntimeError(f"DataLoader worker exited unexpectedly: {lost}") from lost
        except multiprocessing.TimeoutError as timed_out:
            raise RuntimeError(f"DataLoader timed out after {self._loader.timeout} seconds") from timed_out
        self._fill()
        return batch

    # Iterable: round robin over the workers' queues.
    def _next_iterable_batch(self) -> Any:
        while self._live:
            worker = self._live[self._turn % len(self._live)]
            item = self._get_from(worker)
            if isinstance(item, _WorkerDone):
                self._live.remove(worker)
                continue
            if isinstance(item, _WorkerFailed):
                item.error.add_note(f"forkpool.DataLoader: in worker {worker}:\n{item.tb}")
                raise item.error
            self._turn += 1
            return item
        raise StopIteration

    def _get_from(self, worker: int) -> Any:
        waited = 0.0
        while True:
            try:
                return self._queues[worker].get(timeout=0.1)
            except queue.Empty:
                waited += 0.1
            process = self._processes[worker]
            if not process.is_alive() and self._queues[worker].empty():
                raise RuntimeError(f"DataLoader worker (pid {process.pid}) exited unexpectedly with exit code "
                                   f"{process.exitcode}")
            if self._timeout is not None and waited >= self._timeout:
                raise RuntimeError(f"DataLoader timed out after {self._loader.timeout} seconds")

    def __next__(self) -> Any:
        if self._ended:
            raise StopIteration
        try:
            return self._next_iterable_batch() if self._loader._iterable else self._next_map_batch()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Ends the epoch: what is in flight is dropped; workers not kept for the next end now."""
        if self._ended:
            return
        self._ended = True
        if self._loader._iterable:
            for process in self._processes:
                if process.is_alive():
                    process.kill()
                process.join()
            return
        for result in self._in_flight:
            result.cancel()
        self._in_flight = []
        if not self._loader.persistent_workers:
            self._loader._release_workers()

    def __del__(self) -> None:
        if hasattr(self, "_ended"):
            self.close()
