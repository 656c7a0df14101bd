"""``--sjd-window auto``: the Jacobi window that decodes fastest on this device, measured.

The SJD family (``sjd*``, ``sjd-coupled*``, ``gsd``) has one knob that trades work per round for
rounds: the window L (a chain of L guesses verified per forward). ``--tree auto``'s acceptance
model (independent per-depth rates) does not describe Jacobi iterations, whose acceptance depends
on how many rounds a guess has been refined, so the window is chosen by measurement instead: a
warm-up batch, then a few calibration images (seeds no run reuses; at least the run's batch, since
a window's cost per token depends on the rows verified beside it) with every candidate window, in
``passes`` rounds that visit the windows in rotated order (so machine drift hits them alike), and
the one with the least wall time per image token (best pass) wins; ties go to the smaller window.
Under ``--compile`` the windows are timed compiled, each after a compiled warm-up of its own: a
compiled round's cost against its window is not an eager one's (a GPU's eager round is bound by
kernel launches, which a CUDA graph replay removes), so an eager timing could choose another window.

``--pjd-window auto`` is the same measurement for PJD (``pjd*``): its window (guesses per open
image row) is chosen among windows no longer than an image row, at the run's ``--pjd-context``.
The context is not chosen by timing: a smaller context opens rows earlier, which is always faster
and always further from the model's distribution (the row-causal mask hides more of the rows
above), so where to stand on that curve is a quality decision that a clock cannot make; the
lossless end is the row length.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from lantern.autotree.timing import time_rotated
from lantern.decoding.config import SamplingConfig, TreeConfig
from lantern.errors import check
from lantern.methods import MethodConfig, method_names
from lantern.parts import ModelParts, parts_of
from lantern.run import run_conditions
from lantern.targets.base import Stack

CANDIDATE_WINDOWS = (4, 8, 16, 32)
PJD_CANDIDATE_WINDOWS = (2, 4, 8)  # a PJD window lives inside one image row
CALIBRATION_PASSES = 2
CALIBRATION_IMAGES = 2
CALIBRATION_SEED_OFFSET = 1_000_000  # base seed offset: calibration images never repeat a run's seeds


@dataclass(frozen=True)
class WindowTrial:
    window: int
    tokens_per_forward: float
    ms_per_token: float

    def to_dict(self) -> dict[str, Any]:
        return {"window": self.window, "tokens_per_forward": self.tokens_per_forward, "ms_per_token": self.ms_per_token}


@dataclass(frozen=True)
class AutoWindowChoice:
    method: str
    trials: tuple[WindowTrial, ...]
    seconds: float  # calibration wall time
    compile: str | None = None  # the mode the windows were timed in (None: eager)

    @property
    def best(self) -> WindowTrial:
        return min(self.trials, key=lambda t: (t.ms_per_token, t.window))

    @property
    def window(self) -> int:
        return self.best.window

    @property
    def explanation(self) -> str:
        ranked = sorted(self.trials, key=lambda t: (t.ms_per_token, t.window))
        best, rest = ranked[0], ranked[1:4]
        others = ", ".join(f"{t.window} ({t.ms_per_token:.2f} ms, {t.tokens_per_forward:.2f}/fwd)" for t in rest)
        timed = f"compiled ({self.compile})" if self.compile else "eager"
        return (f"window {best.window}: {best.tokens_per_forward:.2f} tokens per forward, {best.ms_per_token:.2f} ms "
                f"per token on this device, {timed}" + (f"; runner-ups: {others}" if others else ""))

    def to_dict(self) -> dict[str, Any]:
        return {"method": self.method, "window": self.window, "explanation": self.explanation,
                "calibration_seconds": self.seconds, "compile": self.compile,
                "trials": [t.to_dict() for t in self.trials]}


def with_window(method: MethodConfig, window: int) -> MethodConfig:
    """``method`` (an SJD- or PJD-family method) with another window (and the chain that verifies it)."""
    chain = TreeConfig(kind="chain", depth=window)
    if method.pjd is not None:
        return replace(method, pjd=replace(method.pjd, window=window), tree=chain)
    assert method.jacobi is not None
    tree = chain if method.pac is None else method.pac.tree(window)  # sjd-pac: the chain plus its subtree
    return replace(method, jacobi=replace(method.jacobi, window=window), tree=tree)


def calibration_conditions(stack: Stack, images: int) -> list[Any]:
    """The conditions the windows are timed on: ``images`` labels spread over the classes (0 and
    evenly spaced ones), or the stack's measurement prompts (``Stack.sample_conditions``)."""
    if stack.num_classes:
        return [i * stack.num_classes // images for i in range(images)]
    return stack.sample_conditions(images)


def choose_window(
    stack: Stack,
    method: MethodConfig,
    sampling: SamplingConfig,
    *,
    seed: int = 0,
    batch_size: int = 1,
    images: int = CALIBRATION_IMAGES,
    windows: Sequence[int] | None = None,
    passes: int = CALIBRATION_PASSES,
    parts: ModelParts | None = None,
    compile: str | None = None,
    progress: bool = False,
) -> AutoWindowChoice:
    """Time every candidate window (SJD: those shorter than the image; PJD: those no longer than
    an image row) on ``images`` calibration images (at least ``batch_size``). ``parts``: the
    loaded proximity table a relaxed rule needs (default: the stack's own), read once for every
    window. ``compile``: the run's compile mode (``lantern.decoding.compiling``), which the windows
    are timed in. ``progress``: a bar over the calibration's decodes (minutes on a 7B model)."""
    from tqdm.auto import tqdm

    from lantern.decoding.compiling import resolve_compile

    jacobi_methods = method_names(lambda r: r.window_setting is not None)
    check(method.jacobi is not None or method.pjd is not None,
          f"--sjd-window / --pjd-window auto needs a Jacobi --method ({', '.join(jacobi_methods)}), "
          f"got {method.method}")
    n_tokens = stack.num_tokens
    if method.pjd is not None:
        row = stack.grid_width
        usable = sorted({w for w in windows or PJD_CANDIDATE_WINDOWS if 1 <= w <= row}) or [row]
    else:
        usable = sorted({w for w in windows or CANDIDATE_WINDOWS if 1 <= w < n_tokens}) or [n_tokens - 1]
    mode = resolve_compile(compile, stack.device)
    # the run's rows per call, not fewer: a window's cost per token depends on the rows it verifies
    # beside (and compiled, each batch size is a graph of its own)
    images = max(images, batch_size)
    base = seed + CALIBRATION_SEED_OFFSET
    t0 = time.perf_counter()
    parts = parts_of(stack, parts)  # one table read; each run's caches are freed after it, as a run's are
    # encoded once, before any timing (a text-to-image stack's prompts through the parts' T5, read once)
    conditions = parts.encode(calibration_conditions(stack, images), batch_size=batch_size)
    # warm-up: eager, one window warms them all; compiled, each window's round is a graph of its own
    warm = usable if mode else usable[:1]
    with tqdm(total=len(warm) + passes * len(usable), desc=f"timing {method.method}'s windows", unit="decode",
              disable=not progress, leave=False) as bar:
        for window in warm:
            run_conditions(stack, conditions.rows(0, batch_size), base, sampling, with_window(method, window),
                           batch_size, parts=parts, compile=mode)
            bar.update(1)
        best_ms, results = time_rotated(
            [functools.partial(run_conditions, stack, conditions, base, sampling, with_window(method, window),
                               batch_size, parts=parts, compile=mode) for window in usable], passes,
            done=lambda: bar.update(1))
    # tau is the same every pass (the same seeds)
    trials = tuple(WindowTrial(w, r.stats_dict()["mean_accepted"], ms) for w, ms, r in zip(usable, best_ms, results,
                                                                                            strict=True))
    return AutoWindowChoice(method.method, trials, time.perf_counter() - t0, mode)
