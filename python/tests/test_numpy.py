"""numpy arrays cross as pickle protocol 5 buffers out of band, in blocks of shared memory: one
copy into the block, none out of it."""

import hashlib

import numpy as np
import pytest

import forkpool
from forkpool import _pickling


def same(a):
    return a


def describe(a):
    return (a.dtype.descr, a.shape, hashlib.sha1(a.tobytes()).hexdigest())


def scaled(a, factor):
    return a * factor


@pytest.fixture(scope="module")
def pool():
    with forkpool.Pool(2) as p:
        yield p


def test_a_large_array_leaves_the_pickle_for_a_block():
    a = np.arange(1 << 16, dtype=np.float64)  # 512 KiB
    data, blocks = _pickling.dumps({"a": a})
    assert len(data) < 1024
    assert len(blocks) == 1 and blocks[0].numel() == a.nbytes and forkpool.is_shared(blocks[0])
    back = _pickling.loads(data, blocks)["a"]
    assert np.array_equal(back, a) and back.dtype == a.dtype
    assert not back.flags.owndata  # it views the block


def test_a_small_array_stays_in_the_pickle():
    data, blocks = _pickling.dumps(np.arange(100))
    assert blocks == []
    assert np.array_equal(_pickling.loads(data, blocks), np.arange(100))


@pytest.mark.parametrize("make", [
    lambda: np.arange(300_000, dtype=np.float32),
    lambda: np.asfortranarray(np.arange(200_000, dtype=np.int64).reshape(400, 500)),
    lambda: np.arange(300_000, dtype=np.int16)[::3],  # not contiguous: in the pickle
    lambda: np.zeros(50_000, dtype=[("x", np.float32), ("y", np.int32)]),
], ids=["float32", "fortran", "strided", "structured"])
def test_arrays_cross_whole_both_ways(pool, make):
    a = make()
    assert pool.apply(describe, (a,)) == describe(a)
    back = pool.apply(same, (a,))
    assert describe(back) == describe(a)
    if a.flags.c_contiguous or a.flags.f_contiguous:  # (numpy pickles a strided view as a copy)
        assert (back.flags.c_contiguous, back.flags.f_contiguous) == (a.flags.c_contiguous, a.flags.f_contiguous)


def test_arrays_beside_tensors_and_in_many_places_keep_their_order(pool):
    import torch

    arrays = [np.full(20_000, i, dtype=np.float64) for i in range(5)]
    t = torch.arange(10.0)
    result = pool.apply(same, ({"arrays": arrays, "t": t, "more": [arrays[1], t]},))
    assert [float(a[0]) for a in result["arrays"]] == [0, 1, 2, 3, 4]
    assert float(result["more"][0][0]) == 1 and torch.equal(result["t"], t)


def test_a_worker_gets_a_copy_of_an_array_and_the_caller_keeps_its_own(pool):
    a = np.ones(100_000)
    assert float(pool.apply(scaled, (a, 3.0)).sum()) == 300_000
    assert float(a.sum()) == 100_000


def test_a_message_naming_more_buffers_than_it_carries_is_refused():
    data, blocks = _pickling.dumps(np.arange(1 << 16))
    with pytest.raises(Exception, match="buffers"):
        _pickling.loads(data[:-4] + (5).to_bytes(4, "little"), blocks)
