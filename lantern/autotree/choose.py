"""Hardware-aware draft trees: measure this device, measure the drafter's acceptance, pick a tree.

Which static tree is fastest depends on two things that differ between set-ups:

* the **device**: verifying n tree tokens costs about one target step on a GPU for n up to dozens,
  but grows quickly with n on a CPU; a drafter level and the loop's bookkeeping cost a device-
  dependent fraction of a step (:func:`measure_profile`, ``lantern profile``);
* the **drafter and method**: how often the drafter's k-th sample at depth d is accepted, which
  the acceptance rule (exact, LANTERN, LANTERN++) and the sampling settings decide
  (:func:`calibrate`).

From both, :func:`select_tree` scores every candidate tree by predicted tokens per second,

    (1 + E[accepted drafts]) / (verify(n nodes) + drafting(levels) + loop overhead),

and :func:`choose_tree` runs the whole chain (quick profile or a saved one, calibration, search)
for ``--tree auto`` and for the benchmark.

The acceptance model: sampled tree verification tests the children of an accepted node in
sibling (draw) order and stops at the first acceptance, so P(rank r accepted | parent accepted)
does not depend on how many later siblings exist. One calibration run with a wide *probe* tree
therefore estimates ``a[d][r]`` = P(the accepted child at depth d has rank r | depth d - 1
reached) for every (depth, rank) the probe holds, and the expected number of accepted drafts of
ANY prefix-closed static tree is the sum over its nodes of the product of ``a`` along the node's
path (:func:`expected_accepted`). Greedy verification (temperature 0) picks the longest accepted
path instead; with exact acceptance at most one sibling matches, so the same model holds there.

The search only considers static trees (chains included), also for ``sd`` and ``lantern`` whose
default is the dynamic EAGLE-2 tree: deterministic top-k drafts are not described by a[d][r].

Timings on a shared machine are noisy: the profile keeps medians, the cost model smooths them
(:func:`non_decreasing`) and ties within 0.5% go to the smaller tree.

The profile times eager forwards. Under ``--compile`` a round is one compiled region (a CUDA graph
replay on a GPU), whose cost against the tree's size is not the eager one's, so the cost model's
best few trees are then decoded compiled on calibration images and the fastest measured one is
chosen (:func:`time_compiled`): the model narrows the search, the clock decides.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from lantern.autotree.calibrate import _method_config, calibrate
from lantern.autotree.model import DEFAULT_MAX_DRAFTS, RULE_OF_METHOD, SPECULATIVE_METHODS
from lantern.autotree.profile import DeviceProfile, ProfileSettings, load_profile, measure_profile
from lantern.autotree.search import AutoTreeChoice, select_tree
from lantern.autotree.timing import time_rotated
from lantern.decoding.config import SamplingConfig
from lantern.errors import check
from lantern.methods import AR_FALLBACK_TREE, MethodConfig
from lantern.parts import ModelParts, parts_of
from lantern.targets.base import Stack

# ============================================================================================
# Acceptance model (pure)
# ============================================================================================


# ============================================================================================
# Cost model (pure)
# ============================================================================================


# ============================================================================================
# Tree search (pure)
# ============================================================================================


# ============================================================================================
# Calibration: run a probe tree and record the accepted ranks
# ============================================================================================


# ============================================================================================
# Device profile: measured costs
# ============================================================================================


# ============================================================================================
# The whole chain
# ============================================================================================


def choose_tree(
    stack: Stack,
    method: str | MethodConfig,
    sampling: SamplingConfig,
    *,
    profile: DeviceProfile | str | Path | None = None,
    calibration_labels: Sequence[Any] | None = None,
    seed: int = 0,
    batch_size: int = 1,
    max_drafts: int = DEFAULT_MAX_DRAFTS,
    parts: ModelParts | None = None,
    progress: bool = False,
    compile: str | None = None,
) -> AutoTreeChoice:
    """Pick the fastest static tree for ``method`` on this device (``--tree auto``).

    ``method``: a speculative method name or resolved ``MethodConfig`` (its relaxation settings are
    used). ``profile``: a :class:`DeviceProfile`, a ``profile.json`` from ``lantern profile``, or
    None for a quick measurement now (~10-20 s on a CPU). Calibration generates
    ``calibration_labels`` (default: 4 labels spread over the classes) with a probe tree. The
    chosen tree (with its choices) is ``choice.tree``, what the method is resolved with. ``parts``:
    the loaded drafter and proximity table (default: the stack's own), shared by the profile and
    the calibration, so the drafter is read once. ``compile``: the run's compile mode; when it
    compiles, the cost model's best trees are timed compiled and the fastest is chosen.
    """
    from lantern.decoding.compiling import resolve_compile

    parts = parts_of(stack, parts)
    method_cfg = _method_config(method)
    rule = RULE_OF_METHOD[method_cfg.method]
    t0 = time.perf_counter()
    if profile is None:
        profile = measure_profile(stack, sampling, ProfileSettings(batch_size=batch_size, quick=True, seed=seed),
                                  rules=(rule,), parts=parts, progress=progress)
    elif not isinstance(profile, DeviceProfile):
        profile = load_profile(profile)
    profile.check_matches(stack, sampling, batch_size, "--profile")
    t1 = time.perf_counter()
    acceptance = calibrate(stack, method_cfg, sampling, labels=calibration_labels, seed=seed,
                           batch_size=batch_size, parts=parts, progress=progress)
    t2 = time.perf_counter()
    max_drafts = min(max_drafts, profile.max_tokens - 1)
    choice = select_tree(acceptance, profile.cost_model(rule), method=method_cfg.method, max_drafts=max_drafts,
                         max_depth=stack.num_tokens - 1)
    choice = replace(choice, profile_seconds=t1 - t0, calibration_seconds=t2 - t1)
    mode = resolve_compile(compile, stack.device)
    if mode is None:
        return choice
    return time_compiled(stack, method_cfg, sampling, choice, mode, seed=seed, batch_size=batch_size, parts=parts)


COMPILED_CANDIDATES = 3  # the cost model's best trees timed compiled under --compile
TIMING_IMAGES = 2
TIMING_PASSES = 2
TIMING_SEED_OFFSET = 2_000_000  # timing images never repeat a run's seeds (nor the calibration's)


def time_compiled(
    stack: Stack, method: MethodConfig, sampling: SamplingConfig, choice: AutoTreeChoice, mode: str, *,
    seed: int = 0, batch_size: int = 1, parts: ModelParts | None = None, top: int = COMPILED_CANDIDATES,
    images: int = TIMING_IMAGES, passes: int = TIMING_PASSES, clock: Callable[[], float] = time.perf_counter,
) -> AutoTreeChoice:
    """``choice`` decided by compiled timings: the cost model's ``top`` trees predicted faster than
    AR (when none is, its ``top`` best all the same), and plain AR, each decoded compiled
    (``mode``) on ``images`` calibration images (at least a batch) after a warm-up of its own (its
    compilation), in ``passes`` passes that visit them in rotated order; the least wall time per
    image token (best pass) wins, ties to the cost model's order, AR last. The timing overrides the
    eager model's verdict both ways: compiled AR may beat every tree the model favoured, and a tree
    may beat compiled AR where the model predicted it would lose (a GPU's eager round is bound by
    launches, which one graph replay removes). ``clock``: seconds (a test's fake clock)."""
    from lantern.run import run_conditions

    candidates = [c for c in choice.ranking if c.speedup >= 1.0][:top] or list(choice.ranking[:top])
    t0 = clock()
    images = max(images, batch_size)  # the run's rows per call: a compiled round is a graph per batch size
    conditions = stack.encode(stack.sample_conditions(images))
    base = seed + TIMING_SEED_OFFSET
    names = [c.spec for c in candidates] + [AR_FALLBACK_TREE]
    methods = [replace(method, tree=c.config) for c in candidates] + [MethodConfig()]
    for m in methods:  # warm-up: each round compiles on its first decode
        run_conditions(stack, conditions.rows(0, batch_size), base, sampling, m, batch_size, parts=parts,
                       compile=mode)
    best_ms, _ = time_rotated([functools.partial(run_conditions, stack, conditions, base, sampling, m, batch_size,
                                                 parts=parts, compile=mode) for m in methods], passes, clock)
    fastest = min(range(len(methods)), key=lambda i: (best_ms[i], i))
    timed = ", ".join(f"{name} {best_ms[i]:.3f}" for i, name in enumerate(names))
    measured = tuple((name, best_ms[i]) for i, name in enumerate(names))
    head = f" Under --compile ({mode}) the model's best trees and AR were timed compiled, ms per image token: {timed}"
    if fastest == len(candidates):  # compiled AR beat every tree
        return replace(choice, explanation=f"{choice.explanation}{head}; plain AR is the fastest, so the method "
                       "decodes as AR.", compile=mode, compiled_ms_per_token=measured, compiled_winner="ar",
                       timing_seconds=clock() - t0)
    best = candidates[fastest]
    ranking = (best, *(c for c in choice.ranking if c is not best))
    overridden = ", so the prediction that AR wins is overridden" if choice.falls_back_to_ar else ""
    return replace(choice, best=best, ranking=ranking, explanation=f"{choice.explanation}{head}; {best.spec} is the "
                   f"fastest{overridden}.", compile=mode, compiled_ms_per_token=measured, compiled_winner="tree",
                   timing_seconds=clock() - t0)


def choose_trees(
    stack: Stack,
    methods: Sequence[str],
    sampling: SamplingConfig,
    *,
    profile: DeviceProfile | str | Path | None = None,
    seed: int = 0,
    batch_size: int = 1,
    parts: ModelParts | None = None,
    progress: bool = False,
    compile: str | None = None,
) -> dict[str, AutoTreeChoice]:
    """:func:`choose_tree` for every speculative method in ``methods`` (others are skipped), with
    one device profile shared by all (measured once, quick, for the rules they need) and one
    drafter read (``parts``, default the stack's own)."""
    parts = parts_of(stack, parts)
    wanted = [m for m in methods if m in SPECULATIVE_METHODS]
    seconds = 0.0
    if profile is None and wanted:
        rules = tuple(dict.fromkeys(RULE_OF_METHOD[m] for m in wanted))
        t0 = time.perf_counter()
        profile = measure_profile(stack, sampling, ProfileSettings(batch_size=batch_size, quick=True, seed=seed),
                                  rules=rules, parts=parts, progress=progress)
        seconds = time.perf_counter() - t0
    chosen = {m: choose_tree(stack, m, sampling, profile=profile, seed=seed, batch_size=batch_size, parts=parts,
                             progress=progress, compile=compile) for m in wanted}
    return {m: replace(c, profile_seconds=c.profile_seconds + seconds) for m, c in chosen.items()}  # shared


def choose_auto(
    stack: Stack,
    method: str,
    sampling: SamplingConfig,
    settings: dict[str, Any],
    *,
    seed: int = 0,
    batch_size: int = 1,
    parts: ModelParts | None = None,
    progress: bool = False,
    compile: str | None = None,
) -> tuple[MethodConfig, dict[str, Any]]:
    """``tree="auto"`` for any method: a drafter method's tree (:func:`choose_tree`), or a Jacobi
    method's window (``lantern.autotree.window.choose_window``: SJD's, PJD's), measured on this
    device at this batch size. ``settings``: the method's other settings; ``parts``: the loaded
    drafter and proximity table. Returns the method
    resolved with the choice and what run.json records of it (``auto_tree`` or ``auto_window``)."""
    from lantern.autotree.window import choose_window, with_window
    from lantern.methods import METHOD_TABLE, resolve_method

    record = METHOD_TABLE.get(method)
    if record is not None and record.window_setting is not None:
        base = resolve_method(method, stack, **settings)
        window = choose_window(stack, base, sampling, seed=seed, batch_size=batch_size, parts=parts, compile=compile,
                               progress=progress)
        return with_window(base, window.window), {"auto_window": window.to_dict()}
    check(method in SPECULATIVE_METHODS,
          f"tree auto needs a method with a tree or a window ({', '.join(SPECULATIVE_METHODS)}, sjd*, pjd*), "
          f"got {method}")
    start = resolve_method(method, None, **settings)  # the method's own default tree, what the search starts from
    choice = choose_tree(stack, start, sampling, seed=seed, batch_size=batch_size, parts=parts, progress=progress,
                         compile=compile)
    return resolve_method(method, stack, **{**settings, "tree": choice.tree}), {"auto_tree": choice.to_dict()}
