"""Load test of ``lantern serve`` (localhost only, bounded in count and time; not part of CI).

For each method and each batching mode (continuous, then static with ``--no-continuous``) it starts
``lantern serve --model M --max-batch B`` on a free localhost port, waits for ``/health``, and runs
1, 4 and 16 concurrent clients, each sending ``--requests-per-client`` requests one after another
(one image each, distinct seeds; a closed loop), and, with ``--rates``, requests arriving at random
at each given rate (a Poisson process, the same arrivals for both modes; an open loop). It reports
throughput (images/s over the wall time of the level), p50 / p95 / p99 request latency, the batch
occupancy the server measured over the level (``/metrics``: busy rows per row of the running
batches), and errors (must be 0), as JSON and a markdown table in ``--out``. The one-client
continuous row also compares, request by request, the server's latency with the same image made in
this process by ``lantern.load(model)(labels=[label], seed=seed, method=method)`` and saved as PNG
(medians, and their ratio: what the server adds).

    python benchmarks/serve_load.py --model photos --methods ar,lantern++ --out benchmarks/results/serve-load

Time it on a quiet machine: the server and the clients share its cores.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http(url: str, body: dict[str, Any] | None = None, timeout: float = 600.0) -> tuple[int, bytes]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def metric(text: str, name: str) -> float:
    """The value of the first sample of metric ``name`` in Prometheus text."""
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            head = line.split()[0]
            if head == name or head.startswith(name + "{"):
                return float(line.split()[-1])
    raise KeyError(name)


class Server:
    """``lantern serve`` on a free localhost port; ``extra`` are more server flags (e.g.
    ``--no-deterministic``). Starting does not wait: :meth:`wait_ready` does, so several servers
    can compile side by side (a GPU machine has the cores) and be measured one after another."""

    def __init__(self, model: str, method: str, max_batch: int, continuous: bool, compile: str, log: Path,
                 device: str = "cpu", extra: Sequence[str] = ()) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log
        cmd = [sys.executable, "-m", "lantern.cli", "serve", "--model", model, "--method", method,
               "--port", str(self.port), "--max-batch", str(max_batch), "--max-queue", "256", "--compile", compile,
               "--device", device, *extra]
        if not continuous:
            cmd.append("--no-continuous")
        self.log = log.open("w")
        self.started = time.perf_counter()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        self.ready_seconds: float | None = None

    def wait_ready(self, timeout: float = 600.0) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"lantern serve exited with {self.proc.returncode}; see {self.log_path}")
            try:
                if http(self.url + "/health", timeout=2)[0] == 200:
                    self.ready_seconds = time.perf_counter() - self.started
                    return
            except OSError:
                pass
            time.sleep(0.5)
        self.stop()
        raise SystemExit(f"lantern serve did not answer /health within {timeout:.0f} s; see {self.log_path}")

    def metrics(self) -> str:
        return http(self.url + "/metrics")[1].decode()

    def stop(self) -> None:
        if self.proc.poll() is not None:
            self.log.close()
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def run_level(server: Server, clients: int, per_client: int, method: str, label_count: int) -> dict[str, Any]:
    """Closed loop: ``clients`` threads, each sending ``per_client`` requests one after another."""
    plan = [[(0.0, {"label": (c * per_client + r) % label_count, "seed": 1000 * c + r, "method": method})
             for r in range(per_client)] for c in range(clients)]
    return {"clients": clients, **fire(server, plan)}


def run_open(server: Server, rate: float, count: int, method: str, label_count: int) -> dict[str, Any]:
    """Open loop: ``count`` requests arriving as a Poisson process of ``rate`` per second (a fixed
    seed, so continuous and static batching see the same arrivals), each on its own connection."""
    import random

    draw, at = random.Random(0), 0.0
    plan = []
    for r in range(count):
        at += draw.expovariate(rate)
        plan.append([(at, {"label": r % label_count, "seed": 5000 + r, "method": method})])
    return {"clients": f"{rate:g}/s", **fire(server, plan)}


def fire(server: Server, plan: list[list[tuple[float, dict[str, Any]]]]) -> dict[str, Any]:
    """Send ``plan`` (one list per thread of (send no earlier than this offset in s, body)), time
    every request, and read the batch occupancy the server measured meanwhile."""
    latencies: list[float] = []
    errors: list[str] = []
    lock = threading.Lock()
    start = time.perf_counter()

    def worker(requests: list[tuple[float, dict[str, Any]]]) -> None:
        for at, body in requests:
            time.sleep(max(0.0, start + at - time.perf_counter()))
            t0 = time.perf_counter()
            try:
                status, text = http(server.url + "/v1/images/generations", body)
            except OSError as e:
                status, text = -1, str(e).encode()
            dt = time.perf_counter() - t0
            with lock:
                if status == 200:
                    latencies.append(dt)
                else:
                    errors.append(f"{status}: {text[:200]!r}")

    before = server.metrics()
    threads = [threading.Thread(target=worker, args=(requests,)) for requests in plan]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    after = server.metrics()
    busy = metric(after, "lantern_busy_row_rounds_total") - metric(before, "lantern_busy_row_rounds_total")
    rows = metric(after, "lantern_row_rounds_total") - metric(before, "lantern_row_rounds_total")
    q = statistics.quantiles(latencies, n=100, method="inclusive") if len(latencies) > 1 else latencies * 99
    return {"requests": sum(len(r) for r in plan), "images": len(latencies), "errors": len(errors),
            "error_samples": errors[:3], "wall_seconds": wall, "images_per_second": len(latencies) / wall,
            "p50": q[49] if q else None, "p95": q[94] if q else None, "p99": q[98] if q else None,
            "batch_occupancy": busy / rows if rows else None}


def server_over_direct(server: Server, model: str, method: str, count: int, label_count: int) -> dict[str, float]:
    """One image at a time, alternately made in this process (the pipeline and a PNG, as the server
    does) and requested from the idle server: medians and their ratio. Alternating keeps the two
    on the same machine state (this VM's speed drifts by 20-30 % over minutes). The direct call
    runs in the server's mode (``/v1/model``'s ``deterministic``) on the server's decode threads
    (``lantern_decode_threads``), so the ratio is what serving adds, not a mode or a thread count."""
    import io

    import torch

    import lantern

    deterministic = bool(json.loads(http(server.url + "/v1/model")[1])["deterministic"])
    threads = int(metric(server.metrics(), "lantern_decode_threads"))
    torch.set_num_threads(threads)  # this process's main thread: the only one that runs torch here
    pipe = lantern.load(model, deterministic=deterministic)
    pipe(labels=[0], seed=0, method=method)  # warm, as the server is
    direct, served = [], []
    for r in range(count):
        t0 = time.perf_counter()
        out = pipe(labels=[r % label_count], seed=r, method=method)
        out.images[0].save(io.BytesIO(), format="PNG")
        direct.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        status, _ = http(server.url + "/v1/images/generations", {"label": r % label_count, "seed": r, "method": method})
        served.append(time.perf_counter() - t0)
        if status != 200:
            raise SystemExit(f"the server answered {status}")
    d, s = statistics.median(direct), statistics.median(served)
    return {"direct_p50": d, "server_p50": s, "latency_over_direct": s / d, "direct_threads": threads,
            "direct_deterministic": deterministic}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="photos")
    ap.add_argument("--methods", default="ar,lantern++",
                    help="comma-separated; an item may add server flags: 'lantern++ --no-deterministic'")
    ap.add_argument("--clients", default="1,4,16")
    ap.add_argument("--requests-per-client", type=int, default=4)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--modes", default="continuous,static")
    ap.add_argument("--compile", default="off")
    ap.add_argument("--device", default="cpu", help="the server's torch device")
    ap.add_argument("--labels", type=int, default=10, help="labels cycle over 0 .. N-1")
    ap.add_argument("--rates", default="", help="open loop: Poisson arrival rates (requests/s), e.g. 0.5,1")
    ap.add_argument("--open-requests", type=int, default=24, help="requests per open-loop rate")
    ap.add_argument("--parallel-start", action="store_true",
                    help="start every server at once (they compile side by side), then measure one at a time")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    # "lantern++ --no-deterministic": a method and more server flags; the whole item labels its rows
    specs = [(item.strip(), shlex.split(item)) for item in args.methods.split(",") if item.strip()]
    plan = [(label, words[0], words[1:], mode) for label, words in specs for mode in args.modes.split(",")]

    def start(label: str, method: str, extra: list[str], mode: str) -> Server:
        name = re.sub(r"[^A-Za-z0-9+.-]+", "_", label)
        return Server(args.model, method, args.max_batch, mode == "continuous", args.compile,
                      args.out / f"server-{name}-{mode}.log", device=args.device, extra=extra)

    servers = [start(*p) for p in plan] if args.parallel_start else []
    rows: list[dict[str, Any]] = []
    try:
        for i, (label, method, extra, mode) in enumerate(plan):
            server = servers[i] if servers else start(label, method, extra, mode)
            try:
                server.wait_ready()
                http(server.url + "/v1/images/generations", {"label": 0, "seed": 0, "method": method})  # warm
                for clients in (int(c) for c in args.clients.split(",") if c):
                    row = {"method": label, "batching": mode, "ready_seconds": server.ready_seconds,
                           **run_level(server, clients, args.requests_per_client, method, args.labels)}
                    if clients == 1 and mode == "continuous":
                        row.update(server_over_direct(server, args.model, method, args.requests_per_client,
                                                      args.labels))
                    print(json.dumps(row), flush=True)
                    rows.append(row)
                for rate in (float(r) for r in args.rates.split(",") if r):
                    row = {"method": label, "batching": mode, **run_open(server, rate, args.open_requests, method,
                                                                         args.labels)}
                    print(json.dumps(row), flush=True)
                    rows.append(row)
            finally:
                server.stop()
    finally:
        for server in servers:
            server.stop()
    record = {"model": args.model, "max_batch": args.max_batch, "requests_per_client": args.requests_per_client,
              "compile": args.compile, "device": args.device, "cpu_count": os.cpu_count(), "rows": rows}
    (args.out / "serve_load.json").write_text(json.dumps(record, indent=2))
    lines = ["| method | batching | clients (or arrivals) | images/s | p50 s | p95 s | p99 s | occupancy | errors "
             "| p50 / direct |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        occ = "-" if r["batch_occupancy"] is None else f"{r['batch_occupancy']:.2f}"
        lines.append(f"| {r['method']} | {r['batching']} | {r['clients']} | {r['images_per_second']:.3f} | "
                     f"{r['p50']:.2f} | {r['p95']:.2f} | {r['p99']:.2f} | {occ} | {r['errors']} | "
                     + (f"{r['latency_over_direct']:.2f} ({r['server_p50']:.2f} / {r['direct_p50']:.2f} s) |"
                        if "direct_p50" in r else "- |"))
    (args.out / "serve_load.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
