"""Named phases of a decoding round, for ``lantern profile --trace`` (:mod:`lantern.eval.roundtrace`).

The loop and the drafters wrap their numbered steps in ``with phase("verify"):`` etc. Outside a
trace this costs one Python call and a flag check (no ``record_function``: its dispatcher round
trip is ~2 µs, a few % of a small model's AR step). Under a trace each phase is

* a ``torch.profiler.record_function`` range ``lantern::NAME`` while a profiler is running, so the
  trace can attribute every dispatched op and host sync to the innermost phase around it, and
* a wall-clock span when a :class:`PhaseClock` is installed: the time of a phase excludes the
  phases nested in it (a drafter forward inside ``propose`` counts as ``drafter``, not twice).

PHASES names the vocabulary; anything in a round outside every phase is "other".
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager

import torch

# "round": a whole compiled round (one region; the other phases are inside it and not seen).
PHASES = ("prefill", "propose", "drafter", "draft_sampling", "tree", "verify", "accept", "sampling", "commit",
          "round")

NO_PHASE = contextlib.nullcontext()  # what ``phase`` returns when nothing is traced or timed


class PhaseClock:
    """Exclusive wall time per phase (ms), with the device drained at every boundary.

    Draining (``torch.cuda.synchronize``) makes GPU times attributable to the phase that queued
    the work; it adds syncs, so a clocked run is never the timed run of a benchmark.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.ms: dict[str, float] = {}
        self._stack: list[list[float]] = []  # [start, nested ms] per open phase

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    @contextlib.contextmanager
    def span(self, name: str) -> Iterator[None]:
        frame = [self._now(), 0.0]
        self._stack.append(frame)
        try:
            yield
        finally:
            total = 1000.0 * (self._now() - frame[0])
            self._stack.pop()
            self.ms[name] = self.ms.get(name, 0.0) + total - frame[1]
            if self._stack:
                self._stack[-1][1] += total


_clock: PhaseClock | None = None


def install_clock(clock: PhaseClock | None) -> None:
    """Time phases with ``clock`` from now on (None: stop)."""
    global _clock
    _clock = clock


@contextlib.contextmanager
def _traced(name: str) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        if torch.autograd.profiler._is_profiler_enabled:
            stack.enter_context(torch.profiler.record_function(f"lantern::{name}"))
        if _clock is not None:
            stack.enter_context(_clock.span(name))
        yield


def phase(name: str) -> AbstractContextManager[None]:
    """Context manager marking one phase of the round (see the module docstring)."""
    # Inside a compiled round there is nothing to time or label per phase: the round is one region.
    if torch.compiler.is_compiling() or (_clock is None and not torch.autograd.profiler._is_profiler_enabled):
        return NO_PHASE
    return _traced(name)
