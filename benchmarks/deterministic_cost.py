"""What ``--deterministic`` (batch-invariant matmuls) costs: the same images decoded by a default and
a deterministic pipeline, side by side in one process, in rotating order (drift hits both alike).

    python benchmarks/deterministic_cost.py --model photos --methods ar,lantern++,sjd-coupled \
        --batch-sizes 1,8 --images 8 --repeats 3 [--compile default] [--smallest-calls]

Prints, per method and batch size, the median wall seconds per image of each mode and their ratio.
``--smallest-calls`` adds a third pipeline, deterministic with every layer held to its smallest
call size (how the mode chunked rows before larger calls were probed), to show what they save.
Run it alone on the machine: timings on a busy machine lie.
"""

from __future__ import annotations

import argparse
import statistics
import time

import lantern
from lantern.models.invariant import RowChunkedLinear


def smallest_calls_only(pipe: lantern.Pipeline) -> lantern.Pipeline:
    """``pipe`` with every chunked layer held to its smallest call size (the same bits)."""
    for net in (pipe.stack.network(), pipe.drafter):
        for layer in [] if net is None else net.modules():
            if type(layer) is RowChunkedLinear:
                layer.invariant_chunks = layer.invariant_chunks[:1]
    return pipe


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="photos")
    p.add_argument("--methods", default="ar,lantern++,sjd-coupled")
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--images", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--compile", default="off")
    p.add_argument("--dtype", default="float32", help="as lantern.load (float32: the server's default)")
    p.add_argument("--smallest-calls", action="store_true")
    args = p.parse_args()
    pipes = {mode: lantern.load(args.model, compile=args.compile, dtype=args.dtype, deterministic=mode != "default")
             for mode in ("default", "deterministic", *(["smallest calls"] if args.smallest_calls else []))}
    if args.smallest_calls:
        smallest_calls_only(pipes["smallest calls"])
    modes = list(pipes)
    labels = [i % (pipes["default"].stack.num_classes or 1) for i in range(args.images)]
    print(f"{'method':<12} {'batch':>5} " + " ".join(f"{m + ' s/img':>20} {'ratio':>6}" for m in modes))
    for method in args.methods.split(","):
        for batch in (int(b) for b in args.batch_sizes.split(",")):
            times: dict[str, list[float]] = {mode: [] for mode in modes}
            for _ in range(2):  # warm-up (and compilation) for every mode
                for pipe in pipes.values():
                    pipe(labels=labels[:batch], method=method, batch_size=batch, seed=99)
            for r in range(args.repeats):
                for mode in modes[r % len(modes):] + modes[: r % len(modes)]:
                    start = time.perf_counter()
                    pipes[mode](labels=labels, method=method, batch_size=batch, seed=r)
                    times[mode].append((time.perf_counter() - start) / len(labels))
            base = statistics.median(times["default"])
            print(f"{method:<12} {batch:>5} " + " ".join(
                f"{statistics.median(times[m]):>20.3f} {statistics.median(times[m]) / base:>5.2f}x" for m in modes),
                flush=True)


if __name__ == "__main__":
    main()
