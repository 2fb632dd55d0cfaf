"""The worker's side of a call: runs in a forked worker, called by forkpool's C++ task.

A call names how to run (CALL, MAP or STARMAP), its function and its argument. A function pickled
by reference (a module's def, a class, a module's builtin) comes as its own pickle, which the
worker unpickles once and keeps (_function); any other callable comes inside the argument's pickle.
"""

from __future__ import annotations

import pickle
import traceback
from typing import Any, Callable

from . import _pickling, _spawn

# The worker's traceback, as the text it printed: the __cause__ of a re-raised exception. CPython's
# own class, so that code written for multiprocessing.Pool recognizes it.
from multiprocessing.pool import RemoteTraceback  # noqa: E402

# How a call runs its function on its argument.
CALL, MAP, STARMAP = 0, 1, 2
_RUNNERS: tuple = (
    lambda func, job: func(*job[0], **job[1]),      # apply_async: (args, kwds)
    lambda func, chunk: [func(x) for x in chunk],   # a chunk of map, imap
    lambda func, chunk: [func(*x) for x in chunk],  # a chunk of starmap
)

# Functions by their pickle, unpickled once. Bounded: a program that makes functions without end
# (each a new module attribute) starts over rather than grows.
_functions: dict = {}
_FUNCTIONS_KEPT = 4096


def _function(pickled: bytes) -> Callable:
    function = _functions.get(pickled)
    if function is None:
        function = pickle.loads(pickled)
        if len(_functions) >= _FUNCTIONS_KEPT:
            _functions.clear()
        _functions[pickled] = function
    return function


def _describe(error: BaseException) -> tuple:
    text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
    return ("error", error, '\n"""\n' + text + '"""')


def _answer(outcome: tuple) -> tuple[bytes, list]:
    if _pickling.is_plain(outcome[1]):
        return pickle.dumps(outcome, 5), []
    try:
        return _pickling.dumps(outcome)
    except Exception as error:  # the result (or the exception) cannot be pickled
        kind = "result" if outcome[0] == "ok" else "exception"
        text = f"Error sending {kind}: {outcome[1]!r}. Reason: {error!r}"
        return _pickling.dumps(("error", MaybeEncodingError(text), ""))


class MaybeEncodingError(Exception):
    """A result or an exception that could not be pickled (CPython's name and meaning)."""


def run(kind: int, function: bytes, data: bytes, tensors: list) -> tuple[bytes, list]:
    """Runs a call and returns the pickled outcome: ("ok", value) or ("error", exception,
    traceback text). `function` is empty when the function is in `data` beside the argument."""
    try:
        if function:
            func, argument = _function(function), _pickling.loads(data, tensors)
        else:
            func, argument = _pickling.loads(data, tensors)
        outcome: tuple = ("ok", _RUNNERS[kind](func, argument))
    except BaseException as error:  # noqa: B036 - a task's SystemExit is its outcome too
        outcome = _describe(error)
    return _answer(outcome)


def outcome_of(data: bytes, tensors: list) -> tuple:
    """In the caller: an answer as (True, value) or (False, exception), the exception's
    __cause__ the worker's traceback (as CPython attaches it)."""
    return settle(_pickling.loads(data, tensors))


def settle(outcome: tuple) -> tuple:
    """outcome_of's answer, unpickled."""
    if outcome[0] == "ok":
        return (True, outcome[1])
    if outcome[2]:
        outcome[1].__cause__ = RemoteTraceback(outcome[2])
    return (False, outcome[1])


def answer(value: Any, failed: bool) -> tuple[bytes, list]:
    """The pickled outcome of a call C++ ran (forkpool._forkpool's run_plain_call): `value`, or,
    when `failed`, the exception it raised (value)."""
    return _answer(_describe(value) if failed else ("ok", value))


def initialize(data: bytes) -> None:
    """A worker's setup, before its first task: data is the pickle of (CPython's spawn preparation
    or None, the pickle of (initializer, initargs) or None)."""
    preparation, initializer = pickle.loads(data)
    _spawn.prepare(preparation)
    if initializer is not None:
        function, args = _pickling.loads(initializer, [])
        function(*args)
