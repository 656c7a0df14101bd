"""``lantern bench``'s results and how they are written: the rows (:class:`BenchRow`), the tables,
``bench.md``, ``bench.json`` / ``run.json``, the image grids and the plots (:func:`save_bench`)."""

from __future__ import annotations

import functools
import math
import os
import platform
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lantern.methods import MethodConfig
from lantern.targets.base import Stack

QUALITY_KEYS = ("fid", "kid", "precision", "recall", "class_accuracy")
# The metrics a method must not be worse on to count as "within AR's quality" (KID is FID's
# unbiased cousin and adds nothing to the verdict).
SPREAD_KEYS = ("fid", "precision", "recall", "class_accuracy")
LOWER_IS_BETTER = ("fid", "kid")
# The yardstick's family-wise false-alarm rate: a method whose metrics are distributed as AR's is
# called "out" at most this often, over all judged metrics together (see :func:`yardstick`).
FALSE_ALARM_RATE = 0.05
GRID_COLUMNS = 8  # images per grid row for stacks without classes


@dataclass
class BenchRow:
    """One method's result; ``to_dict`` is an entry of ``bench.json``."""

    method: str
    base_method: str
    tree: str
    relaxation: dict[str, Any] | None
    mean_accepted: float
    target_forwards: float  # per image (prefill included)
    wall_seconds: float  # for ``speed_images`` images: each chunk's median over the passes, summed
    seconds_per_image: float
    speedup_vs_ar: float
    quality: dict[str, Any] = field(default_factory=dict)
    num_images: int = 0
    speed_images: int = 0
    wall_seconds_repeats: list[float] = field(default_factory=list)  # each pass's total
    chunk_seconds: list[list[float]] = field(default_factory=list)  # [pass][chunk]: what the speed-up is computed from
    # 95 % interval of speedup_vs_ar over the timed images (lantern.eval.bench.speedup_interval); None: not measured
    speedup_ci: list[float] | None = None
    startup_seconds: float = 0.0  # the untimed first image: loading, allocation, compilation
    # The judged metrics worse than AR's bound: the row is out when any (None: no spread measured).
    outside_ar_spread: list[str] | None = None
    better_than_ar: list[str] = field(default_factory=list)  # judged metrics beyond AR's bound on the good side

    def to_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in asdict(self).items() if k != "quality"}
        # Every metric (None without quality), except class accuracy where the stack has no classes.
        d.update({k: self.quality.get(k) for k in QUALITY_KEYS if k in self.quality or not self.quality})
        d.update({k: v for k, v in self.quality.items() if k not in QUALITY_KEYS})
        return d


