"""torch's own sharing tests (test/test_multiprocessing.py: the pool and queue cases, CPU only),
translated to forkpool: the same tensors, the same assertions."""

import os

import pytest
import torch

import forkpool


def simple_fill(inbox, outbox, done_value):
    data = inbox.get()
    data[0][:] = 4
    outbox.put(done_value)


def simple_pool_fill(tensor):
    tensor.fill_(4)
    return tensor.add(1)


def send_tensor(queue, value):
    t = torch.ones(5, 5).mul_(value)
    queue.put(t)
    queue.put(t)


def requires_grad_variable_sharing(queue, ready):
    var = queue.get()
    queue.put(var.requires_grad)


def sum_and_grad(var):
    return var.sum().item(), var.requires_grad


def test_fd_pool():  # test_fd_pool / test_fs_pool
    x = torch.zeros(10, 10)
    with forkpool.Pool(2) as pool:
        results = pool.map(simple_pool_fill, [x] * 10)
    assert torch.equal(x, torch.full((10, 10), 4.0))
    for r in results:
        assert torch.equal(r, torch.full((10, 10), 5.0))


def test_fd_sharing():  # _test_sharing: the child writes the parent's tensor
    inbox, outbox = forkpool.Queue(), forkpool.Queue()
    data = [torch.zeros(5, 5), torch.zeros(5, 5)]
    inbox.put(data)
    p = forkpool.Process(target=simple_fill, args=(inbox, outbox, 1))
    p.start()
    assert outbox.get(timeout=20) == 1
    p.join(20)
    assert torch.equal(data[0], torch.full((5, 5), 4.0))
    assert torch.equal(data[1], torch.zeros(5, 5))


def test_inherit_tensor():
    t = torch.zeros(5, 5)
    p = forkpool.Process(target=simple_pool_fill, args=(t,))
    p.start()
    p.join(20)
    assert torch.equal(t, torch.zeros(5, 5)), "a forked child's writes to a private tensor stay its own"
    forkpool.share_memory_(t)
    p = forkpool.Process(target=simple_pool_fill, args=(t,))
    p.start()
    p.join(20)
    assert torch.equal(t, torch.full((5, 5), 4.0)), "a shared one is one memory"


def test_receive_the_same_tensor_twice_as_one_storage():  # test_fd_preserve_sharing
    q = forkpool.Queue()
    p = forkpool.Process(target=send_tensor, args=(q, 3))
    p.start()
    a, b = q.get(timeout=20), q.get(timeout=20)
    p.join(20)
    assert torch.equal(a, torch.full((5, 5), 3.0)) and a.data_ptr() == b.data_ptr()


def test_variable_sharing_keeps_requires_grad():
    with forkpool.Pool(1) as pool:
        for requires_grad in (True, False):
            var = torch.arange(1.0, 26).view(5, 5).requires_grad_(requires_grad)
            assert pool.apply(sum_and_grad, (var,)) == (325.0, requires_grad)
        param = torch.nn.Parameter(torch.ones(3))
        assert pool.apply(sum_and_grad, (param,)) == (3.0, True)


def test_non_leaf_variable_sharing_is_refused():
    var0 = torch.arange(1.0, 26).view(5, 5).requires_grad_(True)
    var = var0 * 2
    with forkpool.Pool(1) as pool:
        with pytest.raises(RuntimeError, match="non-leaf"):
            pool.apply_async(sum_and_grad, (var,))
        assert not forkpool.is_shared(var)  # refused before anything moved
        assert pool.apply(sum_and_grad, (var.detach(),))[0] == 650.0


def test_is_shared_and_empty_shared():
    t = torch.randn(5, 5)
    assert not forkpool.is_shared(t)
    forkpool.share_memory_(t)
    assert forkpool.is_shared(t)
    empty = torch.tensor([])
    forkpool.share_memory_(empty)
    assert forkpool.is_shared(empty) or empty.numel() == 0
    with forkpool.Pool(1) as pool:
        assert pool.apply(simple_pool_fill, (torch.tensor([]),)).numel() == 0
