"""Was the machine quiet while we timed? Other processes on the same cores slow some methods more
than others (a concurrent job once turned LANTERN++'s 2.0x into "3.8x" on 2 cores), so every
timing command watches the machine and says when its ratios cannot be trusted.

:func:`watch_load` reads, at the start and at the end of the timed part, the 1-minute load average,
the core count and (on Linux) the CPU time all processes spent (``/proc/stat``); the difference
minus this process's own CPU time is what *other* processes took. The run counts as busy when the
others took more than :data:`BUSY_SHARE` of the machine, or, without ``/proc/stat``, when the load
average stayed above the core count."""

from __future__ import annotations

import contextvars
import os
import resource
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

BUSY_SHARE = 0.25  # others using more than a quarter of all cores: on 2 cores, half a core
PROC_STAT = Path("/proc/stat")
_T = TypeVar("_T")


@dataclass(frozen=True)
class Reading:
    """One look at the machine: monotonic time, load average, core count, CPU seconds spent by
    every process (None without /proc/stat) and by this one."""

    wall: float
    load1: float
    cpus: int
    machine_cpu: float | None
    own_cpu: float


def _machine_cpu_seconds() -> float | None:
    """Busy CPU seconds of all processes since boot (user, nice, system, irq, softirq, steal)."""
    try:
        fields = PROC_STAT.read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    ticks = [int(x) for x in fields[1:]]
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle + iowait
    return (sum(ticks[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _seconds() -> float:
    """The clock of :attr:`Reading.wall`."""
    return time.monotonic()


def read_machine() -> Reading:
    usage = resource.getrusage(resource.RUSAGE_SELF)  # every thread of this process
    try:
        load1 = os.getloadavg()[0]
    except OSError:
        load1 = 0.0
    return Reading(_seconds(), load1, os.cpu_count() or 1, _machine_cpu_seconds(),
                   usage.ru_utime + usage.ru_stime)


@dataclass(frozen=True)
class MachineLoad:
    start: Reading
    end: Reading

    @property
    def others_share(self) -> float | None:
        """Fraction of all cores other processes kept busy between the readings (None: unknown)."""
        if self.start.machine_cpu is None or self.end.machine_cpu is None:
            return None
        wall = max(self.end.wall - self.start.wall, 1e-9)
        others = (self.end.machine_cpu - self.start.machine_cpu) - (self.end.own_cpu - self.start.own_cpu)
        return max(others, 0.0) / (wall * self.start.cpus)

    @property
    def busy(self) -> bool:
        share = self.others_share
        if share is not None:
            return share > BUSY_SHARE
        return min(self.start.load1, self.end.load1) > self.start.cpus

    def warning(self) -> str | None:
        if not self.busy:
            return None
        share = self.others_share
        what = (f"other processes used {share:.0%} of the {self.start.cpus} cores while timing"
                if share is not None else f"load average {self.start.load1:.1f} -> {self.end.load1:.1f} "
                f"on {self.start.cpus} cores")
        return f"WARNING: busy machine ({what}): speed-ups measured now can be far off; rerun on a quiet machine"

    def to_dict(self) -> dict[str, Any]:
        share = self.others_share
        return {"cpus": self.start.cpus, "load1_start": round(self.start.load1, 2),
                "load1_end": round(self.end.load1, 2), "others_share": None if share is None else round(share, 3),
                "busy": self.busy}


def busy_cores(window: float = 0.25, since: Reading | None = None) -> tuple[float, int] | None:
    """(cores other processes keep busy, cores), measured over at least ``window`` seconds (None
    without ``/proc/stat``). This process's own CPU time is taken out, so the window may be time it
    spent working: ``since``, a reading taken before (the command line takes one before it imports
    torch, a second or more), is the window's start, and only what is left of ``window`` is waited."""
    start = since if since is not None else read_machine()
    left = window - (_seconds() - start.wall)
    if left > 0:
        time.sleep(left)
    share = MachineLoad(start, read_machine()).others_share
    return None if share is None else (share * start.cpus, start.cpus)


def threads_beside(busy: float, cpus: int, threads: int) -> int:
    """Intra-op threads for a machine where others keep ``busy`` of the ``cpus`` cores busy: at
    most the cores left (rounded to the nearest whole core, at least 1), never more than
    ``threads``. An OpenMP team larger than the free cores waits at every parallel op for a
    member that is off its core (a time slice, milliseconds): on 2 cores, 4 photos images with
    coupled SJD took 9.1 s on 2 threads beside a spinning process and 3.9 s on 1, 76 s and 5.3 s
    beside a 2-thread torch job (benchmarks/RESULTS.md, "Threads on a shared machine")."""
    return max(1, min(threads, int(cpus - busy + 0.5)))


class AdaptiveThreads:
    """A long-running decode loop's thread count (``lantern serve --threads auto``): every
    ``every`` seconds, at a round boundary, what other processes took since the last look decides
    the count for the next stretch (:func:`threads_beside`, up to ``most``), so a server started
    beside a passing job does not stay on one thread, nor one started alone stall later beside a
    new one. ``apply`` sets the count (``torch.set_num_threads`` in the decode thread)."""

    def __init__(self, most: int, apply: Callable[[int], None], every: float = 10.0) -> None:
        self.most, self.apply, self.every = most, apply, every
        self.threads = most
        self._last = read_machine()

    def check(self) -> int | None:
        """The new count when it changed (and was applied), else None. Called every round or step:
        between looks it costs a clock read, not a reading of the machine (~25 us)."""
        if _seconds() - self._last.wall < self.every:
            return None
        now = read_machine()
        if now.wall - self._last.wall < self.every:
            return None
        share = MachineLoad(self._last, now).others_share
        self._last = now
        if share is None:
            return None
        threads = threads_beside(share * now.cpus, now.cpus, self.most)
        if threads == self.threads:
            return None
        self.threads = threads
        self.apply(threads)
        return threads


def in_a_thread_that_ends(work: Callable[[], _T]) -> _T:
    """``work()`` run in a new thread that ends with it, in the caller's context variables, intra-op
    thread count, grad / inference mode and current GPU; its exception is raised here. Why: libgomp
    (torch's OpenMP) keeps the team a thread opens, its worker threads, for the thread's lifetime,
    and once the process's teams hold more threads than there are cores, every team's workers sleep
    between parallel regions instead of spinning, so each op pays a wake-up. Loading a model (weight
    casts, the batch-invariance probe) opens a full team; run in the caller's thread it stays there,
    and a decode on any other thread (a server's, a web app's worker) ran 1.7-1.9x slower on 2 cores
    (benchmarks/RESULTS.md, "OpenMP teams"). Daemon: Ctrl-C in the caller is not held up."""
    import torch

    threads, grad, inference = torch.get_num_threads(), torch.is_grad_enabled(), torch.is_inference_mode_enabled()
    # The current GPU is per thread too (torch.cuda.set_device(rank) before load(device="cuda")); asked
    # only where CUDA is initialized already, so that a CPU run never initializes it.
    gpu = torch.cuda.current_device() if torch.cuda.is_initialized() else None
    context = contextvars.copy_context()  # a new thread starts with empty context variables (--no-progress's)
    result: list[_T] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            torch.get_num_threads()  # settle this thread's count first (torch's lazy per-thread init)
            torch.set_num_threads(threads)
            if gpu is not None:
                torch.cuda.set_device(gpu)
            with torch.inference_mode(inference), torch.set_grad_enabled(grad):
                result.append(context.run(work))
        except BaseException as e:  # raised again in the caller's thread
            error.append(e)

    thread = threading.Thread(target=run, name="lantern-passing", daemon=True)
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]


class LoadWatch:
    """What :func:`watch_load` hands out: ``result`` is set when the ``with`` block ends."""

    def __init__(self) -> None:
        self.result: MachineLoad | None = None


@contextmanager
def watch_load() -> Iterator[LoadWatch]:
    """Watch the machine over the ``with`` block: ``with watch_load() as w: ...``, then ``w.result``."""
    watch, start = LoadWatch(), read_machine()
    try:
        yield watch
    finally:
        watch.result = MachineLoad(start, read_machine())
