"""start_method="spawn": each worker a fresh interpreter, as CPython's spawn start method.

The pool runs `python -c "... forkpool._spawn.serve()"` (spawn_command) with this interpreter's
flags; the new interpreter imports forkpool and becomes a worker (C++: forkpool::init()). Before
its first task it prepares as CPython's spawn prepares a child (multiprocessing.spawn.prepare):
the parent's sys.path, working directory and argv, and the parent's main module imported again
under the name __mp_main__, so that the functions and data a module defines are found by name and
code under `if __name__ == "__main__":` does not run again.
"""

from __future__ import annotations

import multiprocessing.process
import multiprocessing.spawn
import os
import subprocess
import sys
from typing import Any, Optional

from . import _forkpool


def spawn_command() -> list:
    """The command a spawned worker runs: this interpreter, its flags, and serve()."""
    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = f"import sys; sys.path.insert(0, {package_parent!r}); from forkpool._spawn import serve; serve()"
    return [sys.executable, *subprocess._args_from_interpreter_flags(), "-c", code]


def preparation() -> dict:
    """What a spawned worker needs to find the parent's modules (CPython's preparation data).
    Raises RuntimeError (CPython's words) in a process still importing its main module as a
    spawned worker: a pool made there, unguarded by `if __name__ == "__main__":`, would spawn
    workers without end."""
    data = multiprocessing.spawn.get_preparation_data("forkpool-worker")
    data["authkey"] = bytes(data["authkey"])  # (an AuthenticationString refuses pickle)
    return data


def prepare(data: Optional[dict[str, Any]]) -> None:
    """In a spawned worker, before its first task: as CPython's spawned child prepares."""
    if data is None:
        return
    process = multiprocessing.process.current_process()
    process._inheriting = True  # a pool made while the main module is imported raises (preparation)
    try:
        multiprocessing.spawn.prepare(data)
    finally:
        process._inheriting = False


def serve() -> None:
    """The spawned worker's program: serves its pool's tasks; never returns."""
    if "FORKPOOL_SPAWNED_WORKER" not in os.environ:
        raise RuntimeError("forkpool._spawn.serve() runs in a worker a pool spawned, and only there")
    _forkpool.serve_spawned()
