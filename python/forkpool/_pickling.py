"""How calls and answers cross: pickle protocol 5, with every CPU tensor out of band.

A tensor anywhere in the object (nested in lists, dicts, objects) is not pickled: the pickle
names it by place (a persistent id), and the tensor itself travels beside the bytes as a block
of forkpool's shared memory. A tensor not yet in shared memory is moved there in place on its
first send (as torch.multiprocessing does), so later sends copy nothing and every process that
has it sees the same memory.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch

from . import _forkpool

__all__ = ["dumps", "loads"]


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


class _Pickler(pickle.Pickler):
    def __init__(self, file: io.BytesIO, tensors: list) -> None:
        super().__init__(file, protocol=5)
        self._tensors = tensors

    def persistent_id(self, obj: Any) -> Any:
        if not isinstance(obj, torch.Tensor):
            return None
        _check_sendable(obj)
        if not _forkpool.is_shared(obj):
            with torch.no_grad():
                _forkpool.share_memory_(obj)
        self._tensors.append(obj.detach())
        parameter = isinstance(obj, torch.nn.Parameter)
        return ("tensor", len(self._tensors) - 1, obj.requires_grad, parameter)


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, tensors: list) -> None:
        super().__init__(file)
        self._tensors = tensors

    def persistent_load(self, pid: Any) -> Any:
        kind, index, requires_grad, parameter = pid
        if kind != "tensor" or not 0 <= index < len(self._tensors):
            raise pickle.UnpicklingError(f"forkpool: unknown persistent id {pid!r}")
        tensor = self._tensors[index]
        if parameter:
            return torch.nn.Parameter(tensor, requires_grad=requires_grad)
        return tensor.requires_grad_(requires_grad) if requires_grad else tensor


def dumps(obj: Any) -> tuple[bytes, list]:
    """The pickle of `obj` and the tensors it names, in order."""
    tensors: list = []
    buffer = io.BytesIO()
    _Pickler(buffer, tensors).dump(obj)
    return buffer.getvalue(), tensors


def loads(data: bytes, tensors: list) -> Any:
    return _Unpickler(io.BytesIO(data), tensors).load()
