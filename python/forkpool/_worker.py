"""The worker's side of a call: runs in a forked worker, called by forkpool's C++ task."""

from __future__ import annotations

import traceback
from typing import Any, Callable

from . import _pickling


# The worker's traceback, as the text it printed: the __cause__ of a re-raised exception. CPython's
# own class, so that code written for multiprocessing.Pool recognizes it.
from multiprocessing.pool import RemoteTraceback  # noqa: E402


def _describe(error: BaseException) -> tuple:
    text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
    return ("error", error, '\n"""\n' + text + '"""')


def _answer(outcome: tuple) -> tuple[bytes, list]:
    try:
        return _pickling.dumps(outcome)
    except Exception as error:  # the result (or the exception) cannot be pickled
        kind = "result" if outcome[0] == "ok" else "exception"
        text = f"Error sending {kind}: {outcome[1]!r}. Reason: {error!r}"
        return _pickling.dumps(("error", MaybeEncodingError(text), ""))


class MaybeEncodingError(Exception):
    """A result or an exception that could not be pickled (CPython's name and meaning)."""


def run(data: bytes, tensors: list) -> tuple[bytes, list]:
    """Runs the pickled call (a function and its argument) and returns the pickled outcome:
    ("ok", value) or ("error", exception, traceback text)."""
    try:
        function, argument = _pickling.loads(data, tensors)
        outcome: tuple = ("ok", function(argument))
    except BaseException as error:  # noqa: B036 - a task's SystemExit is its outcome too
        outcome = _describe(error)
    return _answer(outcome)


def initialize(data: bytes) -> None:
    function, args = _pickling.loads(data, [])
    function(*args)


def call(job: tuple[Callable, tuple, dict]) -> Any:
    """apply_async's call: func(*args, **kwds)."""
    func, args, kwds = job
    return func(*args, **kwds)


def map_chunk(job: tuple[Callable, list]) -> list:
    """A chunk of map, imap: func(x) for each x."""
    func, chunk = job
    return [func(x) for x in chunk]


def starmap_chunk(job: tuple[Callable, list]) -> list:
    func, chunk = job
    return [func(*x) for x in chunk]
