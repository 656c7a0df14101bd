"""Tokens per target forward (tau) of the Jacobi methods by first guess, on an embedded preset.

Counts, not timings: they do not depend on machine load. Usage:
    python benchmarks/first_guess_tau.py [--model photos] [--images 16] [--batch-size 8] [--only pjd]
"""

from __future__ import annotations

import argparse

import lantern
from lantern.decoding.config import PJD_INITS

# PJD at its defaults (window 4, context 8), and lossless (context = the row length: one row at a
# time, windows running across row ends) with the default window and with SJD's window of 16.
PJD_ROWS = [("pjd", {}), ("pjd-lantern", {}), ("pjd", {"pjd_context": 16}),
            ("pjd", {"pjd_context": 16, "pjd_window": 16})]
ROWS = [
    *[(method, {**settings, "pjd_init": init}) for method, settings in PJD_ROWS for init in PJD_INITS],
    ("sjd", {}), ("sjd-lantern", {"sjd_init": "random"}), ("sjd-lantern", {"sjd_init": "repeat_horizon"}),
    ("sjd-coupled-lantern", {}),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="photos")
    parser.add_argument("--images", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--only", default=None, help="only the rows of this method")
    args = parser.parse_args()
    pipe = lantern.load(args.model)
    labels = [i % 10 for i in range(args.images)]
    print("| method | settings | tau |\n|---|---|---|")
    for method, settings in ROWS:
        if args.only is not None and method != args.only:
            continue
        out = pipe(labels=labels, method=method, seed=0, batch_size=args.batch_size, **settings)
        print(f"| {method} | {settings} | {out.stats['mean_accepted']:.3f} |", flush=True)


if __name__ == "__main__":
    main()
