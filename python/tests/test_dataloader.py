"""forkpool.DataLoader against torch.utils.data.DataLoader: the same batches, torch's arguments,
and forkpool's handling of failures. Each test is bounded (timeouts, meson's own)."""

import os
import signal

import pytest
import torch
from torch.utils.data import BatchSampler, Dataset, IterableDataset, SequentialSampler

import forkpool


class Squares(Dataset):
    def __init__(self, n=100):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.full((4,), float(i * i)), i


class FailsAt(Squares):
    def __getitem__(self, i):
        if i == 37:
            raise KeyError(f"no sample {i}")
        return super().__getitem__(i)


class KillsAt(Squares):
    def __getitem__(self, i):
        if i == 50:
            os.kill(os.getpid(), signal.SIGKILL)
        return super().__getitem__(i)


class Sharded(IterableDataset):
    def __init__(self, n):
        self.n = n

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        return iter(range(info.id, self.n, info.num_workers))


def seeds(worker_id):
    info = forkpool.get_worker_info()
    assert info.id == worker_id


def both(**kwargs):
    ours = forkpool.DataLoader(generator=torch.Generator().manual_seed(7), **kwargs)
    theirs = torch.utils.data.DataLoader(generator=torch.Generator().manual_seed(7), **kwargs)
    return ours, theirs


def equal_batches(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x[0], y[0]) and torch.equal(x[1], y[1])


@pytest.mark.parametrize("persistent", [False, True])
def test_batches_equal_torchs_for_the_same_dataset_sampler_and_generator(persistent):
    ours, theirs = both(dataset=Squares(), batch_size=16, shuffle=True, num_workers=2, persistent_workers=persistent)
    assert len(ours) == len(theirs) == 7
    for _ in range(3):  # a new order each epoch, the same as torch's
        equal_batches(list(ours), list(theirs))
    ours.close()


def test_shuffle_gives_each_sample_once_an_epoch_in_a_new_order():
    loader = forkpool.DataLoader(Squares(), batch_size=8, shuffle=True, num_workers=2)
    orders = []
    for _ in range(2):
        labels = torch.cat([labels for _, labels in loader]).tolist()
        assert sorted(labels) == list(range(100))
        orders.append(labels)
    assert orders[0] != orders[1]


def test_samplers_batch_samplers_drop_last_and_collate_fn():
    ours, theirs = both(dataset=Squares(), sampler=SequentialSampler(range(50)), batch_size=7, drop_last=True,
                        num_workers=2)
    equal_batches(list(ours), list(theirs))
    loader = forkpool.DataLoader(Squares(), batch_sampler=BatchSampler(SequentialSampler(range(10)), 3, False),
                                 num_workers=2, collate_fn=lambda samples: [label for _, label in samples])
    assert list(loader) == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
    loader = forkpool.DataLoader(Squares(10), batch_size=None, num_workers=2)
    assert [label for _, label in loader] == list(range(10))


# Filled by the test process only: a forked worker would see it filled, a spawned one does not.
FILLED_IN_THE_PARENT = []


def in_a_fresh_interpreter(worker_id):
    assert not FILLED_IN_THE_PARENT, "a worker that was forked, not spawned"
    seeds(worker_id)


def test_spawned_workers_get_a_copy_of_the_dataset_and_the_same_batches():
    # Under spawn the dataset and functions are pickled to each worker (a fresh interpreter).
    FILLED_IN_THE_PARENT.append(True)
    ours, theirs = both(dataset=Squares(40), batch_size=8, shuffle=True, num_workers=2,
                        worker_init_fn=in_a_fresh_interpreter, multiprocessing_context="spawn",
                        persistent_workers=True)
    for _ in range(2):
        equal_batches(list(ours), list(theirs))
    ours.close()
    FILLED_IN_THE_PARENT.clear()
    with pytest.raises(ValueError, match="not supported for this dataset"):
        forkpool.DataLoader(Sharded(10), num_workers=2, multiprocessing_context="spawn")


def test_worker_init_fn_and_get_worker_info_answer_as_in_torchs_workers():
    loader = forkpool.DataLoader(Squares(20), batch_size=4, num_workers=2, worker_init_fn=seeds)
    assert len(list(loader)) == 5


def test_an_iterable_dataset_sharded_by_get_worker_info():
    loader = forkpool.DataLoader(Sharded(20), batch_size=3, num_workers=2)
    theirs = torch.utils.data.DataLoader(Sharded(20), batch_size=3, num_workers=2)
    ours = [batch.tolist() for batch in loader]
    assert ours == [batch.tolist() for batch in theirs]
    assert sorted(sum(ours, [])) == list(range(20))


def test_a_failing_sample_fails_the_epoch_with_its_exception_and_index():
    loader = forkpool.DataLoader(FailsAt(), batch_size=10, num_workers=2)
    with pytest.raises(KeyError) as raised:
        list(loader)
    assert "index 37" in "".join(getattr(raised.value, "__notes__", []))


def test_a_killed_worker_is_an_error_never_a_hang():
    loader = forkpool.DataLoader(KillsAt(), batch_size=10, num_workers=2, timeout=60)
    with pytest.raises(RuntimeError, match="exited unexpectedly"):
        list(loader)


def test_break_ends_the_epochs_workers_at_once():
    loader = forkpool.DataLoader(Squares(1000), batch_size=10, num_workers=2)
    for batch in loader:
        pids = loader._pool.worker_pids()
        break
    assert loader._pool is None, "the epoch's workers ended when the loop was left"
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_many_epochs_with_persistent_workers_hold_descriptors_flat():
    loader = forkpool.DataLoader(Squares(64), batch_size=16, num_workers=2, persistent_workers=True)
    for _ in range(3):
        list(loader)
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(20):
        assert len(list(loader)) == 4
    assert len(os.listdir("/proc/self/fd")) <= before + 2
    loader.close()


def test_num_workers_zero_loads_in_this_process():
    ours, theirs = both(dataset=Squares(30), batch_size=8, shuffle=True)
    equal_batches(list(ours), list(theirs))
