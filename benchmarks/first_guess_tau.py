"""Tokens per target forward (tau) of the Jacobi methods by first guess, on an embedded preset.

Counts, not timings: they do not depend on machine load. Usage:
    python benchmarks/first_guess_tau.py [--model photos] [--images 16] [--batch-size 8]
"""

from __future__ import annotations

import argparse

import lantern

ROWS = [
    ("pjd", {"pjd_init": "random"}), ("pjd", {"pjd_init": "row_above"}),
    ("pjd-lantern", {"pjd_init": "random"}), ("pjd-lantern", {"pjd_init": "row_above"}),
    ("pjd", {"pjd_context": 16, "pjd_init": "random"}), ("pjd", {"pjd_context": 16, "pjd_init": "row_above"}),
    ("sjd", {}), ("sjd-lantern", {"sjd_init": "random"}), ("sjd-lantern", {"sjd_init": "repeat_horizon"}),
    ("sjd-coupled-lantern", {}),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="photos")
    parser.add_argument("--images", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args()
    pipe = lantern.load(args.model)
    labels = [i % 10 for i in range(args.images)]
    print("| method | settings | tau |\n|---|---|---|")
    for method, settings in ROWS:
        out = pipe(labels=labels, method=method, seed=0, batch_size=args.batch_size, **settings)
        print(f"| {method} | {settings} | {out.stats['mean_accepted']:.3f} |", flush=True)


if __name__ == "__main__":
    main()