def t_cdf(x: float, df: int) -> float:
    """Student's t distribution function with ``df`` (>= 1, whole) degrees of freedom, in closed
    form (Abramowitz & Stegun 26.7.3-4: a finite series in cos(theta), theta = atan(x / sqrt(df))),
    so no special-function library is needed; exact to float rounding."""
    theta = math.atan(x / math.sqrt(df))
    c2 = math.cos(theta) ** 2
    if df % 2:  # odd df: A = (2/pi)(theta + sin cos (1 + 2/3 c^2 + 2*4/(3*5) c^4 + ...))
        term, total = math.sin(theta) * math.cos(theta), 0.0
        for j in range(1, (df - 1) // 2 + 1):
            total += term
            term *= c2 * (2 * j) / (2 * j + 1)
        a = 2 / math.pi * (theta + total)
    else:  # even df: A = sin (1 + 1/2 c^2 + 1*3/(2*4) c^4 + ...)
        term, a = math.sin(theta), 0.0
        for j in range(1, df // 2 + 1):
            a += term
            term *= c2 * (2 * j - 1) / (2 * j)
    return 0.5 + 0.5 * a  # A = P(|T| < x), odd in x


@functools.lru_cache(maxsize=256)
def t_quantile(p: float, df: int) -> float:
    """The ``p`` quantile (0.5 <= p < 1) of Student's t with ``df`` degrees of freedom, by bisection
    on :func:`t_cdf` (a bench needs a handful: one per seed count and Bonferroni level)."""
    if not 0.5 <= p < 1 or df < 1:
        raise ValueError(f"t_quantile needs 0.5 <= p < 1 and df >= 1, got p={p}, df={df}")
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        lo, hi = hi, 2 * hi
    for _ in range(200):  # halves to float resolution long before 200 steps
        mid = 0.5 * (lo + hi)
        if mid in (lo, hi):
            break
        lo, hi = (mid, hi) if t_cdf(mid, df) < p else (lo, mid)
    return 0.5 * (lo + hi)


def prediction_bounds(ar: Tensor, level: float, floor: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Bounds for one more draw from the distribution of ``ar``'s last dimension (n >= 2 values,
    normal): mean ± t(level, n - 1) · s · sqrt(1 + 1/n). A new draw lies above the upper bound with
    probability exactly 1 - level (and below the lower one alike): (x - mean) / (s sqrt(1 + 1/n))
    is Student's t with n - 1 degrees of freedom. ``floor``: s is taken as at least this (the
    bounds only widen, so the false-alarm rate can only fall)."""
    n = ar.shape[-1]
    mean = ar.mean(-1)
    s = ar.std(-1) if floor is None else torch.maximum(ar.std(-1), floor.to(ar.dtype))
    half = t_quantile(level, n - 1) * s * math.sqrt(1 + 1 / n)
    return mean - half, mean + half


def yardstick(ar: Tensor, value: Tensor, family: int | None = None,
              alpha: float = FALSE_ALARM_RATE, floor: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """A method's metrics against AR's: ``(worse, better)``, boolean ``[..., m]``.

    ``ar`` is ``[..., m, n]`` (m metrics at n AR seeds) and ``value`` ``[..., m]`` (the method's),
    each metric oriented so that higher is better. A metric is *worse* when it lies below its
    one-sided prediction bound at level 1 - alpha / family (``family``: how many metrics the
    decision is over, ``m`` by default), and the method is *out* when any metric is worse. By the
    union bound (Bonferroni), a method drawn from AR's distribution is out with probability at
    most ``alpha`` whatever the metrics' correlation (1 - (1 - alpha/m)^m, just under alpha, for
    independent metrics; alpha/m for identical ones). Only worse counts: a metric above the
    matching upper bound is *better*, reported beside the verdict and never out.

    ``floor`` ([..., m], optional): a least standard deviation per metric (a proportion's step
    of one item, :meth:`ARSpread.floor`). Values equal to the bound up to float rounding are inside."""
    lo, hi = prediction_bounds(ar, 1 - alpha / (family or ar.shape[-2]), floor)
    tol = 1e-9 * ar.abs().amax(-1).clamp(min=1.0)  # five equal values average to a hair off themselves
    return value < lo - tol, value > hi + tol


@dataclass(frozen=True)
class ARSpread:
    """AR's quality at several seeds: the noise a method's metrics are read against.

    The verdict is one decision per method (:func:`yardstick`): *out* when any of the judged
    metrics (:data:`SPREAD_KEYS` that AR measured, m of them) is worse than AR's one-sided
    prediction bound for one more AR run, mean ± t(1 - alpha/m, n - 1) · s · sqrt(1 + 1/n) over
    the n seeds; a method that is AR in disguise is then called out at most ``alpha`` (5 %) of the
    time in all (metrics roughly normal across seeds). A metric beyond the bound on the good side
    is *better*, reported and never out. With 5 seeds and 4 metrics the bound is mean ± 3.83 s.

    The earlier rule also widened each interval to AR's observed range. That can only shrink the
    out region, so it would never raise the rate, but it never moves a bound here either: no seed
    lies more than s (n - 1) / sqrt(n) from the mean (Samuelson's inequality), inside the bound
    for n <= 9 seeds at m = 3 or 4. Dropped: beyond 9 seeds it would only cost power, and without
    it each metric alarms at exactly alpha/m, which the simulation tests check."""

    seeds: tuple[int, ...]
    values: dict[str, list[float]]  # metric -> its value at each seed, in ``seeds`` order
    alpha: float = FALSE_ALARM_RATE  # the family-wise false-alarm rate
    # Proportion metrics -> the items each is a fraction of (precision and class accuracy: the
    # generated images; recall: the real ones). Their s is at least one item's step (:meth:`floor`):
    # at AR's 1000 of 1000 correct, s = 0 called one miss in 200 out.
    counts: dict[str, int] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ARSpread:
        """From run.json's ``ar_spread`` (older files, without ``false_alarm_rate`` or ``counts``,
        get the default and no floor)."""
        return cls(tuple(d["seeds"]), dict(d["values"]), float(d.get("false_alarm_rate", FALSE_ALARM_RATE)),
                   {k: int(v) for k, v in d.get("counts", {}).items()})

    def floor(self, key: str) -> float:
        """The least s of ``key``: 1 / N for a proportion over N items, 0 for other metrics. A
        proportion moves in steps of 1 / N, so equal values at every seed say only that its spread
        is under a step, not that it is 0. In simulation (binomial draws, 5 seeds, N = 50 and 200,
        one metric at 5 %) this takes the false-alarm rate at p >= 0.995 from 2-8 % to 0-3 %,
        and leaves it at 4-6 % for p from 0.6 to 0.98, where s is many steps."""
        if key not in self.counts:
            return 0.0
        return 1.0 / self.counts[key]

    @property
    def judged(self) -> list[str]:
        return [k for k in SPREAD_KEYS if k in self.values]

    @property
    def level(self) -> float:
        """Each metric's one-sided level: 1 - alpha/m (Bonferroni over the m judged metrics)."""
        return 1 - self.alpha / max(len(self.judged), 1)

    def interval(self, key: str) -> tuple[float, float]:
        """AR's bounds on ``key``: beyond one is worse, beyond the other better (for FID, above
        ``hi`` is worse; for precision, recall and class accuracy, below ``lo``)."""
        lo, hi = prediction_bounds(torch.tensor(self.values[key], dtype=torch.float64), self.level,
                                   torch.tensor(self.floor(key), dtype=torch.float64))
        return float(lo), float(hi)

    def sides(self, quality: Mapping[str, Any]) -> dict[str, str]:
        """"worse", "better" or "within" for each judged metric that ``quality`` has."""
        keys = [k for k in self.judged if quality.get(k) is not None]
        if not keys:
            return {}
        sign = torch.tensor([-1.0 if k in LOWER_IS_BETTER else 1.0 for k in keys], dtype=torch.float64)
        ar = torch.tensor([self.values[k] for k in keys], dtype=torch.float64) * sign[:, None]
        value = torch.tensor([float(quality[k]) for k in keys], dtype=torch.float64) * sign
        # A metric the row lacks still counts in the family: the decision stays at or under alpha.
        floor = torch.tensor([self.floor(k) for k in keys], dtype=torch.float64)
        worse, better = yardstick(ar, value, family=len(self.judged), alpha=self.alpha, floor=floor)
        return {k: "worse" if w else "better" if b else "within"
                for k, w, b in zip(keys, worse.tolist(), better.tolist(), strict=True)}

    def judge(self, row: BenchRow) -> None:
        """Set ``row.outside_ar_spread`` (the metrics it is worse on: out when any) and
        ``row.better_than_ar`` from its quality."""
        sides = self.sides(row.quality)
        row.outside_ar_spread = [k for k, s in sides.items() if s == "worse"]
        row.better_than_ar = [k for k, s in sides.items() if s == "better"]

    def outside(self, quality: Mapping[str, Any]) -> list[str]:
        """The judged metrics on which ``quality`` is worse than AR's bound (empty: within)."""
        return [k for k, s in self.sides(quality).items() if s == "worse"]

    def rule(self) -> str:
        """The verdict's rule in words, with this spread's numbers."""
        n, m = len(self.seeds), len(self.judged)
        half = t_quantile(self.level, n - 1) * math.sqrt(1 + 1 / n)
        return (f"a row is out when any of {m} metrics ({', '.join(self.judged)}) is worse than AR's one-sided "
                f"prediction bound for one more run, mean ± t({self.level:.5g}, {n - 1}) · s · sqrt(1 + 1/{n}) "
                f"= ±{half:.2f} s (Bonferroni: a method distributed as AR is called out at most "
                f"{self.alpha:.0%} of the time)"
                + ("; s of precision, recall and class accuracy is at least one image's step, 1/N"
                   if self.counts else "")
                + "; beyond the bound on the good side is listed as better, not out")

    def to_dict(self) -> dict[str, Any]:
        return {"seeds": list(self.seeds), "values": self.values, "false_alarm_rate": self.alpha, "counts": self.counts,
                "judged": self.judged, "level": self.level,
                "interval": {k: [round(x, 6) for x in self.interval(k)] for k in self.values}}

    def describe(self) -> str:
        return ", ".join(f"{k} {format_cell(lo, 4)}..{format_cell(hi, 4)}"
                         for k in self.values for lo, hi in [self.interval(k)])

    def summary(self) -> str:
        """bench.md's line under the table: the seeds, each metric's bounds and the rule."""
        return (f"AR's spread over {len(self.seeds)} seeds ({', '.join(map(str, self.seeds))}), bounds per metric: "
                f"{self.describe()}. \"vs AR spread\": {self.rule()}.")


@dataclass
class BenchResult:
    rows: list[BenchRow]
    meta: dict[str, Any]
    ar_spread: ARSpread | None  # AR's metrics at several seeds (None: one seed, or no quality)
    curves: dict[str, list[dict[str, float]]]  # "delta" / "lambda" -> [{value, mean_accepted}]
    sweep: list[BenchRow]
    codes: dict[str, Tensor]  # method -> [num_images, N] codes (for the grids)
    labels: list[Any]  # the images' conditions: labels, or prompts
    throughput: list[dict[str, Any]] = field(default_factory=list)  # per batch size and method


def tree_label(method: MethodConfig) -> str:
    t = method.tree
    if method.jacobi is not None:
        j = method.jacobi
        label = f"jacobi:{j.window}/{j.init}" + ("" if j.coupling == "independent" else f"/{j.coupling}")
        return label if method.pac is None else f"{label}/pd{method.pac.width}x{method.pac.depth}"
    if method.pjd is not None:
        c = method.pjd.coupling
        return f"pjd:{method.pjd.window}/c{method.pjd.context}" + ("" if c == "independent" else f"/{c}")
    if t.kind == "none":
        return "-"
    if t.kind == "dynamic":
        return f"dynamic:{t.total_tokens}/d{t.depth}/k{t.top_k}"
    return t.spec


def machine_description() -> str:
    """CPU model (or GPU name) and core count: enough to tell two benchmark machines apart."""
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()} (CUDA {torch.version.cuda})"
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} logical CPUs, {platform.system()}"


