"""Greedy lossless methods against greedy AR, row by row, in the default and the deterministic mode.

    python benchmarks/greedy_equality.py --model digits --dtype bfloat16 [--device cuda] \
        [--methods sd,sjd,sjd-coupled] [--images 8] [--compile off] [--out greedy.json]

At temperature 0 a lossless method must give AR's codes token for token. The default mode's
attention may round a position apart in a multi-query forward over a longer cache (a verified
tree) and in an AR step, and a near-tie then parts the row (in bfloat16 on ``digits``: 7 of 8
``sd`` rows); the deterministic mode calls the kernel at probed shapes (lantern.models.invariant,
``attention_calls``). Prints, per mode and method, the rows whose codes differ from AR's and the
first token where they part, and the deterministic mode's probed attention calls. Counts, not
timings: it may share the machine.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import torch

import lantern
from lantern.methods import METHOD_TABLE

LOSSLESS = [m.name for m in METHOD_TABLE.values() if m.lossless and m.name != "ar"]


def parted(codes: torch.Tensor, ar: torch.Tensor) -> dict[int, int]:
    """Row -> the first token at which its codes leave AR's."""
    flat, ref = codes.flatten(1), ar.flatten(1)
    return {i: int((flat[i] != ref[i]).nonzero()[0]) for i in range(len(flat)) if not torch.equal(flat[i], ref[i])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="digits")
    p.add_argument("--dtype", default="bfloat16", help="as lantern.load; auto: bf16 where the hardware has it")
    p.add_argument("--device", default="cpu")
    p.add_argument("--compile", default="off")
    p.add_argument("--methods", default=",".join(LOSSLESS))
    p.add_argument("--images", type=int, default=8)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    report: dict[str, Any] = {"model": args.model, "dtype": args.dtype, "device": args.device}
    for mode in ("default", "deterministic"):
        pipe = lantern.load(args.model, device=args.device, dtype=args.dtype, compile=args.compile,
                            deterministic=mode == "deterministic")
        labels = [i % (pipe.stack.num_classes or 1) for i in range(args.images)]
        if mode == "deterministic":
            calls = {m.attention_calls for m in pipe.stack.network().modules() if hasattr(type(m), "attention_calls")}
            report["attention_calls"] = [repr(c) for c in calls]
            print("attention calls:", *calls, flush=True)
        ar = pipe(labels=labels, method="ar", temperature=0, seed=0).codes
        rows: dict[str, dict[int, int]] = {}
        for method in args.methods.split(","):
            rows[method] = parted(pipe(labels=labels, method=method, temperature=0, seed=0).codes, ar)
            print(f"{mode:<13} {method:<14} rows parted from AR: {len(rows[method])} of {len(labels)}"
                  + (f" (first tokens {sorted(rows[method].values())})" if rows[method] else ""), flush=True)
        report[mode] = rows
    if args.out:
        with open(args.out + ".part", "w") as f:
            json.dump(report, f, indent=1)
        os.replace(args.out + ".part", args.out)


if __name__ == "__main__":
    main()
