"""``lantern bench``'s results and how they are written: the rows (:class:`BenchRow`), the tables,
``bench.md``, ``bench.json`` / ``run.json``, the image grids and the plots (:func:`save_bench`)."""

from __future__ import annotations

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
# The metrics a method must keep inside AR's spread to count as "within AR's quality" (KID is
# FID's unbiased cousin and adds nothing to the verdict).
SPREAD_KEYS = ("fid", "precision", "recall", "class_accuracy")
LOWER_IS_BETTER = ("fid", "kid")
# Student's t, two-sided 95 % (the 0.975 quantile), by degrees of freedom 1..30; beyond 30 the
# 30-df value (slightly wider than the normal 1.96, so never narrower than it should be).
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)
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
    wall_seconds: float  # median over repeats, for ``speed_images`` images
    seconds_per_image: float
    speedup_vs_ar: float
    quality: dict[str, Any] = field(default_factory=dict)
    num_images: int = 0
    speed_images: int = 0
    wall_seconds_repeats: list[float] = field(default_factory=list)
    startup_seconds: float = 0.0  # the untimed first image: loading, allocation, compilation
    outside_ar_spread: list[str] | None = None  # SPREAD_KEYS outside AR's interval (None: no spread measured)
    outside_sides: list[str] = field(default_factory=list)  # "better" / "worse", one per outside_ar_spread key

    def to_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in asdict(self).items() if k != "quality"}
        # Every metric (None without quality), except class accuracy where the stack has no classes.
        d.update({k: self.quality.get(k) for k in QUALITY_KEYS if k in self.quality or not self.quality})
        d.update({k: v for k, v in self.quality.items() if k not in QUALITY_KEYS})
        return d


def t975(df: int) -> float:
    """Student's t 0.975 quantile with ``df`` degrees of freedom (a 95 % two-sided interval)."""
    return _T975[min(df, len(_T975)) - 1]


@dataclass(frozen=True)
class ARSpread:
    """AR's quality at several seeds: the noise a method's metrics are read against.

    ``interval(key)`` is a 95 % prediction interval for the metric of one more AR run, mean ±
    t(0.975, n - 1) · s · sqrt(1 + 1/n) over the n seeds (Student's t, metrics roughly normal across
    seeds), widened to the observed range; a method is *within AR's spread* on a metric when its
    value lies inside. With 5 seeds the interval is about ±3 standard deviations, so a method
    that is AR in disguise falls outside on a given metric about 5 % of the time."""

    seeds: tuple[int, ...]
    values: dict[str, list[float]]  # metric -> its value at each seed, in ``seeds`` order

    def interval(self, key: str) -> tuple[float, float]:
        v = self.values[key]
        n = len(v)
        mean = sum(v) / n
        sd = math.sqrt(sum((x - mean) ** 2 for x in v) / (n - 1))
        half = t975(n - 1) * sd * math.sqrt(1 + 1 / n)
        return min(mean - half, *v), max(mean + half, *v)

    def judge(self, row: BenchRow) -> None:
        """Set ``row.outside_ar_spread`` and ``row.outside_sides`` from its quality."""
        row.outside_ar_spread = self.outside(row.quality)
        row.outside_sides = [self.side(k, float(row.quality[k])) for k in row.outside_ar_spread]

    def outside(self, quality: Mapping[str, Any]) -> list[str]:
        """The :data:`SPREAD_KEYS` whose value in ``quality`` falls outside AR's interval."""
        out = []
        for key in SPREAD_KEYS:
            if key in self.values and quality.get(key) is not None:
                lo, hi = self.interval(key)
                if not lo <= float(quality[key]) <= hi:
                    out.append(key)
        return out

    def side(self, key: str, value: float) -> str:
        """"better" or "worse" than AR's interval, for a value outside it (FID: lower is better;
        precision, recall, class accuracy: higher)."""
        lo, hi = self.interval(key)
        above = value > hi
        return "worse" if above == (key in LOWER_IS_BETTER) else "better"

    def to_dict(self) -> dict[str, Any]:
        return {"seeds": list(self.seeds), "values": self.values,
                "interval95": {k: [round(x, 6) for x in self.interval(k)] for k in self.values}}

    def describe(self) -> str:
        return ", ".join(f"{k} {format_cell(lo, 4)}..{format_cell(hi, 4)}"
                         for k in self.values for lo, hi in [self.interval(k)])


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
        return f"pjd:{method.pjd.window}/c{method.pjd.context}"
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


def format_table(rows: Sequence[BenchRow], markdown: bool = False) -> str:
    head = ["method", "tree", "tau", "fwd/img", "s/img", "speed-up", "FID", "KID", "prec", "recall", "class acc"]
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
            format_cell(r.quality.get("fid"), 2),
            format_cell(r.quality.get("kid"), 4),
            format_cell(r.quality.get("precision")),
            format_cell(r.quality.get("recall")),
            format_cell(r.quality.get("class_accuracy")),
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
    """"within", or the metrics outside AR's 95 % interval, each with its side: "out: FID (worse),
    prec (better)". A lossless method is outside on some metric now and then (5 % per metric)."""
    if r.outside_ar_spread is None or r.method == "ar":
        return "-"
    short = {"fid": "FID", "precision": "prec", "recall": "recall", "class_accuracy": "acc"}
    return "within" if not r.outside_ar_spread else "out: " + ", ".join(
        f"{short[k]} ({side})" for k, side in zip(r.outside_ar_spread, r.outside_sides, strict=True))


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
        f"median of {cfg['repeats']} interleaved pass(es), warm-up excluded",
        *([f"- **{m['busy_warning']}**"] if m.get("busy_warning") else []),
        *(
            [
                f"- quality: {cfg['num_images']} images per method (batch {cfg['batch_size']}), same labels and "
                f"seeds, against {m.get('num_real', '?')} real images of the training distribution",
                f"- feature network: {m['feature_net']} (**not** Inception: numbers compare rows of this run only)",
            ]
            if "feature_net" in m
            else ["- quality: not measured (`--no-quality`); tau and forwards describe the timed images"]
        ),
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
        s = result.ar_spread
        lines += [f"AR's spread over {len(s.seeds)} seeds ({', '.join(map(str, s.seeds))}), 95 % prediction "
                  f"interval per metric: {s.describe()}. \"vs AR spread\": a row is within when FID, "
                  "precision, recall and class accuracy all fall inside.", ""]
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
    against FID, AR's interval as a band), each where the result has the data."""
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
            # A row outside AR's spread on any judged metric is drawn hollow, whatever its FID.
            hollow = bool(r.outside_ar_spread)
            colour = "tab:green" if token else "black"
            fid = r.quality["fid"]
            clipped = top is not None and fid > top
            y = top if clipped else fid
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
                   label=f"AR, {len(result.ar_spread.seeds)} seeds: 95 % interval")
        ax.legend(fontsize=7)
    ax.set_xlabel("wall-clock speed-up vs AR")
    ax.set_ylabel(f"FID ({result.meta.get('feature_net_short', 'lantern feature net')})")
    ax.set_title("quality vs speed (lower FID is better)" + (
        "\nhollow: outside AR's spread (FID, precision, recall or class accuracy)"
        if result.ar_spread is not None else ""), fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    with atomic_path(out / "frontier.png") as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)