def format_cell(v: Any, digits: int = 3) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}" if math.isfinite(v) else str(v)
    return str(v)


def format_quality(q: Mapping[str, Any]) -> str:
    return ", ".join(f"{k} {format_cell(q.get(k))}" for k in QUALITY_KEYS)


def _interval_cell(ci: list[float] | None) -> str:
    return "-" if ci is None else f"{ci[0]:.2f}-{ci[1]:.2f}x"


def format_table(rows: Sequence[BenchRow], markdown: bool = False) -> str:
    interval = any(r.speedup_ci is not None for r in rows)
    clip = any(r.quality.get("clip_score") is not None for r in rows)
    hps = any(r.quality.get("hps") is not None for r in rows)
    head = ["method", "tree", "tau", "fwd/img", "s/img", "speed-up", *(["95% CI"] if interval else []),
            "FID", "KID", "prec", "recall", "class acc", *(["CLIP"] if clip else []), *(["HPS"] if hps else [])]
    spread = any(r.outside_ar_spread is not None for r in rows)
    if spread:
        head.append("vs AR spread")
    body = [
        [
            r.method,
            r.tree,
            f"{r.mean_accepted:.2f}",
            f"{r.target_forwards:.1f}",
            f"{r.seconds_per_image:.3f}",
            f"{r.speedup_vs_ar:.2f}x",
            *([_interval_cell(r.speedup_ci)] if interval else []),
            format_cell(r.quality.get("fid"), 2),
            format_cell(r.quality.get("kid"), 4),
            format_cell(r.quality.get("precision")),
            format_cell(r.quality.get("recall")),
            format_cell(r.quality.get("class_accuracy")),
            *([format_cell(r.quality.get("clip_score"), 2)] if clip else []),
            *([format_cell(r.quality.get("hps"), 4)] if hps else []),
            *([_spread_cell(r)] if spread else []),
        ]
        for r in rows
    ]
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(row) + " |" for row in body]
        return "\n".join(lines)
    widths = [max(len(x) for x in col) for col in zip(head, *body, strict=True)]
    fmt = "  ".join(f"{{:<{w}}}" if i < 2 else f"{{:>{w}}}" for i, w in enumerate(widths))
    lines = [fmt.format(*head), "-" * (sum(widths) + 2 * (len(widths) - 1))]
    return "\n".join(lines + [fmt.format(*row) for row in body])


