"""What ``--deterministic`` (batch-invariant matmuls) costs: the same images decoded by a default and
a deterministic pipeline, side by side in one process, in alternating order (drift hits both alike).

    python benchmarks/deterministic_cost.py --model photos --methods ar,lantern++,sjd-coupled \
        --batch-sizes 1,8 --images 8 --repeats 3 [--compile default]

Prints, per method and batch size, the median wall seconds per image of each mode and their ratio.
Run it alone on the machine: timings on a busy machine lie.
"""

from __future__ import annotations

import argparse
import statistics
import time

import lantern


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="photos")
    p.add_argument("--methods", default="ar,lantern++,sjd-coupled")
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--images", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--compile", default="off")
    args = p.parse_args()
    pipes = {mode: lantern.load(args.model, compile=args.compile, deterministic=mode) for mode in (False, True)}
    labels = [i % (pipes[False].stack.num_classes or 1) for i in range(args.images)]
    print(f"{'method':<12} {'batch':>5} {'default s/img':>14} {'deterministic s/img':>20} {'ratio':>6}")
    for method in args.methods.split(","):
        for batch in (int(b) for b in args.batch_sizes.split(",")):
            times: dict[bool, list[float]] = {False: [], True: []}
            for _ in range(2):  # warm-up (and compilation) for both
                for pipe in pipes.values():
                    pipe(labels=labels[:batch], method=method, batch_size=batch, seed=99)
            for r in range(args.repeats):
                for mode in ((False, True) if r % 2 == 0 else (True, False)):
                    start = time.perf_counter()
                    pipes[mode](labels=labels, method=method, batch_size=batch, seed=r)
                    times[mode].append((time.perf_counter() - start) / len(labels))
            off, on = statistics.median(times[False]), statistics.median(times[True])
            print(f"{method:<12} {batch:>5} {off:>14.3f} {on:>20.3f} {on / off:>5.2f}x", flush=True)


if __name__ == "__main__":
    main()
