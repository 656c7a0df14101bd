"""Timing candidates side by side (the auto windows, and ``--tree auto`` under ``--compile``).

A shared machine's speed drifts, so candidates are not timed one after another: every pass
decodes each candidate once, in an order that rotates from pass to pass (drift, and any effect of
running right after a particular candidate, hit them alike), and each keeps its best pass.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any


def time_rotated(decodes: Sequence[Callable[[], Any]], passes: int,
                 clock: Callable[[], float] = time.perf_counter,
                 done: Callable[[], Any] | None = None) -> tuple[list[float], list[Any]]:
    """Each decode's least wall time per image token (ms, best of ``passes`` rotated passes) and
    its last result. A decode returns a run result (``codes`` [N, T]); warm-ups are the caller's.
    ``clock``: seconds (a test's fake clock); ``done``: called after each decode, outside its time
    (a progress bar's step)."""
    n = len(decodes)
    best = [math.inf] * n
    last: list[Any] = [None] * n
    for p in range(passes):
        for i in [*range(p % n, n), *range(p % n)]:
            start = clock()
            result = decodes[i]()
            best[i] = min(best[i], (clock() - start) * 1000 / result.codes.numel())
            last[i] = result
            if done is not None:
                done()
    return best, last
