"""Decode after decode on one compiled pipeline: does each decode's time and memory stay flat?

    python benchmarks/repeat_decodes.py --model photos --device cuda --compile auto --calls 24 \
        --methods ar,lantern++,sjd-coupled --out repeat.json

A compiled round marks its state's tensors as fixed addresses (CUDA graphs replay on fixed
buffers), and on a GPU a marked tensor found at another address makes torch record the graph
again. Much of that state used to be allocated anew by every decode (a 2026-11-30 review counted
10 of 15 such tensors for AR, 24 of 31 for sjd-coupled at new addresses between two decodes on a
CPU); ``lantern.decoding.resident`` now keeps it at the previous decode's addresses from a
fingerprint's second decode on (tests/test_resident.py checks the addresses on a CPU). What is left
to see on a GPU is whether torch agrees: if it still re-records, every decode pays a recording (its
time does not fall to a steady value after the first calls), the graphs' memory grows, and past
torch's re-record limit the round may fall back to eager. This
script measures it: ``--calls`` one-image decodes per method (each its own seed) on one pipeline,
each call's seconds and, on CUDA, the allocator's memory after it, with ``TORCH_LOGS`` left to the
caller (``TORCH_LOGS=recompiles,perf_hints,cudagraphs`` names what torch did). It also decodes
one image with tiny Chameleon-family and Emu3 folders (``--families``), eager and compiled: those
targets had never run on a GPU before their code table was put on the model's device.

Prints one line per method (first call, median of the last half, max/median of the last half,
memory growth from the second call to the last, CUDA graphs recorded per call: 0 from the third
call on if the residents hold on the GPU) and writes every number to ``--out``.
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


class Recordings:
    """CUDA graphs torch has recorded so far (calls of cudagraph trees' ``record_function``: a
    first recording, or a re-recording after a fixed address moved); stays 0 off CUDA."""

    def __init__(self) -> None:
        self.count = 0
        try:
            from torch._inductor.cudagraph_trees import CUDAGraphTreeManager
        except ImportError:  # another torch: the count stays 0 (recorded as such)
            return
        original = CUDAGraphTreeManager.record_function

        def counted(manager: Any, *args: Any, **kwargs: Any) -> Any:
            self.count += 1
            return original(manager, *args, **kwargs)

        CUDAGraphTreeManager.record_function = counted  # type: ignore[method-assign]


def repeat(pipe: Any, method: str, calls: int, device: str, recordings: Recordings) -> dict[str, Any]:
    """``calls`` one-image decodes of ``method``: seconds, memory and CUDA-graph recordings of each."""
    seconds: list[float] = []
    memory: list[int | None] = []
    recorded: list[int] = []
    for i in range(calls):
        _sync(device)
        before = recordings.count
        start = time.perf_counter()
        pipe(labels=[i % 10], seed=i, method=method, batch_size=1)
        _sync(device)
        seconds.append(time.perf_counter() - start)
        memory.append(_memory(device))
        recorded.append(recordings.count - before)
    tail = seconds[len(seconds) // 2:]
    steady = statistics.median(tail)
    grown = None if memory[1] is None or memory[-1] is None else memory[-1] - memory[1]
    # From the third decode on nothing should be recorded (lantern.decoding.resident: the second
    # decode of a batch size moves its state into the pool's, the rest replay on it).
    return {"method": method, "seconds": seconds, "memory": memory, "recordings": recorded,
            "recordings_after_second": sum(recorded[2:]), "first": seconds[0], "steady": steady,
            "tail_max_over_median": max(tail) / steady, "memory_growth_bytes": grown}


def families(device: str, compile: str, recordings: Recordings) -> list[dict[str, Any]]:
    """Three images, one after another, from a tiny Chameleon (Lumina-mGPT layout) and a tiny Emu3
    folder, eager and compiled, with the CUDA graphs each call recorded."""
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
                    seconds, recorded = [], []
                    for seed in range(3):
                        before, start = recordings.count, time.perf_counter()
                        result = pipe(prompts=["a red square"], seed=seed, method="sjd-coupled", sjd_window=4,
                                      batch_size=1)
                        seconds.append(time.perf_counter() - start)
                        recorded.append(recordings.count - before)
                    record.update(ok=True, seconds=seconds, recordings=recorded, tokens=int(result.codes.numel()))
                except Exception as e:  # a measurement script: record what failed and go on
                    record.update(ok=False, error=f"{type(e).__name__}: {e}"[:500])
                out.append(record)
                print(f"{name} compile={mode}: " + (f"ok, CUDA graphs recorded per call {record['recordings']}"
                                                    if record["ok"] else record["error"]))
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
    recordings = Recordings()
    rows = []
    for method in args.methods.split(","):
        row = repeat(pipe, method, args.calls, args.device, recordings)
        rows.append(row)
        growth = row["memory_growth_bytes"]
        print(f"{method}: first {row['first']:.3f} s, steady {row['steady']:.4f} s per image, last half max/median "
              f"{row['tail_max_over_median']:.2f}" + ("" if growth is None else f", memory {growth / 2**20:+.1f} MiB "
                                                     f"from call 2 to {args.calls}")
              + f"; CUDA graphs recorded per call {row['recordings'][:4]}..., after the second call "
                f"{row['recordings_after_second']}")
    record = {"model": args.model, "device": args.device, "compile": args.compile, "calls": args.calls,
              "torch": torch.__version__, "rows": rows,
              "families": families(args.device, args.compile, recordings) if args.families else []}
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
