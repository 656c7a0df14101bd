"""``lantern calibrate`` and ``lantern bench --save-calibration``: the measurements ``--method auto``
reads (:mod:`lantern.calibration`), made by the bench's own runs.

A calibration is a bench of every method this model can run at its defaults: speed at each batch
size (interleaved, warm-up excluded: :func:`lantern.eval.bench.time_methods`), τ, and, unless
``quick``, quality on ``num_images`` images per method judged against AR at ``ar_seeds`` seeds
(:class:`lantern.eval.report.ARSpread`: out when any metric is worse than AR's one-sided bound,
5 % family-wise false-alarm rate). A quick one measures speed only: enough for ``--quality
lossless``, and ``--quality ar`` then picks among the lossless methods.
"""

from __future__ import annotations

import datetime as _dt
from collections.abc import Sequence
from typing import Any

from lantern.calibration import Calibration, MethodCalibration, Setup
from lantern.eval.bench import BenchConfig
from lantern.eval.methods_grammar import MethodSpec
from lantern.eval.report import BenchResult
from lantern.methods import METHOD_TABLE, resolve_method
from lantern.parts import ModelParts
from lantern.targets.base import Stack

DEFAULT_BATCH_SIZES = (1, 8)


def runnable_methods(parts: ModelParts) -> tuple[str, ...]:
    """The methods this model can run: a drafter's methods need one, LANTERN's relaxed rules a
    proximity table (neither is read to find out)."""
    return tuple(name for name, r in METHOD_TABLE.items()
                 if (parts.has_drafter or not r.needs_drafter) and (parts.has_table or not r.needs_proximity))


def calibration_config(methods: Sequence[str], batch_sizes: Sequence[int], quick: bool, *, num_images: int = 200,
                       speed_images: int = 8, repeats: int = 1, ar_seeds: int = 5, seed: int = 0,
                       batch_size: int = 25, num_real: int = 1000, compile: str | None = None) -> BenchConfig:
    """The bench run a calibration is: ``methods`` at their defaults, timed at ``batch_sizes``
    (the first is the latency timing, the rest throughput), no curves; ``quick``: no quality.
    Each size is timed on at least one whole batch, the first too (``--batch-sizes 16`` times 16
    images, not the 8 of ``speed_images``, as the throughput sizes always were)."""
    speed_images = max(speed_images, batch_sizes[0])
    return BenchConfig(
        methods=tuple(MethodSpec(m) for m in methods),
        num_images=max(2, speed_images) if quick else max(num_images, speed_images), speed_images=speed_images,
        seed=seed,
        batch_size=batch_size, speed_batch_size=batch_sizes[0], throughput_batch_sizes=tuple(batch_sizes[1:]),
        compile=compile, repeats=repeats, num_real=num_real, curve_images=0, ar_seeds=1 if quick else ar_seeds)


def calibration_from_bench(result: BenchResult, stack: Stack, setup: Setup,
                           command: str) -> tuple[Calibration, list[str]]:
    """The calibration in a bench result: its rows that ran a method at the defaults (the others,
    returned by name, are skipped: ``--method auto`` runs methods at their defaults), each with
    its seconds per image at every batch size the bench timed."""
    from lantern.version import __version__

    cfg = result.meta["config"]
    sizes = (int(cfg["speed_batch_size"]), *(int(b) for b in cfg["throughput_batch_sizes"]))
    per_batch = {(p["method"], int(p["batch_size"])): 1.0 / float(p["images_per_second"]) for p in result.throughput}
    spread = result.ar_spread  # verdicts only with AR's spread: without it, quality is null
    methods, skipped = {}, []
    for row in result.rows:
        default = resolve_method(row.base_method, stack).to_dict()
        # every batch size's run at the defaults: --tree auto picks a tree per batch size, and a
        # time of another tree would be credited to the default method at that size
        ran = [result.meta["methods"][row.method], *(p["resolved"] for p in result.throughput
                                                     if p["method"] == row.method)]
        if row.method != row.base_method or any(config != default for config in ran):
            skipped.append(row.method)
            continue
        times = {sizes[0]: row.seconds_per_image, **{b: per_batch[row.method, b] for b in sizes[1:]}}
        worse = row.outside_ar_spread if spread is not None else None  # None: not judged
        verdict = None if worse is None else "out" if worse else "within"
        methods[row.method] = MethodCalibration(row.method, row.mean_accepted, times, verdict, tuple(worse or ()),
                                                tuple(row.better_than_ar) if verdict else (), default)
    quality = None if spread is None else {
        "images": int(cfg["num_images"]), "ar_seeds": len(spread.seeds), "false_alarm_rate": spread.alpha,
        "judged": spread.judged, "rule": spread.rule(), "feature_net": result.meta.get("feature_net")}
    meta: dict[str, Any] = {
        "model": setup.model, "device": setup.device, "dtype": setup.dtype,
        "compile": setup.compile, "deterministic": setup.deterministic, "threads": result.meta["threads"],
        "sampling": result.meta["sampling"], "lantern": __version__,
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"), "command": command,
        "machine": {"description": result.meta["machine"], "busy_warning": result.meta.get("busy_warning")}}
    return Calibration(setup.model_id, setup.key, sizes, methods, quality, meta), skipped

