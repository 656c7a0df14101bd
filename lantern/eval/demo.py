"""``lantern demo``: the same labels and seeds decoded with AR and with relaxed speculative
decoding, timed side by side in one process, with a PNG grid to compare the images.

Timing (shared with ``lantern bench``): every method first decodes one untimed image, then the
methods take turns image by image in a rotating order, ``repeats`` times, and the median
wall-clock per method is reported, so the drift of a shared machine hits every method alike.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw

from lantern.decoding.compiling import resolve_compile
from lantern.decoding.config import SamplingConfig
from lantern.errors import check
from lantern.images import image_grid, save_png
from lantern.io import atomic_path, ensure_writable_dir, finite_or_null, write_json
from lantern.methods import method_record, resolve_method
from lantern.parts import ModelParts
from lantern.run import RunResult
from lantern.targets.base import Stack

DEFAULT_METHODS = ("ar", "lantern++", "lantern", "sd")
DEMO_PROMPT_IMAGES = 4  # default image count for stacks without classes (one per label otherwise)


@dataclass
class MethodTiming:
    method: str
    mean_accepted: float
    target_forwards: int
    wall_seconds: float
    speedup_vs_ar: float
    result: RunResult

    def row(self) -> dict[str, Any]:
        return {"method": self.method, "mean_accepted": round(self.mean_accepted, 3),
                "target_forwards": self.target_forwards, "wall_seconds": round(self.wall_seconds, 3),
                "speedup_vs_ar": round(self.speedup_vs_ar, 3), "resolved": self.result.method.to_dict()}


def run_demo(
    stack: Stack,
    sampling: SamplingConfig,
    methods: tuple[str, ...] = DEFAULT_METHODS,
    num_images: int = 8,
    seed: int = 0,
    batch_size: int = 8,
    repeats: int = 1,
    progress: bool = True,
    budget: str | None = None,
    compile: str | None = None,
    settings: Mapping[str, Mapping[str, Any]] | None = None,
    parts: ModelParts | None = None,
) -> list[MethodTiming]:
    """``settings``: per-method overrides by their keyword names (e.g. ``{"sjd": {"sjd_window": 8}}``);
    ``parts``: the loaded drafter and proximity table (default: the stack's own, read once here)."""
    check("ar" in methods, "--methods must include ar (the speed-up baseline)")
    check(num_images >= 1, f"--num-images must be >= 1, got {num_images}")
    check(repeats >= 1, f"--repeats must be >= 1, got {repeats}")
    labels = stack.sample_conditions(num_images)
    # --lantern-budget applies to LANTERN's relaxed rules only (GSD's groups take none)
    settings = settings or {}
    configs = {m: resolve_method(m, stack, lantern_budget=budget if method_record(m).needs_proximity else None,
                                 **settings.get(m, {}))
               for m in methods}

    from lantern.eval.bench import time_methods

    results, walls = time_methods(stack, sampling, configs, labels, seed, batch_size, repeats, progress,
                                  compile=resolve_compile(compile, stack.device), parts=parts)
    ar_wall = statistics.median(walls["ar"])
    out = []
    for m in methods:
        stats = results[m].stats_dict()
        wall = statistics.median(walls[m])
        out.append(MethodTiming(m, stats["mean_accepted"], stats["target_forwards"], wall, ar_wall / wall, results[m]))
    return out


def format_table(rows: list[MethodTiming]) -> str:
    from lantern.eval.report import tree_label

    trees = [tree_label(r.result.method) for r in rows]
    m = max([10, *(len(r.method) for r in rows)])  # columns as wide as their longest entry
    t = max([22, *(len(tree) for tree in trees)])
    head = (f"{'method':<{m}} {'tree':<{t}} {'mean accepted':>13} {'target forwards':>15} {'wall s':>8} "
            f"{'speed-up':>9}")
    lines = [head, "-" * len(head)]
    for r, tree in zip(rows, trees, strict=True):
        lines.append(f"{r.method:<{m}} {tree:<{t}} {r.mean_accepted:>13.2f} "
                     f"{r.target_forwards:>15d} {r.wall_seconds:>8.2f} {r.speedup_vs_ar:>8.2f}x")
    return "\n".join(lines)


def comparison_grid(stack: Stack, rows: list[MethodTiming], scale: int = 2) -> Image.Image:
    """One row per method (same labels and seeds across a column), method names on the left."""
    strips = []
    for r in rows:
        images = stack.to_pil(r.result.codes)
        images = [im.convert("RGB").resize((im.width * scale, im.height * scale), Image.Resampling.NEAREST)
                  for im in images]
        strips.append(image_grid(images, ncol=len(images)))
    label_w = 90
    width = label_w + max(s.width for s in strips)
    canvas = Image.new("RGB", (width, sum(s.height for s in strips)), "white")
    draw = ImageDraw.Draw(canvas)
    y = 0
    for r, strip in zip(rows, strips, strict=True):
        canvas.paste(strip, (label_w, y))
        draw.text((4, y + strip.height // 2 - 12), r.method, fill="black")
        draw.text((4, y + strip.height // 2 + 2), f"{r.speedup_vs_ar:.2f}x, tau {r.mean_accepted:.2f}", fill="gray")
        y += strip.height
    return canvas


def save_demo(stack: Stack, rows: list[MethodTiming], out: str | os.PathLike[str], meta: dict[str, Any]) -> Path:
    out = ensure_writable_dir(out, "--out")
    save_png(comparison_grid(stack, rows), out / "demo_grid.png")
    write_json(out / "demo.json", finite_or_null({**meta, "results": [r.row() for r in rows]}))
    with atomic_path(out / "demo.md") as tmp:
        tmp.write_text(f"```\n{format_table(rows)}\n```\n")
    return out