def _spread_cell(r: BenchRow) -> str:
    if r.outside_ar_spread is None or r.method == "ar":
        return "-"
    return verdict_cell(r.outside_ar_spread, r.better_than_ar or [])


def verdict_cell(worse: Sequence[str], better: Sequence[str]) -> str:
    """The verdict (:meth:`ARSpread.judge`): "within", or "out: FID, acc" (the metrics worse than
    AR's bound), then any better ones: "within (better: FID)". A method that is AR is called out
    at most 5 % of the time."""
    short = {"fid": "FID", "precision": "prec", "recall": "recall", "class_accuracy": "acc"}
    verdict = "out: " + ", ".join(short[k] for k in worse) if worse else "within"
    return verdict + (f" (better: {', '.join(short[k] for k in better)})" if better else "")


def throughput_table(points: Sequence[Mapping[str, Any]]) -> str:
    """Markdown: one row per method, images/s (and speed-up vs AR) per batch size."""
    batches = sorted({int(p["batch_size"]) for p in points})
    methods = list(dict.fromkeys(str(p["method"]) for p in points))
    cell = {(p["method"], p["batch_size"]): p for p in points}
    head = ["method", *[f"batch {b}: images/s (x AR)" for b in batches]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for m in methods:
        cells = [f"{cell[m, b]['images_per_second']:.2f} ({cell[m, b]['speedup_vs_ar']:.2f}x)"
                 if (m, b) in cell else "-" for b in batches]
        lines.append("| " + " | ".join([m, *cells]) + " |")
    return "\n".join(lines)


def _degrees_note(batches: int) -> str:
    """What a few timed batches do to the interval: honest, and wide (t(0.975, 1) = 12.7)."""
    if not 2 <= batches < 6:  # fewer than 2: no interval
        return ""
    return (f" with {batches - 1} degree(s) of freedom: {batches} timed batches give a wide interval; "
            "--speed-images 8 or more narrows it")


def relaxation_lines(result: BenchResult) -> list[str]:
    """bench.md's line per relaxed row: its rule's settings as the row ran them. A default k larger
    than the proximity table's K_max runs at K_max (the presets' tables hold 128 neighbours, so
    LANTERN's default 1000 runs as 128 there), and the line says so: run.json's ``methods`` keep
    the settings asked for."""
    lines = []
    for row in result.rows:
        relax = row.relaxation
        if relax is None:
            continue
        if relax.get("mode") == "group":
            lines.append(f"- {row.method}: group {relax['k']}")
            continue
        asked = ((result.meta.get("methods") or {}).get(row.method) or {}).get("relaxation") or {}
        k = f"k {relax['k']}"
        if asked.get("k") not in (None, relax["k"]):
            k += f" (the default {asked['k']}, capped at the proximity table's K_max)"
        bound = f"δ {relax['delta']:g}" if relax.get("mode") == "absolute" else f"λ {relax['lam']:g}"
        lines.append(f"- {row.method}: {k}, {bound}, budget {relax['budget']}, credit {relax['credit']}, "
                     f"residual {relax['residual']}")
    return ["- relaxed rows as run:", *("  " + line for line in lines)] if lines else []


def markdown_report(result: BenchResult, command: str) -> str:
    m = result.meta
    cfg = m["config"]
    lines = [
        f"# lantern bench: {m['model']}",
        "",
        f"- command: `{command}`",
        f"- date: {m['date']}; machine: {m['machine']}; torch {m['torch']}, {m['threads']} threads, "
        f"device {m['device']}, {m['dtype']}",
        f"- sampling: {m['sampling']}",
        f"- speed: {cfg['speed_images']} images per method at batch {cfg['speed_batch_size']}, "
        f"{cfg['repeats']} interleaved pass(es), warm-up excluded, each batch's median over the passes summed; "
        "the speed-up's 95% CI (where "
        "shown): over the timed batches, each with AR's time on the same images (ratio estimator, t interval"
        + _degrees_note(-(-int(cfg["speed_images"]) // int(cfg["speed_batch_size"]))) + ")",
        *([f"- **{m['busy_warning']}**"] if m.get("busy_warning") else []),
        *(
            [
                f"- quality: {cfg['num_images']} images per method (batch {cfg['batch_size']}), same labels and "
                f"seeds, against {m.get('num_real', '?')} "
                + ("AR samples (the model has no data set: distances from AR, not from real images)"
                   if m.get("reference") == "ar" else
                   f"images of {m.get('reference_images')}" if m.get("reference") == "images" else
                   "real images of the training distribution"),
                f"- feature network: {m['feature_net']} (**not** Inception: numbers compare rows of this run only)",
            ]
            if "feature_net" in m
            else ["- quality: not measured (`--no-quality`); tau and forwards describe the timed images"]
        ),
        *relaxation_lines(result),
        "",
        format_table(result.rows, markdown=True),
        "",
    ]
    if any(r.startup_seconds for r in result.rows):
        lines += ["Start-up (untimed first image per batch shape: allocation"
                  + (", compilation" if cfg.get("compile") else "") + "): "
                  + ", ".join(f"{r.method} {r.startup_seconds:.1f} s" for r in result.rows), ""]
    if result.throughput:
        lines += ["## Throughput", "", throughput_table(result.throughput), ""]
    if result.ar_spread is not None:
        lines += [result.ar_spread.summary(), ""]
    for kind, points in result.curves.items():
        pts = ", ".join(f"{p['value']:g}: {p['mean_accepted']:.2f}" for p in points)
        lines += [f"tau vs {kind}: {pts}", ""]
    if result.sweep:
        lines += ["## Sweep", "", format_table(result.sweep, markdown=True), ""]
    return "\n".join(lines)


def save_bench(
    stack: Stack, result: BenchResult, out: str | os.PathLike[str], command: str
) -> Path:
    """bench.json (a list, one object per method), run.json (settings), bench.md and PNGs."""
    from lantern.io import atomic_path, ensure_writable_dir, finite_or_null, write_json

    out = ensure_writable_dir(out, "--out")
    # Metrics of a degenerate sample (an FID of a few images) may be NaN: written as null.
    write_json(out / "bench.json", finite_or_null([r.to_dict() for r in result.rows]))
    write_json(
        out / "run.json",
        finite_or_null({
            "command": command,
            **result.meta,
            "ar_spread": None if result.ar_spread is None else result.ar_spread.to_dict(),
            "curves": result.curves,
            "sweep": [r.to_dict() for r in result.sweep],
            "throughput": result.throughput,
        }),
    )
    with atomic_path(out / "bench.md") as tmp:
        tmp.write_text(markdown_report(result, command))
    _save_grids(stack, result, out)
    save_plots(result, out)
    return out


def _save_grids(stack: Stack, result: BenchResult, out: Path, per_class: int = 4) -> None:
    """grid_<method>.png: ``per_class`` rows, one column per class (same seeds in every grid); for
    prompt-conditioned stacks, ``per_class`` rows of ``GRID_COLUMNS`` images."""
    from lantern.images import image_grid, save_png

    columns = stack.num_classes or GRID_COLUMNS
    n = min(per_class * columns, len(result.labels))
    for name, codes in result.codes.items():
        save_png(image_grid(stack.to_pil(codes[:n]), ncol=columns), out / f"grid_{_slug(name)}.png")


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in name.replace("++", "pp"))


def save_plots(result: BenchResult, out: Path) -> None:
    """accept_vs_delta.png / accept_vs_lambda.png (the tau curves) and frontier.png (speed-up
    against FID, AR's bounds as a band), each where the result has the data."""
    os.environ.setdefault("MPLCONFIGDIR", str(Path(os.environ.get("TMPDIR", "/tmp")) / "lantern-mpl"))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from lantern.io import atomic_path

    for kind, symbol in (("delta", "δ (LANTERN, absolute bound)"), ("lambda", "λ (LANTERN++, relative bound)")):
        points = result.curves.get(kind)
        if not points:
            continue
        fig, ax = plt.subplots(figsize=(4.5, 3.2), dpi=120)
        ax.plot([p["value"] for p in points], [p["mean_accepted"] for p in points], "o-")
        ax.set_xlabel(symbol)
        ax.set_ylabel("mean accepted tokens / target forward")
        ax.set_title(f"tau vs {kind} ({result.meta['model'].rsplit('/', 1)[-1]})", fontsize=9)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        with atomic_path(out / f"accept_vs_{kind}.png") as tmp:
            fig.savefig(tmp, format="png")
        plt.close(fig)

    if not any(r.quality.get("fid") is not None for r in result.rows):
        return  # speed-only run: no frontier to draw
    fig, ax = plt.subplots(figsize=(5.5, 3.8), dpi=120)
    for r in result.sweep:
        if r.quality.get("fid") is not None:
            colour = "tab:blue" if r.base_method == "lantern" else "tab:orange"
            ax.scatter(r.speedup_vs_ar, r.quality["fid"], s=12, color=colour, alpha=0.5)
    # Far-off rows (e.g. FID 5 against AR's 0.7) would squash everything else into one line: the
    # axis stops at 2.5x AR's FID (or its interval's top) and such rows sit on the edge, labelled.
    fids = [r.quality["fid"] for r in result.rows if r.quality.get("fid") is not None]
    ar_fid = next((r.quality.get("fid") for r in result.rows if r.method == "ar"), None)
    top = None
    if ar_fid is not None and fids:
        top = 2.5 * max(ar_fid, result.ar_spread.interval("fid")[1] if result.ar_spread is not None else ar_fid)
        top = top if max(fids) > top else None
    for i, r in enumerate(result.rows):
        if r.quality.get("fid") is not None:
            token = (r.relaxation or {}).get("budget") == "token"  # token-budget rows stand out
            # A row out (worse than AR on any judged metric) is drawn hollow, whatever its FID.
            hollow = bool(r.outside_ar_spread)
            colour = "tab:green" if token else "black"
            fid = r.quality["fid"]
            clipped = top is not None and fid > top
            y = top if clipped and top is not None else fid  # (clipped: top is not None)
            ax.scatter(r.speedup_vs_ar, y, s=36, color="none" if hollow else colour, edgecolors=colour,
                       linewidths=1.2, marker="^" if clipped else "o", clip_on=False)
            label = f"{r.method} (FID {fid:.1f})" if clipped else r.method
            ax.annotate(label, (r.speedup_vs_ar, y), fontsize=6, xytext=(4, 4 if i % 2 else -8),
                        textcoords="offset points")
    if top is not None:
        ax.set_ylim(top=top * 1.02)
    if result.ar_spread is not None and "fid" in result.ar_spread.values:
        lo, hi = result.ar_spread.interval("fid")
        ax.axhspan(lo, hi, color="gray", alpha=0.15,
                   label=f"AR, {len(result.ar_spread.seeds)} seeds: bounds (above: worse)")
        ax.legend(fontsize=7)
    ax.set_xlabel("wall-clock speed-up vs AR")
    ax.set_ylabel(f"FID ({result.meta.get('feature_net_short', 'lantern feature net')})")
    ax.set_title("quality vs speed (lower FID is better)" + (
        "\nhollow: out, worse than AR's bound on FID, precision, recall or class accuracy"
        if result.ar_spread is not None else ""), fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    with atomic_path(out / "frontier.png") as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)
