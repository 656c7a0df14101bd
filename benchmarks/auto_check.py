"""Does ``--method auto`` pick the fastest method of its quality class? Its choice, read from a
calibration, against a second, independent speed run of the class's methods on the same machine.

    python benchmarks/auto_check.py --calibration cal.json --speed q/check-speed

``q/check-speed`` is a ``lantern bench --no-quality --speed-batch-size 1,8`` run of the calibration's
candidates (made after the calibration, so the two timings are independent). For each batch size
the check run timed and each quality class, it prints auto's choice, the class's fastest method in
the check run (by the calibration's own verdicts) and how much slower the choice is there
(the target: within 10 %). Methods of the calibration the check run did not time are left out of
the class, so list every eligible method in the check run.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from lantern.calibration import QUALITY_CLASSES, choose_method, load_calibration


def check_seconds(folder: Path) -> dict[int, dict[str, float]]:
    """Seconds per image of every method at every batch size a bench run timed."""
    run = json.loads((folder / "run.json").read_text())
    rows = json.loads((folder / "bench.json").read_text())
    out = {int(run["config"]["speed_batch_size"]): {r["method"]: float(r["seconds_per_image"]) for r in rows}}
    for p in run.get("throughput", []):
        out.setdefault(int(p["batch_size"]), {})[p["method"]] = 1.0 / float(p["images_per_second"])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calibration", type=Path, required=True)
    p.add_argument("--speed", type=Path, required=True, help="a later `lantern bench --no-quality` run")
    p.add_argument("--out", type=Path, default=None, help="also write the table here (markdown)")
    args = p.parse_args()
    calibration = load_calibration(args.calibration)
    timed = check_seconds(args.speed)
    lines = ["| batch | quality | auto's choice (calibration s/img) | fastest of the class in the check run | "
             "choice's s/img in the check run | slower by |", "|---|---|---|---|---|---|"]
    for batch, seconds in sorted(timed.items()):
        for quality in QUALITY_CLASSES:
            choice = choose_method(calibration, quality, batch, str(args.calibration))
            eligible = {m: s for m, s in seconds.items() if m in dict(choice.ranking)}
            if choice.method not in eligible:
                raise SystemExit(f"the check run did not time auto's choice {choice.method} at batch {batch}")
            best = min(eligible, key=eligible.__getitem__)
            slower = eligible[choice.method] / eligible[best] - 1
            lines.append(f"| {batch} | {quality} | {choice.method} ({dict(choice.ranking)[choice.method]:.3f}) | "
                         f"{best} ({eligible[best]:.3f}) | {eligible[choice.method]:.3f} | {slower:+.1%} |")
    table = "\n".join(lines)
    print(table)
    if args.out is not None:
        args.out.write_text(table + "\n")


if __name__ == "__main__":
    main()
