"""A warm ``pipe(...)`` call against the server's per-image latency for the same image (issue 37).

    python benchmarks/warm_call.py --model photos --method lantern++ [--compile default] [--repeats 5]

One pipeline; first a call that loads and prepares (and compiles), then, alternating, warm
``pipe(labels=[3], seed=i, ...)`` calls and the same image through the server's scheduler
(``Scheduler.resolve`` + ``submit``, decoded by its thread; its ``latency_seconds``, queue time
included). Prints the medians and their ratio. Run it alone on the machine.
"""

from __future__ import annotations

import argparse
import statistics
import time

import lantern
from lantern.serve.scheduler import Scheduler


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="photos")
    p.add_argument("--method", default="lantern++")
    p.add_argument("--compile", default="off")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--deterministic", action="store_true")
    args = p.parse_args()
    pipe = lantern.load(args.model, compile=args.compile, deterministic=args.deterministic)
    start = time.perf_counter()
    pipe(labels=[3], seed=0, method=args.method, batch_size=1)
    print(f"first call (load, prepare, compile): {time.perf_counter() - start:.2f} s")
    scheduler = Scheduler(pipe, max_batch=1)
    scheduler.start()
    warm: list[float] = []
    served: list[float] = []
    try:
        ticket = scheduler.submit(scheduler.resolve(3, 0, args.method))[0]  # the server's own warm-up
        ticket.future.result(600)
        for i in range(args.repeats):
            start = time.perf_counter()
            pipe(labels=[3], seed=i, method=args.method, batch_size=1)
            warm.append(time.perf_counter() - start)
            ticket = scheduler.submit(scheduler.resolve(3, i, args.method))[0]
            served.append(ticket.future.result(600).latency_seconds)
    finally:
        scheduler.shutdown(60)
    w, s = statistics.median(warm), statistics.median(served)
    print(f"{args.method} compile={args.compile}: warm pipe(...) {w:.3f} s, server {s:.3f} s per image, "
          f"ratio {w / s:.2f}x")


if __name__ == "__main__":
    main()
