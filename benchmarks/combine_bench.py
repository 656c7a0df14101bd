"""One table and one frontier picture from two ``lantern bench`` runs of the same methods: speed
from a speed-only run on a quiet machine (``--no-quality``), tau and quality (with AR's spread over
seeds) from a quality run that may have run while the machine was busy: token counts and metrics do
not depend on machine load, wall-clock ratios do.

    python benchmarks/combine_bench.py --speed bench-speed --quality bench-quality [more-quality ...] --out combined

Several quality runs (same model, seed, images and real set) add their rows in order; AR's spread is
the first run's, and a method already listed is not repeated.

Writes ``combined/bench.md`` (the table, both commands, AR's bounds and the rule) and ``combined/frontier.png``;
with ``--save-calibration FILE``, also the calibration ``--method auto`` reads: the speed run's
timings (its ``--speed-batch-size`` list gives the batch sizes) with the quality runs' verdicts,
for the rows run at their method's defaults (what ``lantern bench --save-calibration`` writes from
one run; here the timings come from a quiet run and the verdicts from a run that may have been busy).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from lantern.eval.report import ARSpread, BenchResult, BenchRow, format_table, save_plots

# bench.json fields no longer written (sides of the earlier two-sided verdict): rows are re-judged here.
LEGACY_FIELDS = ("outside_sides",)
SPEED_FIELDS = ("wall_seconds", "seconds_per_image", "speedup_vs_ar", "speedup_ci", "speed_images",
                "wall_seconds_repeats", "startup_seconds")


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
            "feature_net_short": runs_q[0].get("feature_net_short", "lantern feature net"),
            "feature_net": runs_q[0].get("feature_net"), "quality_commands": [r["command"] for r in runs_q]}
    meta.update({k: run_s[k] for k in ("config", "methods", "threads", "sampling", "machine", "busy_warning")
                 if k in run_s})
    return BenchResult(rows, meta, ar_spread, {}, [], {}, [], run_s.get("throughput", [])), run_s, runs_q


def save_calibration(result: BenchResult, run_s: dict, path: Path) -> Path:
    """The combined rows as a calibration of the speed run's model and device setting."""
    from lantern.api import load
    from lantern.calibration import Setup
    from lantern.eval.calibrate import calibration_from_bench

    cfg = run_s["config"]
    unjudged = [m for m in run_s["methods"] if m not in {r.method for r in result.rows}]
    if unjudged:
        raise SystemExit(f"the quality runs lack the methods {unjudged}: their verdicts are needed")
    pipe = load(run_s["model"], device=run_s["device"], dtype=run_s["dtype"], compile=cfg.get("compile"))
    setup = Setup.of(run_s["model"], pipe.stack.root, run_s["device"], pipe.stack.dtype, cfg.get("compile"))
    command = f"{run_s['command']}  +  " + "  +  ".join(r for r in result.meta["quality_commands"])
    calibration, skipped = calibration_from_bench(result, pipe.stack, setup, command)
    print(f"calibration: {len(calibration.methods)} methods at their defaults, batch sizes "
          f"{list(calibration.batch_sizes)}; not at their defaults, left out: {', '.join(skipped) or 'none'}")
    return calibration.save(path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--speed", type=Path, required=True, help="a `lantern bench --no-quality` output folder")
    p.add_argument("--quality", type=Path, nargs="+", required=True,
                   help="`lantern bench` output folders with quality (AR's spread from the first)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--save-calibration", type=Path, default=None, metavar="FILE",
                   help="also write the calibration --method auto reads (speed run's timings, quality runs' verdicts)")
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
    if args.save_calibration is not None:
        print(f"wrote {save_calibration(result, run_s, args.save_calibration)}")


if __name__ == "__main__":
    main()
