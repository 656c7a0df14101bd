"""The round changes of 2026-11-29 against the costs they removed, in one process.

Image by image (same label and seed, alternating which goes first), the code as it is and the same
code patched back to the old costs: repeat_horizon guesses made slot by slot, p made a second time
for the Jacobi drafter, the chain's commit moving its slots. Both give the same codes (checked).

    python benchmarks/results/round-ops-epyc/ab_inproc.py ar,sjd-coupled-lantern-sv,lantern 10
"""

import contextlib
import statistics
import sys
import time
from collections.abc import Iterator

import torch
from torch import Tensor

import lantern
from lantern.decoding.jacobi import JacobiDrafter
from lantern.targets.llamagen import LlamaGenTarget


def by_slot(self: JacobiDrafter, first_new: Tensor) -> None:
    canvas, n, grid = self.canvas, self.n, self.grid
    assert canvas is not None and n is not None
    for i in range(self.window):
        pos = n + i
        src = torch.where(pos % grid > 0, pos - 1, pos - grid)
        value = canvas.gather(1, src[:, None])[:, 0]
        current = canvas.gather(1, pos[:, None])[:, 0]
        canvas.scatter_(1, pos[:, None], torch.where(i >= first_new, value, current)[:, None])


NEW = JacobiDrafter._initialise_repeat_horizon, JacobiDrafter.observe_verify, LlamaGenTarget.commit


def p_again(self: JacobiDrafter, logits: Tensor, probs: Tensor | None = None) -> None:
    NEW[1](self, logits, None)  # the drafter makes p itself, as before


def moving_commit(self: LlamaGenTarget, path: Tensor, num_keep: Tensor, in_order: bool = False) -> None:
    NEW[2](self, path, num_keep, False)


@contextlib.contextmanager
def variant(old: bool) -> Iterator[None]:
    if old:
        JacobiDrafter._initialise_repeat_horizon = by_slot  # type: ignore[method-assign]
        JacobiDrafter.observe_verify = p_again  # type: ignore[method-assign]
        LlamaGenTarget.commit = moving_commit  # type: ignore[method-assign]
    try:
        yield
    finally:
        JacobiDrafter._initialise_repeat_horizon, JacobiDrafter.observe_verify, LlamaGenTarget.commit = NEW


def main() -> None:
    pipe = lantern.load("photos")
    methods, images = sys.argv[1].split(","), int(sys.argv[2])
    times: dict[tuple[str, bool], list[float]] = {(m, old): [] for m in methods for old in (False, True)}
    same = True
    for m in methods:  # warm-up
        for old in (False, True):
            with variant(old):
                pipe(labels=[0], seed=99, method=m)
    for i in range(images):
        for m in methods:
            codes = {}
            for old in (False, True) if i % 2 == 0 else (True, False):
                with variant(old):
                    t0 = time.perf_counter()
                    codes[old] = pipe(labels=[i % 10], seed=i, method=m).codes
                    times[(m, old)].append(time.perf_counter() - t0)
            same &= torch.equal(codes[False], codes[True])
    print("codes identical old/new:", same)
    print(f"{'method':26s} {'old s/img':>10s} {'new s/img':>10s} {'old/new':>8s} {'x AR old':>9s} {'x AR new':>9s}")
    ar_old, ar_new = (sum(times[("ar", o)]) if "ar" in methods else 0.0 for o in (True, False))
    for m in methods:
        o, n = sum(times[(m, True)]), sum(times[(m, False)])
        per_image = statistics.median(a / b for a, b in zip(times[(m, True)], times[(m, False)], strict=True))
        xo, xn = (f"{ar / t:.2f}x" if ar else "-" for ar, t in ((ar_old, o), (ar_new, n)))
        print(f"{m:26s} {o / images:10.3f} {n / images:10.3f} {o / n:8.3f} {xo:>9s} {xn:>9s}   "
              f"per-image old/new median {per_image:.3f}")


if __name__ == "__main__":
    main()
