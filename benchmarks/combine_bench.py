"""One table and one frontier picture from two ``lantern bench`` runs of the same methods: speed
from a speed-only run on a quiet machine (``--no-quality``), tau and quality (with AR's spread over
seeds) from a quality run that may have run while the machine was busy: token counts and metrics do
not depend on machine load, wall-clock ratios do.

    python benchmarks/combine_bench.py --speed bench-speed --quality bench-quality [more-quality ...] --out combined

Several quality runs (same model, seed, images and real set) add their rows in order; AR's spread is
the first run's, and a method already listed is not repeated.

Writes ``combined/bench.md`` (the table, both commands, AR's bounds and the rule) and ``combined/frontier.png``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from lantern.eval.report import ARSpread, BenchResult, BenchRow, format_table, save_plots

# bench.json fields no longer written (sides of the earlier two-sided verdict): rows are re-judged here.
LEGACY_FIELDS = ("outside_sides",)
SPEED_FIELDS = ("wall_seconds", "seconds_per_image", "speedup_vs_ar", "speed_images", "wall_seconds_repeats",
                "startup_seconds")


def read_rows(folder: Path) -> dict[str, BenchRow]:
    names = {f.name for f in dataclasses.fields(BenchRow)}
    rows = {}
    for d in json.loads((folder / "bench.json").read_text()):
        row = BenchRow(**{k: v for k, v in d.items() if k in names and k != "quality"})
        row.quality = {k: v for k, v in d.items() if k not in names and k not in LEGACY_FIELDS}
        rows[row.method] = row
    return rows


def combine(speed_dir: Path, quality_dirs: list[Path]) -> tuple[BenchResult, dict, list[dict]]:
    speed = read_rows(speed_dir)
    quality: dict[str, BenchRow] = {}
    for folder in quality_dirs:
        for name, row in read_rows(folder).items():
            quality.setdefault(name, row)
    missing = [m for m in quality if m not in speed]
    if missing:
        raise SystemExit(f"--speed run lacks the methods {missing}")
    runs_q = [json.loads((folder / "run.json").read_text()) for folder in quality_dirs]
    run_s = json.loads((speed_dir / "run.json").read_text())
    spread = runs_q[0].get("ar_spread")
    ar_spread = None if spread is None else ARSpread.from_dict(spread)
    rows = []
    for name, row in quality.items():
        row = dataclasses.replace(row, **{k: getattr(speed[name], k) for k in SPEED_FIELDS})
        if ar_spread is not None:
            ar_spread.judge(row)
        rows.append(row)
    meta = {"model": runs_q[0].get("model", "?"),
            "feature_net_short": runs_q[0].get("feature_net_short", "lantern feature net")}
    return BenchResult(rows, meta, ar_spread, {}, [], {}, []), run_s, runs_q


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--speed", type=Path, required=True, help="a `lantern bench --no-quality` output folder")
    p.add_argument("--quality", type=Path, nargs="+", required=True,
                   help="`lantern bench` output folders with quality (AR's spread from the first)")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    result, run_s, runs_q = combine(args.speed, args.quality)
    args.out.mkdir(parents=True, exist_ok=True)
    table = format_table(result.rows, markdown=True)
    lines = [f"# {result.meta['model']}: speed from one run, tau and quality from another", "",
             f"- speed: `{run_s['command']}` (machine: {run_s.get('machine_load')})",
             *([f"- **{run_s['busy_warning']}**"] if run_s.get("busy_warning") else []),
             *[f"- quality: `{r['command']}`" for r in runs_q], "", table, ""]
    if result.ar_spread is not None:
        lines += [result.ar_spread.summary(), ""]
    (args.out / "bench.md").write_text("\n".join(lines))
    save_plots(result, args.out)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
