"""A load test of ``lantern serve`` on this machine: throughput and latency under 1, 4 and 16
concurrent clients, with continuous batching and with static batches (``--no-continuous``).

    python benchmarks/serve_load.py --model photos --methods ar,lantern++ --clients 1,4,16 \\
        --requests-per-client 4 --max-batch 8 --out serve-load

For each batching mode it starts ``lantern serve`` as a subprocess bound to 127.0.0.1 (nothing
leaves this machine); for each method (after one untimed request, which loads its drafter) and
client count, every client (a thread) sends its requests one after another, one image each, and the
run records throughput (images / s), the p50 / p95 / p99 request latency, the mean batch occupancy
over the run (from ``/metrics``) and the errors.
Bounded: ``--request-timeout`` per request, ``--time-limit`` for the whole run (no new request
starts after it), ``--start-timeout`` for the server to answer ``/health``.

Writes ``OUT/serve_load.json`` and ``OUT/serve_load.md``. Timings lie on a busy machine: run it with
nothing else on the cores.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

HOST = "127.0.0.1"
STARTED = re.compile(r"lantern serve: .* on http://127\.0\.0\.1:(\d+)")


@dataclass
class Row:
    batching: str  # continuous | static
    method: str
    clients: int
    requests: int  # sent
    images: int  # delivered
    errors: int
    wall_seconds: float
    images_per_second: float
    p50_seconds: float
    p95_seconds: float
    p99_seconds: float
    mean_occupancy: float  # busy rows / rows over the run's rounds
    error_examples: list[str] = field(default_factory=list)


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (nearest rank) of ``values``; NaN for none."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def scrape(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    out = {}
    for line in text.splitlines():
        match = re.fullmatch(r"([a-z_]+) (\S+)", line)
        if match:
            out[match.group(1)] = float(match.group(2))
    return out


@contextlib.contextmanager
def server(args: argparse.Namespace, continuous: bool, log: Path) -> Iterator[str]:
    """``lantern serve`` on a free loopback port; yields its URL; SIGTERM (then kill) at the end."""
    cmd = [sys.executable, "-m", "lantern.cli", "serve", "--model", args.model, "--host", HOST, "--port", "0",
           "--max-batch", str(args.max_batch), "--max-queue", str(max(64, max(args.clients))),
           "--method", args.methods[0], *([] if continuous else ["--no-continuous"]), *args.serve_args]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        url = _wait_started(proc, log, args.start_timeout)
        yield url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


def _wait_started(proc: subprocess.Popen[bytes], log: Path, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"lantern serve exited with {proc.returncode}:\n{log.read_text()}")
        match = STARTED.search(log.read_text())
        if match:
            url = f"http://{HOST}:{match.group(1)}"
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    return url
        time.sleep(0.2)
    raise SystemExit(f"lantern serve did not answer /health within {timeout} s:\n{log.read_text()}")


def condition(kind: str, num_classes: int | None, i: int) -> dict[str, object]:
    if kind == "c2i":
        return {"label": i % (num_classes or 1)}
    return {"prompt": ["a red car", "a dog on the beach", "a house in snow", "mountains"][i % 4]}


def run_clients(url: str, method: str, clients: int, per_client: int, args: argparse.Namespace,
                model: dict[str, object], deadline: float) -> tuple[list[float], int, int, list[str], float]:
    """Latencies of the successful requests, images delivered, errors, a few error texts, wall seconds."""
    latencies: list[float] = []
    errors: list[str] = []
    lock = threading.Lock()

    def client(c: int) -> None:
        with httpx.Client(base_url=url, timeout=args.request_timeout) as http:
            for r in range(per_client):
                if time.monotonic() > deadline:
                    return
                i = c * per_client + r
                body = {**condition(str(model["kind"]), model.get("num_classes"), i), "seed": i, "method": method}  # type: ignore[arg-type]
                start = time.perf_counter()
                try:
                    response = http.post("/v1/images/generations", json=body)
                    ok = response.status_code == 200
                    text = "" if ok else f"{response.status_code}: {response.text[:200]}"
                except httpx.HTTPError as e:
                    ok, text = False, f"{type(e).__name__}: {e}"
                with lock:
                    if ok:
                        latencies.append(time.perf_counter() - start)
                    else:
                        errors.append(text)

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return latencies, len(latencies), len(errors), errors[:3], time.perf_counter() - start


def measure(args: argparse.Namespace, out: Path) -> list[Row]:
    rows = []
    deadline = time.monotonic() + args.time_limit
    for batching in args.batching:
        with server(args, batching == "continuous", out / f"serve-{batching}.log") as url:
            model = httpx.get(f"{url}/v1/model", timeout=30).json()
            for method in args.methods:
                # One untimed image first: the method's drafter and table load on its first request.
                first = {**condition(str(model["kind"]), model.get("num_classes"), 0), "method": method}
                httpx.post(f"{url}/v1/images/generations", json=first, timeout=args.request_timeout).raise_for_status()
                for clients in args.clients:
                    before = scrape(url)
                    latencies, images, n_errors, examples, wall = run_clients(
                        url, method, clients, args.requests_per_client, args, model, deadline)
                    after = scrape(url)
                    rows.append(Row(batching=batching, method=method, clients=clients,
                                    requests=images + n_errors, images=images, errors=n_errors, wall_seconds=wall,
                                    images_per_second=images / wall if wall > 0 else 0.0,
                                    p50_seconds=percentile(latencies, 50), p95_seconds=percentile(latencies, 95),
                                    p99_seconds=percentile(latencies, 99),
                                    mean_occupancy=_occupancy(before, after), error_examples=examples))
                    print(_line(rows[-1]), flush=True)
    return rows


def _occupancy(before: dict[str, float], after: dict[str, float]) -> float:
    busy = after.get("lantern_scheduler_busy_row_rounds", 0.0) - before.get("lantern_scheduler_busy_row_rounds", 0.0)
    total = after.get("lantern_scheduler_row_rounds", 0.0) - before.get("lantern_scheduler_row_rounds", 0.0)
    return busy / total if total else math.nan


HEADER = ("| batching | method | clients | requests | images/s | p50 s | p95 s | p99 s | occupancy | errors |\n"
          "|---|---|---|---|---|---|---|---|---|---|")


def _line(row: Row) -> str:
    return (f"| {row.batching} | {row.method} | {row.clients} | {row.requests} | {row.images_per_second:.2f} | "
            f"{row.p50_seconds:.2f} | {row.p95_seconds:.2f} | {row.p99_seconds:.2f} | {row.mean_occupancy:.2f} | "
            f"{row.errors} |")


def write(rows: list[Row], args: argparse.Namespace, out: Path) -> None:
    command = " ".join(["python", "benchmarks/serve_load.py", *sys.argv[1:]])
    (out / "serve_load.json").write_text(json.dumps({"command": command, "rows": [asdict(r) for r in rows]},
                                                    indent=1) + "\n")
    lines = [f"# lantern serve under load: {args.model}", "", f"`{command}`", "",
             f"max batch {args.max_batch}; one image per request; latency = request sent to answer read.", "",
             HEADER, *(_line(r) for r in rows)]
    (out / "serve_load.md").write_text("\n".join(lines) + "\n")


def _list(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="photos")
    p.add_argument("--methods", type=_list, default=["ar", "lantern++"], help="comma-separated (default ar,lantern++)")
    p.add_argument("--clients", type=lambda t: [int(x) for x in _list(t)], default=[1, 4, 16],
                   help="concurrent client counts (default 1,4,16; at most 64)")
    p.add_argument("--requests-per-client", type=int, default=4, help="requests each client sends (default 4)")
    p.add_argument("--batching", type=_list, default=["continuous", "static"],
                   help="continuous, static (--no-continuous) or both (default)")
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request (default 600)")
    p.add_argument("--time-limit", type=float, default=3600.0,
                   help="seconds for the whole run: no request starts after it (default 3600)")
    p.add_argument("--start-timeout", type=float, default=300.0, help="seconds for the server to start (default 300)")
    p.add_argument("--serve-args", type=lambda t: t.split(), default=[],
                   help='more flags for lantern serve, e.g. "--compile --device cuda"')
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    if not all(1 <= c <= 64 for c in args.clients) or not 1 <= args.requests_per_client <= 1000:
        p.error("--clients must be in 1..64 and --requests-per-client in 1..1000")
    if not set(args.batching) <= {"continuous", "static"}:
        p.error("--batching takes continuous and / or static")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    print(HEADER, flush=True)
    rows = measure(args, args.out)
    write(rows, args, args.out)
    print(f"wrote {args.out / 'serve_load.md'} and serve_load.json")
    return 1 if any(r.errors for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
