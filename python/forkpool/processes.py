"""forkpool.Process and forkpool.spawn: torch.multiprocessing's, with processes forked from this
one (so functions, closures and forkpool Queues in their arguments reach them as they are here).

Process is multiprocessing's fork Process: start, join(timeout), is_alive, pid, exitcode (-N
for a signal), terminate, kill, sentinel. spawn(fn, args, nprocs, join) runs fn(rank, *args) in
nprocs processes, as torch.multiprocessing.spawn, and raises its ProcessRaisedException (the rank
and its traceback) or ProcessExitedException (the rank, its exit code or signal) for the first
that fails, after ending the others.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import signal
import sys
import traceback
from typing import Any, Callable, Optional

from torch.multiprocessing.spawn import ProcessExitedException, ProcessRaisedException

from .queues import SimpleQueue

__all__ = ["Process", "spawn", "start_processes", "ProcessContext", "ProcessRaisedException",
           "ProcessExitedException"]

Process = multiprocessing.get_context("fork").Process


def _run_rank(fn: Callable, rank: int, args: tuple, errors: SimpleQueue) -> None:
    try:
        fn(rank, *args)
    except KeyboardInterrupt:
        pass  # the parent ended us
    except Exception:
        errors.put(traceback.format_exc())
        sys.exit(1)


class ProcessContext:
    """The processes of a spawn(join=False): join() them, pids()."""

    def __init__(self, processes: list, error_queues: list) -> None:
        self.processes = processes
        self.error_queues = error_queues
        self.sentinels = {process.sentinel: index for index, process in enumerate(processes)}

    def pids(self) -> list:
        return [int(process.pid) for process in self.processes]

    def join(self, timeout: Optional[float] = None) -> bool:
        """True once every process has ended well; False while some run (after `timeout`).
        Raises for the first that failed, after ending the others."""
        if not self.sentinels:
            return True
        failed = None
        for sentinel in multiprocessing.connection.wait(list(self.sentinels), timeout=timeout):
            index = self.sentinels.pop(sentinel)
            process = self.processes[index]
            process.join()
            if process.exitcode != 0:
                failed = index
                break
        if failed is None:
            return not self.sentinels
        for process in self.processes:
            if process.is_alive():
                process.terminate()
            process.join()
        self._raise_for(failed)
        return False  # not reached

    def _raise_for(self, index: int) -> None:
        process = self.processes[index]
        errors = self.error_queues[index]
        if errors.empty():
            exitcode = process.exitcode
            if exitcode < 0:
                name = signal.Signals(-exitcode).name
                raise ProcessExitedException(f"process {index} terminated with signal {name}", error_index=index,
                                             error_pid=process.pid, exit_code=exitcode, signal_name=name)
            raise ProcessExitedException(f"process {index} terminated with exit code {exitcode}", error_index=index,
                                         error_pid=process.pid, exit_code=exitcode)
        message = f"\n\n-- Process {index} terminated with the following error:\n" + errors.get()
        raise ProcessRaisedException(message, index, process.pid)


def start_processes(fn: Callable, args: tuple = (), nprocs: int = 1, join: bool = True, daemon: bool = False,
                    start_method: str = "fork") -> Any:
    if start_method != "fork":
        raise ValueError(f"forkpool: start method {start_method!r} is not supported by spawn here (fork)")
    processes, error_queues = [], []
    for rank in range(nprocs):
        errors = SimpleQueue()
        process = Process(target=_run_rank, args=(fn, rank, args, errors), daemon=daemon)
        process.start()
        processes.append(process)
        error_queues.append(errors)
    context = ProcessContext(processes, error_queues)
    if not join:
        return context
    while not context.join():
        pass
    return None


def spawn(fn: Callable, args: tuple = (), nprocs: int = 1, join: bool = True, daemon: bool = False,
          start_method: str = "fork") -> Any:
    """torch.multiprocessing.spawn: fn(rank, *args) in nprocs processes (forked: see above)."""
    return start_processes(fn, args, nprocs, join, daemon, start_method)
