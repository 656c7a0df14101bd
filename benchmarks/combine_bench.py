"""One table and one frontier picture from two ``lantern bench`` runs of the same methods: speed
from a speed-only run on a quiet machine (``--no-quality``), tau and quality (with AR's spread over
seeds) from a quality run that may have run while the machine was busy: token counts and metrics do
not depend on machine load, wall-clock ratios do.

    python benchmarks/combine_bench.py --speed bench-speed --quality bench-quality --out combined

Writes ``combined/bench.md`` (the table, both commands, AR's interval) and ``combined/frontier.png``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from lantern.eval.report import ARSpread, BenchResult, BenchRow, format_table, save_plots

SPEED_FIELDS = ("wall_seconds", "seconds_per_image", "speedup_vs_ar", "speed_images", "wall_seconds_repeats",
                "startup_seconds")


def read_rows(folder: Path) -> dict[str, BenchRow]:
    names = {f.name for f in dataclasses.fields(BenchRow)}
    rows = {}
    for d in json.loads((folder / "bench.json").read_text()):
        row = BenchRow(**{k: v for k, v in d.items() if k in names and k != "quality"})
        row.quality = {k: v for k, v in d.items() if k not in names}
        rows[row.method] = row
    return rows


def combine(speed_dir: Path, quality_dir: Path) -> tuple[BenchResult, dict, dict]:
    speed, quality = read_rows(speed_dir), read_rows(quality_dir)
    missing = [m for m in quality if m not in speed]
    if missing:
        raise SystemExit(f"--speed run lacks the methods {missing}")
    run_q = json.loads((quality_dir / "run.json").read_text())
    run_s = json.loads((speed_dir / "run.json").read_text())
    spread = run_q.get("ar_spread")
    ar_spread = None if spread is None else ARSpread(tuple(spread["seeds"]), spread["values"])
    rows = []
    for name, row in quality.items():
        row = dataclasses.replace(row, **{k: getattr(speed[name], k) for k in SPEED_FIELDS})
        row.outside_ar_spread = None if ar_spread is None else ar_spread.outside(row.quality)
        rows.append(row)
    meta = {"model": run_q.get("model", "?"),
            "feature_net_short": run_q.get("feature_net_short", "lantern feature net")}
    return BenchResult(rows, meta, ar_spread, {}, [], {}, []), run_s, run_q


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--speed", type=Path, required=True, help="a `lantern bench --no-quality` output folder")
    p.add_argument("--quality", type=Path, required=True, help="a `lantern bench` output folder with quality")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    result, run_s, run_q = combine(args.speed, args.quality)
    args.out.mkdir(parents=True, exist_ok=True)
    table = format_table(result.rows, markdown=True)
    lines = [f"# {result.meta['model']}: speed from one run, tau and quality from another", "",
             f"- speed: `{run_s['command']}`", f"- quality: `{run_q['command']}`", "", table, ""]
    if result.ar_spread is not None:
        lines += [f"AR's spread over {len(result.ar_spread.seeds)} seeds, 95 % prediction interval: "
                  f"{result.ar_spread.describe()}", ""]
    (args.out / "bench.md").write_text("\n".join(lines))
    save_plots(result, args.out)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
