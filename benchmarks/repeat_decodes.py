"""Decode after decode on one compiled pipeline: does each decode's time and memory stay flat?

    python benchmarks/repeat_decodes.py --model photos --device cuda --compile auto --calls 24 \
        --methods ar,lantern++,sjd-coupled --out repeat.json

A compiled round marks its state's tensors as fixed addresses (CUDA graphs replay on fixed
buffers). Some of that state is allocated anew by every decode (a 2026-11-30 review counted 10 of
15 such tensors for AR, 24 of 31 for sjd-coupled at new addresses between two decodes on a CPU),
and on a GPU a changed fixed address can make torch record the graph again. If it does, every
decode pays a recording (its time does not fall to a steady value after the first calls) and the
graphs' memory may grow; past torch's re-record limit the round may fall back to eager. This
script measures it: ``--calls`` one-image decodes per method (each its own seed) on one pipeline,
each call's seconds and, on CUDA, the allocator's memory after it, with ``TORCH_LOGS`` left to the
caller (``TORCH_LOGS=recompiles,perf_hints,cudagraphs`` names what torch did). It also decodes
one image with tiny Chameleon-family and Emu3 folders (``--families``), eager and compiled: those
targets had never run on a GPU before their code table was put on the model's device.

Prints one line per method (first call, median of the last half, max/median of the last half,
memory growth from the second call to the last) and writes every number to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import lantern


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _memory(device: str) -> int | None:
    return int(torch.cuda.memory_allocated()) if torch.device(device).type == "cuda" else None


def repeat(pipe: Any, method: str, calls: int, device: str) -> dict[str, Any]:
    """``calls`` one-image decodes of ``method``: seconds and memory after each."""
    seconds: list[float] = []
    memory: list[int | None] = []
    for i in range(calls):
        _sync(device)
        start = time.perf_counter()
        pipe(labels=[i % 10], seed=i, method=method, batch_size=1)
        _sync(device)
        seconds.append(time.perf_counter() - start)
        memory.append(_memory(device))
    tail = seconds[len(seconds) // 2:]
    steady = statistics.median(tail)
    grown = None if memory[1] is None or memory[-1] is None else memory[-1] - memory[1]
    return {"method": method, "seconds": seconds, "memory": memory, "first": seconds[0], "steady": steady,
            "tail_max_over_median": max(tail) / steady, "memory_growth_bytes": grown}


def families(device: str, compile: str) -> list[dict[str, Any]]:
    """One image from a tiny Chameleon (Lumina-mGPT layout) and a tiny Emu3 folder, eager and compiled."""
    from lantern.testing import make_tiny_chameleon_folder, make_tiny_emu3_folder

    out = []
    with tempfile.TemporaryDirectory() as tmp:
        folders = {"chameleon": make_tiny_chameleon_folder(Path(tmp) / "chameleon"),
                   "emu3": make_tiny_emu3_folder(Path(tmp) / "emu3")}
        for name, folder in folders.items():
            for mode in ("off", compile):
                record: dict[str, Any] = {"family": name, "compile": mode}
                try:
                    pipe = lantern.load(folder, device=device, compile=mode)
                    start = time.perf_counter()
                    result = pipe(prompts=["a red square"], seed=0, method="sjd-coupled", sjd_window=4, batch_size=1)
                    record.update(ok=True, seconds=time.perf_counter() - start,
                                  tokens=int(result.codes.numel()))
                except Exception as e:  # a measurement script: record what failed and go on
                    record.update(ok=False, error=f"{type(e).__name__}: {e}"[:500])
                out.append(record)
                print(f"{name} compile={mode}: " + ("ok" if record["ok"] else record["error"]))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="photos")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--compile", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--calls", type=int, default=24)
    p.add_argument("--methods", default="ar,lantern++,sjd-coupled")
    p.add_argument("--families", action="store_true", help="also tiny Chameleon and Emu3 folders, eager and compiled")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    pipe = lantern.load(args.model, device=args.device, dtype=args.dtype, compile=args.compile)
    rows = []
    for method in args.methods.split(","):
        row = repeat(pipe, method, args.calls, args.device)
        rows.append(row)
        growth = row["memory_growth_bytes"]
        print(f"{method}: first {row['first']:.3f} s, steady {row['steady']:.4f} s per image, last half max/median "
              f"{row['tail_max_over_median']:.2f}" + ("" if growth is None else f", memory {growth / 2**20:+.1f} MiB "
                                                     f"from call 2 to {args.calls}"))
    record = {"model": args.model, "device": args.device, "compile": args.compile, "calls": args.calls,
              "torch": torch.__version__, "rows": rows,
              "families": families(args.device, args.compile) if args.families else []}
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
