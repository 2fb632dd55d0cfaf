"""How calls and answers cross: pickle protocol 5, with every CPU tensor out of band.

A tensor anywhere in the object (nested in lists, dicts, objects) is not pickled: the pickle
names it by place, and the tensor itself travels beside the bytes as a block of forkpool's
shared memory. A tensor not yet in shared memory is moved there in place on its first send (as
torch.multiprocessing does), so later sends copy nothing and every process that has it sees the
same memory.

A large contiguous buffer that pickle protocol 5 offers out of band (a numpy array's data) is
copied once into a block of shared memory that travels the same way; the receiver's array views
that block (no copy). Smaller ones stay in the pickle.

Tensors are found through the pickler's dispatch table (looked up in C by exact type), so an
object without tensors costs what plain pickle.dumps costs.
"""

from __future__ import annotations

import copyreg
import io
import pickle
import threading
import types
from typing import Any, Callable, Optional

import torch

from . import _forkpool

__all__ = ["dumps", "loads", "pickled_function"]

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
    tensors = getattr(_current, "tensors", None) or ()
    if not 0 <= index < len(tensors):
        raise pickle.UnpicklingError(f"forkpool: a message names tensor {index} of {len(tensors)}")
    tensor = tensors[index]
    return tensor.requires_grad_(True) if requires_grad else tensor


def _rebuild_parameter(index: int, requires_grad: bool) -> torch.nn.Parameter:
    return torch.nn.Parameter(_rebuild_tensor(index, False), requires_grad=requires_grad)


def _share(tensor: torch.Tensor) -> int:
    """The index of `tensor` among the message's tensors, moved into shared memory first if it is
    not there yet (after the checks that say why it cannot cross)."""
    requires_grad = tensor.requires_grad
    if requires_grad and not tensor.is_leaf:  # torch.multiprocessing's words
        raise RuntimeError("Cowardly refusing to serialize non-leaf tensor which requires_grad, since autograd "
                           "does not support crossing process boundaries.  If you just want to transfer the data, "
                           "call detach() on the tensor before serializing (e.g., putting it on the queue).")
    if not _forkpool.is_shared(tensor):  # (a shared one is a dense CPU tensor: no check to make)
        _check_sendable(tensor)
        with torch.no_grad():
            _forkpool.share_memory_(tensor)
    tensors = _current.tensors
    tensors.append(tensor.detach() if requires_grad else tensor)  # (requires_grad crosses in the pickle)
    return len(tensors) - 1


def _reduce_tensor(tensor: torch.Tensor) -> tuple:
    return (_rebuild_tensor, (_share(tensor), tensor.requires_grad))


def _reduce_parameter(parameter: torch.nn.Parameter) -> tuple:
    return (_rebuild_parameter, (_share(parameter), parameter.requires_grad))


_dispatch = copyreg.dispatch_table.copy()
_dispatch[torch.Tensor] = _reduce_tensor
_dispatch[torch.nn.Parameter] = _reduce_parameter


class _Pickler(pickle.Pickler):
    dispatch_table = _dispatch


# A buffer smaller than this (a small numpy array's data, say) stays in the pickle: a block of
# shared memory costs more to send than its bytes.
_OUT_OF_BAND_MIN = 16 << 10


def _out_of_band(buffer: pickle.PickleBuffer) -> bool:
    """pickle's buffer_callback: a large contiguous buffer (a numpy array's data) is copied once
    into a block of shared memory, which travels beside the pickle as the tensors do."""
    try:
        raw = buffer.raw()
    except BufferError:  # not contiguous: pickled in band
        return True
    if raw.nbytes < _OUT_OF_BAND_MIN:
        return True
    import numpy  # (torch's own dependency)

    block = _forkpool.empty_bytes(raw.nbytes)
    numpy.copyto(block.numpy(), numpy.frombuffer(raw, dtype=numpy.uint8))
    _current.buffers.append(block)
    return False


# Types whose pickle never holds a tensor or a buffer: a call's arguments and a result made of
# them only are pickled by pickle.dumps itself, without a pickler of ours (a third of the time).
_PLAIN = frozenset({int, float, str, bytes, bool, type(None)})


def is_plain(values: Any) -> bool:
    """Whether `values` is one of _PLAIN, or a short tuple or list of them."""
    kind = type(values)
    if kind in _PLAIN:
        return True
    return (kind is tuple or kind is list) and len(values) <= 8 and all(type(v) in _PLAIN for v in values)


def dumps(obj: Any, out_of_band: bool = True) -> tuple[bytes, list]:
    """The pickle of `obj` and the tensors it names, in order, then the blocks of its buffers
    out of band (out_of_band=False: none, every buffer in the pickle). When that list is not
    empty, the pickle is followed by the number of buffer blocks (4 bytes, little-endian), which
    unpickling ignores."""
    tensors: list = []
    buffers: list = []
    _current.tensors = tensors
    _current.buffers = buffers
    try:
        stream = io.BytesIO()
        _Pickler(stream, 5, buffer_callback=_out_of_band if out_of_band else None).dump(obj)
        if tensors or buffers:
            stream.write(len(buffers).to_bytes(4, "little"))
        return stream.getvalue(), tensors + buffers if buffers else tensors
    finally:
        _current.tensors = None
        _current.buffers = None


def loads(data: bytes, tensors: list) -> Any:
    if not tensors:
        return pickle.loads(data)  # (a pickle that names a tensor then fails: _rebuild_tensor)
    count = int.from_bytes(data[-4:], "little")
    if count > len(tensors):
        raise pickle.UnpicklingError(f"forkpool: a message names {count} buffers of {len(tensors)} blocks")
    buffers = None
    if count:
        buffers = [block.numpy() for block in tensors[len(tensors) - count:]]  # views: no copy
        tensors = tensors[:len(tensors) - count]
    _current.tensors = tensors
    try:
        return pickle.loads(data, buffers=buffers)
    finally:
        _current.tensors = None


# The pickles of functions pickled by reference, by function: the same each time, and pickling a
# function (looking up its module and name) costs more than a small call's arguments. Bounded as
# the worker's cache of them (_worker._functions).
_function_pickles: dict = {}
_FUNCTIONS_KEPT = 4096


def pickled_function(func: Callable) -> Optional[bytes]:
    """The pickle of `func` when pickle names it by reference (a module's function, a class, a
    module's builtin), kept; None for any other callable (a bound method, a partial, an object with
    __call__: their state may change between calls, so they are pickled with each call's argument).
    Raises what pickle raises for a function it cannot name (a lambda, a local function)."""
    try:
        pickled = _function_pickles.get(func)
    except TypeError:  # unhashable: not a function
        return None
    if pickled is not None:
        return pickled
    kind = type(func)
    by_reference = kind is types.FunctionType or kind is type or (
        kind is types.BuiltinFunctionType and isinstance(func.__self__, (types.ModuleType, type(None))))
    if not by_reference or kind in _dispatch:
        return None
    pickled = pickle.dumps(func, 5)
    if len(_function_pickles) >= _FUNCTIONS_KEPT:
        _function_pickles.clear()
    _function_pickles[func] = pickled
    return pickled
