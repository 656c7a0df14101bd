"""``lantern bench``: speed and quality of every method, side by side, in one process.

Every method decodes the same labels with the same per-image seeds (``image_seed``), so rows of
the table differ only by the decoding method:

* **Speed** is measured at ``speed_batch_size`` (default 1, the latency setting speculative
  decoding is for) on the first ``speed_images`` images. Each method gets an untimed warm-up,
  then the methods run interleaved (``ar, sd, ..., ar, sd, ...``), ``repeats`` times, so drift
  of a shared machine hits every method alike. A method's time is each chunk's median over the
  passes, summed (:func:`paired_seconds`): the speed-up and its interval are one estimator.
* **Quality** is measured on ``num_images`` images per method, generated in batches (images do
  not depend on the batch size: one ``torch.Generator`` per image). FID/KID/precision/recall and
  class accuracy are computed in the feature space of a network lantern trained on the preset's
  own images (``lantern.eval.metrics``); they are comparable between rows of one run, **not** with
  published Inception FIDs. AR's own spread (``ar_seeds`` seeds: :class:`lantern.eval.report.ARSpread`)
  is reported next to them, and each row says whether it is worse than AR on any of FID, precision,
  recall and class accuracy (one decision, false-alarm rate 5 %) and on which it is better.
* ``mean_accepted`` (tokens per target forward, tau) comes from the quality run (all images).

Plots: an image grid per method, mean accepted length against LANTERN's delta and LANTERN++'s
lambda, and quality against speed-up (plus the (k, delta) / (k, lambda) grid with ``--sweep``).

The ``--methods`` grammar is :mod:`lantern.eval.methods_grammar`; the tables, ``bench.md`` and the
PNGs are written by :mod:`lantern.eval.report`.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any, Protocol, TypedDict, Unpack

import torch
from torch import Tensor

from lantern.decoding.config import SamplingConfig
from lantern.errors import LanternError, check
from lantern.eval.methods_grammar import DEFAULT_METHODS, MethodSpec
from lantern.eval.report import (
    QUALITY_KEYS,
    ARSpread,
    BenchResult,
    BenchRow,
    format_quality,
    machine_description,
    t_quantile,
    tree_label,
)
from lantern.machine import watch_load
from lantern.methods import METHOD_TABLE, MethodConfig, resolve_method, setting_name
from lantern.parts import ModelParts, parts_of
from lantern.run import RunResult, run_conditions
from lantern.targets.base import Conditions, Stack, labels_for
from lantern.validate import MAX_IMAGES
from lantern.version import software

CURVE_DELTAS = (0.0, 0.05, 0.1, 0.2, 0.3, 0.5)
CURVE_LAMBDAS = (1.0, 1.5, 2.0, 3.0, 5.0, 10.0)
SWEEP_LANTERN = {"k": (10, 50, 128), "delta": (0.05, 0.1, 0.2, 0.4)}
SWEEP_LANTERN_PP = {"k": (5, 10, 50), "lam": (2.0, 3.0, 5.0, 10.0)}
# The AR images a stack without a data set is compared with use seeds of image indices from here
# on, never those of the benchmarked images.
REFERENCE_SEED_OFFSET = 2_000_000


MAX_AR_SEEDS = 20  # AR's spread: 5 seeds give a t-interval; 20 leave nothing to gain for 4x the decoding


@dataclass(frozen=True)
class BenchConfig:
    methods: tuple[MethodSpec, ...] = tuple(MethodSpec(m) for m in DEFAULT_METHODS)
    num_images: int = 200  # per method, for the quality metrics
    speed_images: int = 8  # per method, timed
    seed: int = 0
    batch_size: int = 25  # quality generation
    speed_batch_size: int = 1
    repeats: int = 1
    num_real: int = 1000  # held-out real images the generated sets are compared with (capped by the split)
    curve_images: int = 16  # images per point of the tau-vs-delta / tau-vs-lambda curves (0 = no curves)
    ar_seeds: int = 5  # AR's quality at seeds seed..seed+n-1: the metrics' spread (1 = none)
    sweep: bool = False
    sweep_images: int = 100
    # Extra batch sizes timed for throughput (images/s per method), e.g. (4, 16); each is timed on
    # max(speed_images, batch) images so that at least one full batch runs.
    throughput_batch_sizes: tuple[int, ...] = ()
    compile: str | None = None  # lantern.decoding.compiling mode for every method (AR included); None = eager

    def __post_init__(self) -> None:
        names = [m.name for m in self.methods]
        check(len(names) > 0, "--methods needs at least one method")
        check("ar" in names, "--methods must include ar (the speed-up baseline)")
        check(len(set(names)) == len(names), f"--methods lists a method twice: {names}")
        for m in self.methods:
            check(m.method in METHOD_TABLE,
                  f"--methods: unknown method {m.method!r} (choose from {', '.join(METHOD_TABLE)})")
            try:  # every row's settings (a tree's size too) before anything is loaded
                m.resolve(None)
            except LanternError as e:  # named as the row typed: "--lantern-* options" of sd/k=3 were never given
                raise LanternError(f"--methods {m.name}: {e}", field=e.field) from None
        for name in ("num_images", "speed_images", "batch_size", "speed_batch_size", "repeats", "num_real",
                     "ar_seeds"):
            check(getattr(self, name) >= 1, f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        for name in ("num_images", "speed_images", "repeats", "curve_images", "sweep_images"):  # memory bombs
            check(getattr(self, name) <= MAX_IMAGES,
                  f"--{name.replace('_', '-')} must be at most {MAX_IMAGES} (one run), got {getattr(self, name)}")
        check(self.num_images >= 2, f"--num-images must be >= 2 for FID, got {self.num_images}")
        check(self.ar_seeds <= MAX_AR_SEEDS,  # each seed decodes num_images more AR images
              f"--ar-seeds must be at most {MAX_AR_SEEDS}, got {self.ar_seeds}")
        check(
            self.speed_images <= self.num_images,
            f"--speed-images ({self.speed_images}) must be <= --num-images ({self.num_images})",
        )
        # a latency row at batch 4 on 2 images would time a batch of 2 and record it as batch 4
        check(self.speed_batch_size <= self.speed_images,
              f"--speed-images ({self.speed_images}) must be at least the (first) --speed-batch-size "
              f"({self.speed_batch_size}): the latency rows time whole batches")
        check(self.curve_images >= 0, f"--curve-images must be >= 0, got {self.curve_images}")
        check(all(isinstance(b, int) and b >= 1 for b in self.throughput_batch_sizes),
              f"--speed-batch-size values must be integers >= 1, got {self.throughput_batch_sizes}")
        check(self.sweep_images >= 2, f"--sweep-images must be >= 2, got {self.sweep_images}")
        check(
            not self.sweep or self.speed_images <= self.sweep_images,
            f"--speed-images ({self.speed_images}) must be <= --sweep-images ({self.sweep_images})",
        )


def bench_labels(num_classes: int, n: int) -> list[int]:
    """Labels cycle through the classes, so every class is equally represented."""
    return labels_for(num_classes, n)


QualityFn = Callable[[Tensor, list[Any]], dict[str, Any]]  # (codes, labels or prompts) -> metrics


def run_bench(
    stack: Stack,
    sampling: SamplingConfig,
    config: BenchConfig,
    quality: QualityFn | None,
    progress: bool = True,
    log: Callable[[str], None] = print,
    throughput_methods: Mapping[int, Mapping[str, MethodConfig]] | None = None,
    runner: Runner | None = None,
) -> BenchResult:
    """Run the benchmark. ``quality`` maps generated codes and their labels to metrics; None
    skips the quality images (speed only: the rows then describe the timed images).
    ``throughput_methods``: per throughput batch size, the methods to time there (``--tree auto``
    picks trees per batch size); default: the latency rows' methods. ``runner``: how images are
    decoded and timed (default: in this process; ``lantern.eval.ranks``: shared across ranks)."""
    from tqdm.auto import tqdm

    runner = runner or BenchRunner()
    labels = stack.sample_conditions(config.num_images)
    encoded = stack.encode(labels)
    resolved = {m.name: m.resolve(stack) for m in config.methods}

    # 1. Speed at the latency batch size (see time_methods).
    startup: dict[str, float] = {}
    speed = encoded.rows(0, config.speed_images)
    chunk_walls: dict[str, list[list[float]]] = {}
    with watch_load() as watch:  # were other processes competing for the cores while we timed?
        speed_runs, walls = runner.time(stack, sampling, resolved, speed, config.seed, config.speed_batch_size,
                                        config.repeats, progress, compile=config.compile, startup=startup,
                                        chunk_walls=chunk_walls)
    assert watch.result is not None
    if watch.result.busy:
        log(str(watch.result.warning()))
    ar_wall = paired_seconds(chunk_walls["ar"])

    # 2. Quality: every method on the same labels and seeds, batched. Without a quality function
    # (speed-only runs), the rows describe the timed images.
    rows: list[BenchRow] = []
    codes: dict[str, Tensor] = {}
    for name, cfg in tqdm(resolved.items(), desc="quality", disable=not progress or quality is None):
        if quality is None:
            r, scores = speed_runs[name], {}
        else:
            r = runner.generate(stack, encoded, config.seed, sampling, cfg, config.batch_size)
            scores = quality(r.codes, labels)
        codes[name] = r.codes.cpu()
        rows.append(_row(name, r, paired_seconds(chunk_walls[name]), ar_wall, config, scores))
        rows[-1].wall_seconds_repeats = [round(w, 4) for w in walls[name]]
        rows[-1].chunk_seconds = [[round(w, 5) for w in chunks] for chunks in chunk_walls[name]]
        rows[-1].speedup_ci = speedup_interval(chunk_walls["ar"], chunk_walls[name])
        rows[-1].startup_seconds = round(startup.get(name, 0.0), 3)
        log(f"  {name}: tau {rows[-1].mean_accepted:.2f}, {rows[-1].speedup_vs_ar:.2f}x"
            + (f", {format_quality(scores)}" if scores else ""))

    ar_spread = None
    if config.ar_seeds > 1 and quality is not None:
        ar_spread = _ar_spread(stack, sampling, config, quality, resolved["ar"], encoded, labels,
                               rows[[r.method for r in rows].index("ar")].quality, runner, progress)
        for row in rows:
            ar_spread.judge(row)

    curves = _curves(stack, sampling, config, resolved, encoded, progress, runner)
    sweep = []
    if config.sweep:
        check(quality is not None, "--sweep needs quality metrics (drop --no-quality)")
        assert quality is not None
        sweep = _sweep(stack, sampling, config, quality, resolved, progress, runner)
    per_batch = throughput_methods or {}
    throughput = [point for batch in config.throughput_batch_sizes
                  for point in measure_throughput(stack, sampling, per_batch.get(batch, resolved), encoded, config,
                                                  batch, progress, runner)]
    meta = _meta(stack, sampling, config, resolved, scored=quality is not None)
    meta["machine_load"] = watch.result.to_dict()
    meta["busy_warning"] = watch.result.warning()
    return BenchResult(rows, meta, ar_spread, curves, sweep, codes, labels, throughput)


def _ar_spread(
    stack: Stack, sampling: SamplingConfig, config: BenchConfig, quality: QualityFn, ar: MethodConfig,
    encoded: Any, labels: list[Any], first: Mapping[str, Any], runner: Runner, progress: bool,
) -> ARSpread:
    """AR's metrics at seeds ``seed`` (the table's AR row, ``first``) .. ``seed + ar_seeds - 1``,
    on the same labels: how much the metrics move when only the sampling noise changes."""
    from tqdm.auto import tqdm

    seeds = tuple(range(config.seed, config.seed + config.ar_seeds))
    runs = [first]
    for seed in tqdm(seeds[1:], desc="AR seeds", disable=not progress):
        runs.append(quality(runner.generate(stack, encoded, seed, sampling, ar, config.batch_size).codes, labels))
    values = {k: [float(q[k]) for q in runs] for k in QUALITY_KEYS if first.get(k) is not None}
    # the items each proportion is over (a scorer's real set may be smaller than asked: its data set's)
    real = getattr(quality, "num_real", None)
    counts = {"precision": len(labels), "class_accuracy": len(labels), **({"recall": real} if real else {})}
    return ARSpread(seeds, values, counts={k: n for k, n in counts.items() if k in values})


def measure_throughput(
    stack: Stack,
    sampling: SamplingConfig,
    resolved: Mapping[str, MethodConfig],
    labels: Conditions,
    config: BenchConfig,
    batch_size: int,
    progress: bool = False,
    runner: Runner | None = None,
) -> list[dict[str, Any]]:
    """Images/s of every method at ``batch_size`` (interleaved like the latency timing), on
    max(speed_images, batch_size) images, with the speed-up against AR at the same batch size."""
    n = max(config.speed_images, batch_size)
    pool = labels.take([i % len(labels) for i in range(n)])
    chunks: dict[str, list[list[float]]] = {}
    (runner or BenchRunner()).time(stack, sampling, resolved, pool, config.seed, batch_size, config.repeats, progress,
                                   compile=config.compile, chunk_walls=chunks)
    ar_rate = n / paired_seconds(chunks["ar"])
    out = []
    for name in resolved:
        rate = n / paired_seconds(chunks[name])
        out.append({"batch_size": batch_size, "method": name, "images": n, "images_per_second": rate,
                    "speedup_vs_ar": rate / ar_rate, "resolved": resolved[name].to_dict()})
    return out


def time_methods(
    stack: Stack,
    sampling: SamplingConfig,
    resolved: Mapping[str, MethodConfig],
    labels: Sequence[Any] | Conditions,
    seed: int,
    batch_size: int = 1,
    repeats: int = 1,
    progress: bool = False,
    compile: str | None = None,
    startup: dict[str, float] | None = None,
    indices: Sequence[int] | None = None,
    parts: ModelParts | None = None,
    chunk_walls: dict[str, list[list[float]]] | None = None,
) -> tuple[dict[str, RunResult], dict[str, list[float]]]:
    """Wall-clock of every method on the same images: (last run per method, total per repeat).
    ``indices``: each label's place in the whole request, which picks its seed (default 0, 1, ...).
    ``parts``: the loaded drafter and proximity table every method shares (default: the stack's own,
    read once here).

    A shared machine's speed drifts over minutes (other tenants, frequency), so timing method A for
    a minute and then method B compares two machines. Instead the methods take turns image by
    image (a chunk of ``batch_size`` images), in an order that rotates every chunk, so drift
    and any effect of running right after a particular method hit every method alike. Every
    method first decodes one untimed chunk of every chunk size the timing uses (allocator,
    kernels, lazy loads, and with ``compile`` the graphs of those shapes); ``startup`` (if given)
    receives each method's untimed seconds, i.e. its start-up and compilation cost. ``labels``:
    the images' conditions (labels or prompts), or already encoded (``Stack.encode``).
    ``chunk_walls`` (if given) receives each method's seconds per chunk, per pass ([pass][chunk]):
    what :func:`speedup_interval` pairs with AR's.
    """
    from tqdm.auto import tqdm

    from lantern.decoding.sampling import make_generators, validate_sampling_for_vocab
    from lantern.run import image_seed, prepare_method

    check(len(labels) >= 1 and batch_size >= 1 and repeats >= 1,
          f"time_methods needs labels, batch_size >= 1 and repeats >= 1 (got {len(labels)}, {batch_size}, {repeats})")
    validate_sampling_for_vocab(sampling, stack.vocab_size)
    device = stack.device
    cond = labels if isinstance(labels, Conditions) else stack.encode(labels)
    parts = parts_of(stack, parts)
    prepared = {name: prepare_method(stack, cfg, sampling, parts, compile) for name, cfg in resolved.items()}
    chunks = [(lo, min(lo + batch_size, len(labels))) for lo in range(0, len(labels), batch_size)]
    order = list(range(len(labels))) if indices is None else list(indices)
    for name, prep in prepared.items():
        t0 = time.perf_counter()
        for size in sorted({hi - lo for lo, hi in chunks}):
            warm = cond.rows(0, size)
            prep.generate(warm.cond, make_generators([image_seed(seed + 7, i) for i in range(size)], device),
                          cond_mask=warm.mask)
        if startup is not None:
            startup[name] = time.perf_counter() - t0
    names = list(prepared)
    walls = {name: [0.0] * repeats for name in names}
    per_chunk = {name: [[0.0] * len(chunks) for _ in range(repeats)] for name in names}
    outputs: dict[str, list[Any]] = {name: [None] * len(chunks) for name in names}
    with tqdm(total=repeats * len(chunks) * len(names), desc="speed", disable=not progress) as bar:
        for rep in range(repeats):
            for ci, (lo, hi) in enumerate(chunks):
                shift = (rep * len(chunks) + ci) % len(names)
                for name in names[shift:] + names[:shift]:
                    gens = make_generators([image_seed(seed, order[i]) for i in range(lo, hi)], device)
                    t0 = time.perf_counter()
                    chunk = cond.rows(lo, hi)
                    outputs[name][ci] = prepared[name].generate(chunk.cond, gens, cond_mask=chunk.mask,
                                                                            guidance=chunk.guidance_rows())
                    seconds = time.perf_counter() - t0
                    walls[name][rep] += seconds
                    per_chunk[name][rep][ci] = seconds
                    bar.update(1)
    if chunk_walls is not None:
        chunk_walls.update(per_chunk)
    runs = {
        name: RunResult(
            codes=torch.cat([o.codes for o in outputs[name]]),
            output_stats=outputs[name],
            wall_seconds=paired_seconds(per_chunk[name]),
            method=prepared[name].method,
        )
        for name in names
    }
    return runs, walls


class Runner(Protocol):
    """How bench decodes and times images: :class:`BenchRunner` (this process) or
    ``lantern.eval.ranks.RankRunner`` (the ranks of a ``torchrun`` job)."""

    def loaded(self, stack: Stack) -> ModelParts: ...

    def generate(self, stack: Stack, conditions: Conditions, seed: int, sampling: SamplingConfig,
                 method: MethodConfig, batch_size: int) -> RunResult: ...

    def time(self, stack: Stack, sampling: SamplingConfig, resolved: Mapping[str, MethodConfig],
             conditions: Conditions, seed: int, batch_size: int = 1, repeats: int = 1, progress: bool = False,
             compile: str | None = None, startup: dict[str, float] | None = None,
             chunk_walls: dict[str, list[list[float]]] | None = None,
             ) -> tuple[dict[str, RunResult], dict[str, list[float]]]: ...


class BenchRunner:
    """How bench decodes and times images: in this process. ``lantern.eval.ranks.RankRunner``
    shares them across the ranks of a ``torchrun`` job, with the same interface. ``parts``: the
    loaded drafter and proximity table of every run (None: the stack's own, read at the first run)."""

    def __init__(self, parts: ModelParts | None = None) -> None:
        self.parts = parts

    def loaded(self, stack: Stack) -> ModelParts:
        """The parts every run shares, made on first need."""
        if self.parts is None:
            self.parts = ModelParts(stack)
        return self.parts

    def generate(self, stack: Stack, conditions: Conditions, seed: int, sampling: SamplingConfig,
                 method: MethodConfig, batch_size: int) -> RunResult:
        return run_conditions(stack, conditions, seed, sampling, method, batch_size, parts=self.loaded(stack))

    def time(self, stack: Stack, sampling: SamplingConfig, resolved: Mapping[str, MethodConfig],
             conditions: Conditions, seed: int, batch_size: int = 1, repeats: int = 1, progress: bool = False,
             compile: str | None = None, startup: dict[str, float] | None = None,
             chunk_walls: dict[str, list[list[float]]] | None = None,
             ) -> tuple[dict[str, RunResult], dict[str, list[float]]]:
        return time_methods(stack, sampling, resolved, conditions, seed, batch_size, repeats, progress, compile,
                            startup, parts=self.loaded(stack), chunk_walls=chunk_walls)


SPEEDUP_CI_LEVEL = 0.95


def paired_seconds(chunks: Sequence[Sequence[float]]) -> float:
    """A method's time over the timed images from its seconds per chunk and pass ([pass][chunk]):
    each chunk's median over the passes, summed. The speed-up is AR's over the method's, which is
    :func:`speedup_interval`'s estimate: a ratio of the medians of whole passes could take AR's and
    the method's from different passes, and fell outside its own interval (a probe, 2026-11-30:
    3.11x against a 0.87-1.28x interval when one pass of AR ran on a busy machine)."""
    medians = torch.tensor(chunks, dtype=torch.float64).quantile(0.5, dim=0)
    return float(medians.sum())



def speedup_interval(ar: Sequence[Sequence[float]], method: Sequence[Sequence[float]],
                     level: float = SPEEDUP_CI_LEVEL) -> list[float] | None:
    """A ``level`` confidence interval [lo, hi] for the speed-up over AR (AR's seconds over the
    method's, summed over the timed images), from seconds per chunk and pass ([pass][chunk], as
    :func:`time_methods` records them): each chunk's median over the passes, then the ratio
    estimator's interval, theta = sum(a) / sum(m) times exp(+-t(n - 1) * se / theta), with se from
    the chunks' linearised residuals a_i - theta * m_i (each chunk's AR and method times taken
    together: the same images, timed side by side; on the log scale, so the bounds stay positive).
    It covers the images (the speed-up depends on what is drawn) and the machine's noise within
    the run: 93-95 % of simulated runs of 2 to 16 images (tests/test_bench.py). None with fewer
    than 2 chunks."""
    a = torch.tensor(ar, dtype=torch.float64).quantile(0.5, dim=0)
    m = torch.tensor(method, dtype=torch.float64).quantile(0.5, dim=0)
    n = a.numel()
    if n < 2 or a.shape != m.shape:
        return None
    theta = float(a.sum() / m.sum())
    residual = a - theta * m
    se = math.sqrt(float((residual * residual).sum()) / (n * (n - 1))) / float(m.mean())
    half = t_quantile(1.0 - (1.0 - level) / 2, n - 1) * se / theta  # on log(theta): a ratio stays > 0
    # rounded outward, so that the estimate theta stays inside its interval as written
    return [math.floor(theta * math.exp(-half) * 1e4) / 1e4, math.ceil(theta * math.exp(half) * 1e4) / 1e4]


def _row(
    name: str, r: RunResult, wall: float, ar_wall: float, config: BenchConfig, quality: dict[str, Any]
) -> BenchRow:
    stats = r.stats_dict()
    relax = r.method.relaxation
    return BenchRow(
        method=name,
        base_method=r.method.method,
        tree=tree_label(r.method),
        relaxation=None if relax is None else relax.to_dict(),
        mean_accepted=float(stats["mean_accepted"]),
        target_forwards=stats["target_forwards"] / stats["num_images"],
        wall_seconds=wall,
        seconds_per_image=wall / config.speed_images,
        speedup_vs_ar=ar_wall / wall,
        quality=quality,
        num_images=int(stats["num_images"]),
        speed_images=config.speed_images,
    )


def _curves(
    stack: Stack,
    sampling: SamplingConfig,
    config: BenchConfig,
    resolved: Mapping[str, MethodConfig],
    labels: Conditions,
    progress: bool,
    runner: Runner | None = None,
) -> dict[str, list[dict[str, float]]]:
    """tau against LANTERN's delta and LANTERN++'s lambda, with each method's tree (cheap: no
    quality metrics, batched). delta = 0 and lambda = 1 are exact speculative decoding."""
    from tqdm.auto import tqdm

    if config.curve_images == 0:
        return {}
    curve_labels = labels.rows(0, config.curve_images)
    jobs: list[tuple[str, float, MethodConfig]] = []
    by_base = {cfg.method: cfg for cfg in resolved.values()}
    if "lantern" in by_base:
        base = by_base["lantern"]
        budget = _budget_of(base)
        jobs += [("delta", d, resolve_method("lantern", tree=base.tree, lantern_delta=d, lantern_budget=budget))
                 for d in CURVE_DELTAS]
    if "lantern++" in by_base:
        base = by_base["lantern++"]
        budget = _budget_of(base)
        jobs += [("lambda", x, resolve_method("lantern++", tree=base.tree, lantern_lambda=x, lantern_budget=budget))
                 for x in CURVE_LAMBDAS]
    out: dict[str, list[dict[str, float]]] = {}
    for kind, value, cfg in tqdm(jobs, desc="tau curves", disable=not progress):
        r = (runner or BenchRunner()).generate(stack, curve_labels, config.seed, sampling, cfg, config.batch_size)
        out.setdefault(kind, []).append({"value": value, "mean_accepted": float(r.stats_dict()["mean_accepted"])})
    return out


def _budget_of(cfg: MethodConfig | None) -> str | None:
    """The budget of a resolved relaxed method, for the curve and sweep points derived from it."""
    return None if cfg is None or cfg.relaxation is None else cfg.relaxation.budget


def _sweep(
    stack: Stack,
    sampling: SamplingConfig,
    config: BenchConfig,
    quality: QualityFn,
    resolved: Mapping[str, MethodConfig],
    progress: bool,
    runner: Runner | None = None,
) -> list[BenchRow]:
    """The (k, delta) and (k, lambda) grids: quality on ``sweep_images`` images, speed on the
    speed images (each point timed against its own AR pass, image by image)."""
    from tqdm.auto import tqdm

    by_base = {cfg.method: cfg for cfg in resolved.values()}
    specs: list[MethodSpec] = []
    lantern_tree = by_base["lantern"].tree if "lantern" in by_base else None  # None: the stack's default
    pp_tree = by_base["lantern++"].tree if "lantern++" in by_base else None
    budget, pp_budget = _budget_of(by_base.get("lantern")), _budget_of(by_base.get("lantern++"))
    for k in SWEEP_LANTERN["k"]:
        for d in SWEEP_LANTERN["delta"]:
            specs.append(MethodSpec("lantern", lantern_tree, {"lantern_k": k, "lantern_delta": d,
                                                              "lantern_budget": budget},
                                    label=f"lantern k={k} delta={d}"))
    for k in SWEEP_LANTERN_PP["k"]:
        for lam in SWEEP_LANTERN_PP["lam"]:
            specs.append(MethodSpec("lantern++", pp_tree, {"lantern_k": k, "lantern_lambda": lam,
                                                           "lantern_budget": pp_budget},
                                    label=f"lantern++ k={k} lambda={lam}"))
    labels = stack.sample_conditions(config.sweep_images)
    encoded = stack.encode(labels)
    speed_labels = encoded.rows(0, config.speed_images)
    ar = resolved["ar"]
    rows = []
    runner = runner or BenchRunner()
    sweep_config = replace(config, num_images=config.sweep_images)
    for spec in tqdm(specs, desc="sweep", disable=not progress):
        cfg = spec.resolve(stack)
        # Each point is timed against its own AR pass, the two taking turns image by image, as the
        # main rows are (the same passes and compile mode: the sweep shares their plot's axis).
        chunks: dict[str, list[list[float]]] = {}
        runner.time(stack, sampling, {"ar": ar, spec.name: cfg}, speed_labels, config.seed, config.speed_batch_size,
                    config.repeats, compile=config.compile, chunk_walls=chunks)
        r = runner.generate(stack, encoded, config.seed, sampling, cfg, config.batch_size)
        rows.append(_row(spec.name, r, paired_seconds(chunks[spec.name]), paired_seconds(chunks["ar"]), sweep_config,
                         quality(r.codes, labels)))
        rows[-1].speedup_ci = speedup_interval(chunks["ar"], chunks[spec.name])
    return rows


# The settings only the quality pass reads: a speed-only run (no quality function) records none of them.
QUALITY_SETTINGS = ("num_images", "batch_size", "num_real", "ar_seeds", "sweep", "sweep_images")


def _meta(
    stack: Stack, sampling: SamplingConfig, config: BenchConfig, resolved: Mapping[str, MethodConfig],
    scored: bool = True,
) -> dict[str, Any]:
    unused = () if scored else QUALITY_SETTINGS
    return {
        "model": str(stack.root),
        **software(),
        "machine": machine_description(),
        "threads": torch.get_num_threads(),
        "device": str(stack.device),
        "dtype": str(stack.dtype).replace("torch.", ""),
        "sampling": sampling.to_dict(),
        "config": {k: v for k, v in asdict(config).items() if k != "methods" and k not in unused},
        "methods": {name: cfg.to_dict() for name, cfg in resolved.items()},
    }


class WindowCalibration(TypedDict, total=False):
    """How :func:`lantern.autotree.window.choose_window` times the windows (its defaults where absent)."""

    images: int
    passes: int
    progress: bool


def resolve_auto_windows(
    stack: Stack, sampling: SamplingConfig, config: BenchConfig, log: Callable[[str], None] = print,
    parts: ModelParts | None = None, **calibration: Unpack[WindowCalibration],
) -> tuple[BenchConfig, dict[str, Any]]:
    """Replace ``window="auto"`` (``sjd/window=auto``, ``pjd/window=auto``) by the window
    :func:`lantern.autotree.window.choose_window` times fastest at the speed batch size, in the
    bench's compile mode (``calibration``: its ``images`` / ``passes``, and ``progress``, a bar).
    Returns the new config and each row's choice (``to_dict``)."""
    from lantern.autotree.window import choose_window

    chosen: dict[str, Any] = {}
    methods = []
    for spec in config.methods:
        if spec.window == "auto":
            choice = choose_window(stack, spec.resolve(stack), sampling, seed=config.seed,
                                   batch_size=config.speed_batch_size, parts=parts, compile=config.compile,
                                   **calibration)
            log(f"window auto for {spec.name}: {choice.explanation}")
            chosen[spec.name] = choice.to_dict()
            window = {setting_name(spec.method, "window"): choice.window}
            spec = replace(spec.with_settings(**window), label=spec.name)
        methods.append(spec)
    return replace(config, methods=tuple(methods)), chosen


def resolve_auto_trees(
    stack: Stack,
    sampling: SamplingConfig,
    config: BenchConfig,
    profile: str | None = None,
    log: Callable[[str], None] = print,
    parts: ModelParts | None = None,
) -> tuple[BenchConfig, dict[str, Any]]:
    """Replace ``tree="auto"`` by the tree :mod:`lantern.autotree.choose` picks for this device (one
    device profile shared by every method). Returns the new config and, per method, the choice
    (``to_dict``: choices list, predictions, explanation) for the run record."""
    auto = [m for m in config.methods if m.tree == "auto"]
    if not auto:
        return config, {}
    from lantern.autotree.choose import choose_trees

    names = list(dict.fromkeys(m.method for m in auto))
    chosen = choose_trees(stack, names, sampling, profile=profile, seed=config.seed,
                          batch_size=config.speed_batch_size, parts=parts, compile=config.compile)
    for name, choice in chosen.items():
        log(f"--tree auto for {name}: {choice.explanation}")
    methods = tuple(replace(m, tree=chosen[m.method].tree) if m.tree == "auto" else m for m in config.methods)
    return replace(config, methods=methods), {name: c.to_dict() for name, c in chosen.items()}


class QualityScorer:
    """Decodes generated codes and scores them against a fixed reference set (features extracted
    once): a folder of real images the user gives (``reference`` = ``"images"``: COCO's for a text
    model, as LANTERN's FID), else the stack's real images (its ``data.json``), or, for a stack
    without a data set (a t2i or Chameleon folder), AR's own images at other seeds (``"ar"``)."""

    def __init__(self, stack: Stack, extractor: Any, real: Any, num_real: int, spec: str,
                 reference: str = "data") -> None:
        self.stack, self.extractor, self.real, self.num_real, self.spec = stack, extractor, real, num_real, spec
        self.reference = reference
        self.clip: Any = None  # a lantern.eval.metrics.ClipScorer: prompt models' CLIP score (bench --clip-score)
        self.hps: Any = None  # a lantern.eval.hps.HpsScorer: their human preference score (bench --hps)
        self.reference_images: str | None = None  # the folder of a "images" reference

    @classmethod
    def build(
        cls, stack: Stack, spec: str | None, num_real: int, progress: bool = False,
        sampling: SamplingConfig | None = None, seed: int = 0, batch_size: int = 25,
        speed_only: str = "--no-quality", reference_dir: str | os.PathLike[str] | None = None,
    ) -> QualityScorer:
        """``sampling``: how AR reference images are generated when the stack has no data set;
        ``spec`` None: the model's own feature net (``speed_only`` names the way out without one);
        ``reference_dir``: a folder of real images to compare with instead (at the model's size)."""
        from lantern.data.datasets import DATA_FILE
        from lantern.eval.metrics import (
            default_feature_net,
            extract_features,
            folder_images,
            load_feature_extractor,
            reference_images,
        )

        spec = spec or default_feature_net(stack.root, speed_only)
        extractor = load_feature_extractor(spec, device=stack.device)
        if reference_dir is not None:
            with torch.no_grad():  # the size the model's images come at (height, width): one decoded grid
                height, width = stack.decode(torch.zeros(1, stack.num_tokens, dtype=torch.long,
                                                         device=stack.device)).shape[-2:]
                size = (int(height), int(width))
            images, reference = folder_images(reference_dir, size, num_real), "images"
        elif (stack.root / DATA_FILE).is_file():
            images, _ = reference_images(stack)
            images, reference = images[:num_real], "data"  # the split's first items keep classes balanced
        else:
            check(sampling is not None, f"{stack.root} has no {DATA_FILE}: its reference images are AR samples, "
                                        "which need the run's sampling settings")
            assert sampling is not None
            images, reference = ar_reference_images(stack, sampling, num_real, seed, batch_size, progress), "ar"
        real = extract_features(extractor, images, progress=progress, arg="real images")
        scorer = cls(stack, extractor, real, int(images.shape[0]), spec, reference)
        scorer.reference_images = None if reference_dir is None else str(reference_dir)
        return scorer

    @property
    def description(self) -> str:
        return str(self.extractor.name)

    @torch.no_grad()
    def images(self, codes: Tensor, batch_size: int = 100) -> Tensor:
        parts = [self.stack.decode(codes[lo : lo + batch_size]).float().cpu()
                 for lo in range(0, codes.shape[0], batch_size)]
        return torch.cat(parts)

    def __call__(self, codes: Tensor, labels: list[Any]) -> dict[str, Any]:
        from lantern.eval.metrics import quality_metrics

        classes = torch.tensor(labels) if self.stack.num_classes else None
        images = self.images(codes)
        q = quality_metrics(self.real, images, classes, self.extractor)
        out = {"fid": q.fid, "kid": q.kid_mean, "kid_std": q.kid_std, "precision": q.precision,
               "recall": q.recall, "class_accuracy": q.class_accuracy, "feature_net": q.feature_net}
        if classes is None:  # no classes: no class accuracy
            del out["class_accuracy"]
        if self.clip is not None:  # how well the images follow their prompts
            out["clip_score"] = float(self.clip.scores(images, labels).mean())
        if self.hps is not None:  # how much people would like them for their prompts
            out["hps"] = float(self.hps.scores(images, labels).mean())
        return out

    def meta(self) -> dict[str, Any]:
        return {"feature_net": self.description, "feature_net_spec": self.spec, "num_real": self.num_real,
                "feature_net_short": "lantern feature net" if "lantern" in self.description else self.description,
                "reference": self.reference, **({"clip_score": self.clip.name} if self.clip is not None else {}),
                **({"hps": self.hps.name} if self.hps is not None else {}),
                **({"reference_images": self.reference_images} if self.reference_images else {})}


def ar_reference_images(stack: Stack, sampling: SamplingConfig, n: int, seed: int, batch_size: int,
                        progress: bool = False) -> Tensor:
    """``n`` AR images [n, C, H, W] of the stack's measurement conditions, at seeds no benchmarked
    image uses: the reference set of stacks without a data set."""
    conditions = stack.encode(stack.sample_conditions(n))
    r = run_conditions(stack, conditions, seed + REFERENCE_SEED_OFFSET, sampling, MethodConfig(),
                       batch_size, progress)
    with torch.no_grad():
        return torch.cat([stack.decode(r.codes[lo : lo + 100]).float().cpu() for lo in range(0, n, 100)])
