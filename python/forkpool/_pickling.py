"""How calls and answers cross: pickle protocol 5, with every CPU tensor out of band.

A tensor anywhere in the object (nested in lists, dicts, objects) is not pickled: the pickle
names it by place, and the tensor itself travels beside the bytes as a block of forkpool's
shared memory. A tensor not yet in shared memory is moved there in place on its first send (as
torch.multiprocessing does), so later sends copy nothing and every process that has it sees the
same memory.

Tensors are found through the pickler's dispatch table (looked up in C by exact type), so an
object without tensors costs what plain pickle.dumps costs.
"""

from __future__ import annotations

import copyreg
import io
import pickle
import threading
from typing import Any

import torch

from . import _forkpool

__all__ = ["dumps", "loads"]

# The tensors of the message being pickled or unpickled on this thread.
_current = threading.local()


def _check_sendable(tensor: torch.Tensor) -> None:
    if tensor.device.type != "cpu":
        raise TypeError(f"forkpool: a {tensor.device.type} tensor cannot cross between processes "
                        "(only CPU tensors: move it with .cpu() first)")
    if tensor.layout != torch.strided:
        raise TypeError(f"forkpool: a {tensor.layout} tensor cannot cross between processes "
                        "(only strided tensors: use .to_dense() first)")
    if tensor.is_quantized:
        raise TypeError("forkpool: a quantized tensor cannot cross between processes "
                        "(use .dequantize() first)")


def _rebuild_tensor(index: int, requires_grad: bool) -> torch.Tensor:
    tensors = _current.tensors
    if not 0 <= index < len(tensors):
        raise pickle.UnpicklingError(f"forkpool: a message names tensor {index} of {len(tensors)}")
    tensor = tensors[index]
    return tensor.requires_grad_(True) if requires_grad else tensor


def _rebuild_parameter(index: int, requires_grad: bool) -> torch.nn.Parameter:
    return torch.nn.Parameter(_rebuild_tensor(index, False), requires_grad=requires_grad)


def _reduce_tensor(tensor: torch.Tensor) -> tuple:
    _check_sendable(tensor)
    if tensor.requires_grad and not tensor.is_leaf:  # torch.multiprocessing's words
        raise RuntimeError("Cowardly refusing to serialize non-leaf tensor which requires_grad, since autograd "
                           "does not support crossing process boundaries.  If you just want to transfer the data, "
                           "call detach() on the tensor before serializing (e.g., putting it on the queue).")
    if not _forkpool.is_shared(tensor):
        with torch.no_grad():
            _forkpool.share_memory_(tensor)
    tensors = _current.tensors
    tensors.append(tensor.detach())
    rebuild = _rebuild_parameter if isinstance(tensor, torch.nn.Parameter) else _rebuild_tensor
    return (rebuild, (len(tensors) - 1, tensor.requires_grad))


_dispatch = copyreg.dispatch_table.copy()
_dispatch[torch.Tensor] = _reduce_tensor
_dispatch[torch.nn.Parameter] = _reduce_tensor


class _Pickler(pickle.Pickler):
    dispatch_table = _dispatch


def dumps(obj: Any) -> tuple[bytes, list]:
    """The pickle of `obj` and the tensors it names, in order."""
    tensors: list = []
    _current.tensors = tensors
    try:
        buffer = io.BytesIO()
        _Pickler(buffer, 5).dump(obj)
        return buffer.getvalue(), tensors
    finally:
        _current.tensors = None


def loads(data: bytes, tensors: list) -> Any:
    _current.tensors = tensors
    try:
        return pickle.loads(data)
    finally:
        _current.tensors = None
