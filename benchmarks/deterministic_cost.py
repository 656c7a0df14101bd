"""What ``--deterministic`` (batch-invariant matmuls) costs: the same images decoded by a default and
a deterministic pipeline, side by side in one process, in rotating order (drift hits both alike).

    python benchmarks/deterministic_cost.py --model photos --methods ar,lantern++,sjd-coupled \
        --batch-sizes 1,8 --images 8 --repeats 3 [--compile default] [--no-single-calls] [--smallest-calls] \
        [--fused-attention] [--no-tail]

Prints, per method and batch size, the median wall seconds per image of each mode and their ratio.
``--no-single-calls`` adds a deterministic pipeline whose layers pad every call to a multiple of
their smallest chunk (how the mode chunked rows before the single-call sizes were probed on a
CPU), ``--smallest-calls`` one held to its smallest chunk alone (before larger calls were
probed), ``--fused-attention`` one whose attention is one fused call over the cache the tree
needs (the mode before its attention was held to probed shapes: batch-invariant, but a query's
bits then follow the query count and the cache length), ``--no-tail`` one whose attention keeps a
query's last keys in the kernel call (the mode before the tail: a tree node's bits then follow
where its ancestors sit), to show what each saves.
Run it alone on the machine: timings on a busy machine lie.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import lantern
from lantern.models.invariant import AttentionCalls, RowChunkedLinear


def held_to(pipe: lantern.Pipeline, smallest_only: bool) -> lantern.Pipeline:
    """``pipe`` with no chunked layer taking a single-call size and, with ``smallest_only``, none a
    call above its smallest chunk either (the same bits: every kept size gives a row the smallest
    call's)."""
    for net in (pipe.stack.network(), pipe.drafter):
        for layer in [] if net is None else net.modules():
            if type(layer) is RowChunkedLinear:
                layer.invariant_single = ()
                if smallest_only:
                    layer.invariant_chunks = layer.invariant_chunks[:1]
    return pipe


def fused_attention(pipe: lantern.Pipeline) -> lantern.Pipeline:
    """``pipe`` with every attention layer back to one fused call (and so its caches back to the
    length the tree needs: ``key_granule`` reads the layers)."""
    for net in (pipe.stack.network(), pipe.drafter):
        for layer in [] if net is None else net.modules():
            if hasattr(type(layer), "attention_calls"):
                layer.attention_calls = None
    return pipe


def without_tail(pipe: lantern.Pipeline) -> lantern.Pipeline:
    """``pipe`` with every attention layer's keys all in its kernel calls (no tail)."""
    for net in (pipe.stack.network(), pipe.drafter):
        for layer in [] if net is None else net.modules():
            calls = getattr(layer, "attention_calls", None)
            if isinstance(calls, AttentionCalls):
                layer.attention_calls = dataclasses.replace(calls, tail=0)
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
    p.add_argument("--no-single-calls", action="store_true")
    p.add_argument("--smallest-calls", action="store_true")
    p.add_argument("--fused-attention", action="store_true")
    p.add_argument("--no-tail", action="store_true")
    args = p.parse_args()
    variants = {"no single calls": args.no_single_calls, "smallest calls": args.smallest_calls,
                "fused attention": args.fused_attention, "no tail": args.no_tail}
    pipes = {mode: lantern.load(args.model, compile=args.compile, dtype=args.dtype, deterministic=mode != "default")
             for mode in ("default", "deterministic", *(v for v, asked in variants.items() if asked))}
    for v in ("no single calls", "smallest calls"):
        if v in pipes:
            held_to(pipes[v], smallest_only=v == "smallest calls")
    if "fused attention" in pipes:
        fused_attention(pipes["fused attention"])
    if "no tail" in pipes:
        without_tail(pipes["no tail"])
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
