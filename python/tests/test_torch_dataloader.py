"""torch's own DataLoader tests (test/test_dataloader.py: TestDataLoader, TestStringDataLoader,
TestDictDataLoader and its argument checks), translated to forkpool.DataLoader: the same
datasets and assertions, with workers. What differs is in docs/python.md ("torch's own
DataLoader tests"): the CUDA cases (pin_memory) do not apply without CUDA, and torch's private
attributes (the iterator's `workers`, `pin_thread`) are replaced by forkpool's pids."""

import math

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, IterableDataset, TensorDataset

import forkpool
from forkpool import DataLoader

torch.manual_seed(0)
DATA = torch.randn(100, 2, 3, 5)
LABELS = torch.randperm(50).repeat(2)
DATASET = TensorDataset(DATA, LABELS)


class ErrorDataset(Dataset):
    def __init__(self, size):
        self.size = size

    def __len__(self):
        return self.size


class StringDataset(Dataset):
    def __init__(self):
        self.s = "12345"

    def __len__(self):
        return len(self.s)

    def __getitem__(self, ndx):
        return (self.s[ndx], ndx)


class DictDataset(Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, ndx):
        return {"a_tensor": torch.empty(4, 2).fill_(ndx), "another_dict": {"a_number": ndx}}


class NumpyDataset(Dataset):
    def __getitem__(self, i):
        return np.ones((2, 3, 4)) * i

    def __len__(self):
        return 1000


class CountingIterable(IterableDataset):
    """torch's test_iterable_style_dataset pattern: each worker yields its own share."""

    def __init__(self, n):
        self.n = n

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        return iter(range(start, self.n, step))


def check_sequential(loader):
    batch_size = loader.batch_size
    for i, (sample, target) in enumerate(loader):
        idx = i * batch_size
        assert torch.equal(sample, DATA[idx:idx + batch_size])
        assert torch.equal(target, LABELS[idx:idx + batch_size])
    assert i == math.floor((len(DATASET) - 1) / batch_size)


def check_shuffle(loader):
    found_data = {i: 0 for i in range(DATA.size(0))}
    batch_size = loader.batch_size
    for i, (batch_samples, batch_targets) in enumerate(loader):
        for sample, target in zip(batch_samples, batch_targets):
            for data_point_idx, data_point in enumerate(DATA):
                if data_point.eq(sample).all():
                    assert not found_data[data_point_idx]
                    found_data[data_point_idx] += 1
                    break
            assert torch.equal(target, LABELS[data_point_idx])
        assert sum(found_data.values()) == (i + 1) * batch_size
    assert i == math.floor((len(DATASET) - 1) / batch_size)


def check_error(loader):
    # torch's _test_error counts one NotImplementedError a batch and goes on; in torch's workers
    # (and forkpool's) the first failure ends the epoch: one error, then the loop is over.
    it = iter(loader)
    with pytest.raises(NotImplementedError):
        next(it)


@pytest.mark.parametrize("workers", [0, 4])
@pytest.mark.parametrize("batch_size", [1, 2])
def test_sequential(workers, batch_size):
    check_sequential(DataLoader(DATASET, batch_size=batch_size, num_workers=workers))


@pytest.mark.parametrize("workers", [0, 4])
@pytest.mark.parametrize("batch_size", [1, 2])
def test_shuffle(workers, batch_size):
    check_shuffle(DataLoader(DATASET, batch_size=batch_size, shuffle=True, num_workers=workers))


def test_numpy():
    batch = next(iter(DataLoader(NumpyDataset(), batch_size=12, num_workers=2)))
    assert batch.dtype == torch.float64 and batch.size() == torch.Size([12, 2, 3, 4])
    assert [float(b[0, 0, 0]) for b in batch] == list(range(12))


@pytest.mark.parametrize("workers", [0, 4])
def test_error(workers):
    check_error(DataLoader(ErrorDataset(41), batch_size=2, shuffle=True, num_workers=workers))


def test_partial_workers():
    """Workers end even when the iterator is not exhausted."""
    loader = DataLoader(DATASET, batch_size=2, num_workers=4)
    it = iter(loader)
    for i, _ in enumerate(it):
        if i == 3:
            break
    pids = loader._pool.worker_pids()  # (torch's test reads its iterator's `workers`)
    assert len(pids) == 4
    del it
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            _wait_gone(pid)


def _wait_gone(pid, seconds=5.0):
    import os
    import time

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        os.kill(pid, 0)  # raises ProcessLookupError once it is gone
        time.sleep(0.01)


def test_len():
    def check_len(dl, expected):
        assert len(dl) == expected
        assert sum(1 for _ in dl) == expected
    check_len(DataLoader(DATASET, batch_size=2, num_workers=2), 50)
    check_len(DataLoader(DATASET, batch_size=3, num_workers=2), 34)
    check_len(DataLoader(DATASET, batch_size=3, num_workers=2, drop_last=True), 33)


def test_string_dataset_shuffled_with_workers():
    loader = DataLoader(StringDataset(), batch_size=2, shuffle=True, num_workers=4)
    seen = []
    for s, n in loader:
        assert isinstance(s[0], str)
        seen += list(zip(s, n.tolist()))
    assert sorted(seen) == [("1", 0), ("2", 1), ("3", 2), ("4", 3), ("5", 4)]


def test_dict_dataset_sequential_batch():
    loader = DataLoader(DictDataset(), batch_size=2, shuffle=False, num_workers=2)
    batch_size = loader.batch_size
    for i, sample in enumerate(loader):
        idx = i * batch_size
        assert set(sample.keys()) == {"a_tensor", "another_dict"}
        assert set(sample["another_dict"].keys()) == {"a_number"}
        t = sample["a_tensor"]
        assert t.size() == torch.Size([batch_size, 4, 2])
        assert (t[0] == idx).all() and (t[1] == idx + 1).all()
        n = sample["another_dict"]["a_number"]
        assert n.size() == torch.Size([batch_size])
        assert n[0] == idx and n[1] == idx + 1


def test_iterable_style_dataset_each_sample_once():
    loader = DataLoader(CountingIterable(50), batch_size=None, num_workers=3)
    assert sorted(int(x) for x in loader) == list(range(50))


def seed_of_worker(_):
    return torch.utils.data.get_worker_info().seed


class WorkerSeeds(Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        info = torch.utils.data.get_worker_info()
        return info.id, info.seed


def test_worker_seed_differs_between_workers_and_epochs():
    loader = DataLoader(WorkerSeeds(), batch_size=1, num_workers=4)
    first = {int(i): int(s) for i, s in loader}
    second = {int(i): int(s) for i, s in loader}
    assert len(set(first.values())) == len(first) > 1
    assert set(first.values()).isdisjoint(second.values())


def test_sampler_reproducibility_with_a_generator():
    def order(seed):
        return [int(x) for x in DataLoader(range(20), shuffle=True, num_workers=2,
                                           generator=torch.Generator().manual_seed(seed))]
    assert order(7) == order(7) != order(8)


@pytest.mark.parametrize("arguments, message", [
    ({"num_workers": -1}, "num_workers"),
    ({"timeout": -1}, "timeout"),
    ({"batch_sampler": [[0, 1]], "batch_size": 2}, "batch_sampler"),
    ({"batch_sampler": [[0, 1]], "shuffle": True}, "batch_sampler"),
    ({"sampler": range(3), "shuffle": True}, "sampler"),
    ({"persistent_workers": True}, "persistent_workers"),
])
def test_invalid_arguments_raise_as_torch(arguments, message):
    with pytest.raises(ValueError, match=message):
        DataLoader(DATASET, **arguments)
