"""What an idle OpenMP team in another thread costs a decode thread (libgomp, torch's CPU runtime).

libgomp keeps the team a thread opens (its worker threads) for the thread's lifetime, and once the
process's teams hold more threads than there are cores, every team's workers sleep between parallel
regions instead of spinning (libgomp's "throttled" spin count), so each of a decode step's many
small ops pays a futex wake-up. ``lantern serve`` decodes on its own thread while the main thread
waits; until the batch-invariance probe moved into a thread of its own, loading a deterministic
model left the main thread holding a team.

Each layout runs in a fresh process, AR on ``photos`` at batch 1 (as ``lantern.load`` gives it, then
with ``deterministic=True``, the server's mode), loading and decoding
at ``--threads``; the median of ``--repeats`` images after one warm image:

- ``main``: load and decode on the main thread (``pipe(...)`` in a script);
- ``thread``: load on the main thread, decode on a second one (a web app's worker thread; a
  server's decode thread);
- ``thread, main holds a team``: the same, after one parallel op on the main thread (what loading
  left there before ``lantern.load`` ran in a thread of its own, and what any parallel op of the
  caller's still leaves).

    python benchmarks/openmp_teams.py --threads 2 --out benchmarks/results/openmp-teams

Time it alone: the layouts are compared in one run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

LAYOUTS = ("main", "thread", "thread, main holds a team")


def decode_times(layout: str, threads: int, repeats: int, model: str, method: str,
                 deterministic: bool) -> list[float]:
    import threading

    import torch

    import lantern
    from lantern.serve.scheduler import own_threads

    own_threads(threads)
    pipe = lantern.load(model, deterministic=deterministic)
    if layout == "thread, main holds a team":
        torch.randn(1 << 20).exp()  # one parallel region: the main thread opens its team
    times: list[float] = []

    def decode() -> None:
        own_threads(threads)
        pipe(labels=[0], seed=0, method=method)  # warm
        for r in range(repeats):
            t0 = time.perf_counter()
            pipe(labels=[r % 10], seed=r, method=method)
            times.append(time.perf_counter() - t0)

    if layout == "main":
        decode()
    else:
        worker = threading.Thread(target=decode)
        worker.start()
        worker.join()
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--model", default="photos")
    ap.add_argument("--method", default="ar")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--layout", help=argparse.SUPPRESS)  # the child process's one layout
    ap.add_argument("--deterministic", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.layout:
        print(json.dumps(decode_times(args.layout, args.threads, args.repeats, args.model, args.method,
                                      args.deterministic)))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for deterministic in (False, True):
        for layout in LAYOUTS:
            cmd = [sys.executable, __file__, "--layout", layout, "--threads", str(args.threads), "--repeats",
                   str(args.repeats), "--model", args.model, "--method", args.method, "--out", str(args.out),
                   *(["--deterministic"] if deterministic else [])]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            times = json.loads(out.strip().splitlines()[-1])
            rows.append({"deterministic": deterministic, "layout": layout, "seconds": times,
                         "median": statistics.median(times)})
            print(json.dumps(rows[-1]), flush=True)
    lines = [f"{args.method} on {args.model}, batch 1, {args.threads} threads", "",
             "| deterministic | layout | s / image (median) | against main |", "|---|---|---|---|"]
    for r in rows:
        base = next(b["median"] for b in rows if b["layout"] == "main" and b["deterministic"] == r["deterministic"])
        lines.append(f"| {r['deterministic']} | {r['layout']} | {r['median']:.2f} | {r['median'] / base:.2f}x |")
    (args.out / "openmp_teams.json").write_text(json.dumps({"threads": args.threads, "rows": rows}, indent=2))
    (args.out / "openmp_teams.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
