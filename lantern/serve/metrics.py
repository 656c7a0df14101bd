"""The server's counters and their Prometheus text (``GET /metrics``), written by hand: a few
counters, gauges and one histogram do not need a client library.

Request-level figures (requests by status, images and tokens delivered, latency) are counted here;
the engine's (queue depth, batch occupancy, rounds) come from ``Scheduler.metrics()``.
"""

from __future__ import annotations

import math
import threading
import time
from collections import Counter, deque

LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0, 120.0, 300.0)  # seconds
RATE_WINDOW = 60.0  # tokens_per_second: over the last minute
# The scheduler's figures: its name -> (metric name, type, help). Any other figure it reports is
# exposed as a gauge ``lantern_scheduler_<name>``. Images, tokens and tau are the server's own
# counts (what reached a client), not the scheduler's.
SCHEDULER_FIGURES = {
    "queue_depth": ("lantern_queue_depth", "gauge", "images waiting for a batch row"),
    "batch_rows": ("lantern_batch_rows", "gauge", "rows of the decode batches held (lanes kept idle included)"),
    "busy_rows": ("lantern_busy_rows", "gauge", "rows decoding an image now"),
    "batch_occupancy": ("lantern_batch_occupancy", "gauge", "busy rows / rows, over every round since start"),
    "rounds_total": ("lantern_rounds_total", "counter", "decode rounds run"),
    "forwards_total": ("lantern_forwards_total", "counter", "target forwards of the images finished"),
    "busy_row_rounds": ("lantern_busy_row_rounds_total", "counter", "busy rows summed over rounds"),
    "row_rounds": ("lantern_row_rounds_total", "counter", "rows summed over rounds"),
    "decode_threads": ("lantern_decode_threads", "gauge",
                       "intra-op threads of the decode thread now (fewer while other processes keep cores busy)"),
}
OWN_NAMES = ("images_total", "tokens_total", "mean_tokens_per_forward")


class Metrics:
    """Thread-safe counters of one server."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: Counter[str] = Counter()  # by HTTP status
        self.images = 0
        self.tokens = 0
        self.forwards = 0  # target forwards of the images delivered: tau = tokens / forwards
        self.latency_counts = [0] * (len(LATENCY_BUCKETS) + 1)  # the last: +Inf
        self.latency_sum = 0.0
        self._recent: deque[tuple[float, int]] = deque()  # (time, tokens) of the last RATE_WINDOW
        self._start = time.monotonic()

    def request(self, status: int) -> None:
        with self._lock:
            self.requests[str(status)] += 1

    def image(self, tokens: int, target_forwards: int) -> None:
        now = time.monotonic()
        with self._lock:
            self.images += 1
            self.tokens += tokens
            self.forwards += target_forwards
            self._recent.append((now, tokens))

    def latency(self, seconds: float) -> None:
        with self._lock:
            index = next((i for i, le in enumerate(LATENCY_BUCKETS) if seconds <= le), len(LATENCY_BUCKETS))
            self.latency_counts[index] += 1
            self.latency_sum += seconds

    def tokens_per_second(self) -> float:
        """Tokens delivered over the last minute (or since start, when younger), per second."""
        now = time.monotonic()
        with self._lock:
            while self._recent and self._recent[0][0] < now - RATE_WINDOW:
                self._recent.popleft()
            tokens = sum(t for _, t in self._recent)
        return tokens / max(min(RATE_WINDOW, now - self._start), 1e-9)

    def render(self, scheduler: dict[str, float]) -> str:
        """The Prometheus text exposition (version 0.0.4) of these counters and ``scheduler``'s."""
        rate = self.tokens_per_second()
        with self._lock:
            lines = _family("lantern_requests_total", "counter", "image generation requests answered, by HTTP status",
                            [(f'{{status="{s}"}}', float(c)) for s, c in sorted(self.requests.items())])
            lines += _family("lantern_images_total", "counter", "images delivered", [("", float(self.images))])
            lines += _family("lantern_tokens_total", "counter", "image tokens delivered", [("", float(self.tokens))])
            tau = self.tokens / self.forwards if self.forwards else 0.0
            lines += _family("lantern_mean_tokens_per_forward", "gauge",
                             "tokens per target forward over the images delivered (the methods' mean tau)",
                             [("", tau)])
            lines += self._histogram()
        lines += _family("lantern_tokens_per_second", "gauge", "image tokens delivered per second, last minute",
                         [("", rate)])
        for name, (metric, kind, help_text) in SCHEDULER_FIGURES.items():
            lines += _family(metric, kind, help_text, [("", float(scheduler.get(name, 0.0)))])
        for name in sorted(set(scheduler) - set(SCHEDULER_FIGURES) - set(OWN_NAMES)):
            lines += _family(f"lantern_scheduler_{name}", "gauge", f"the scheduler's {name}",
                             [("", float(scheduler[name]))])
        return "\n".join(lines) + "\n"

    def _histogram(self) -> list[str]:
        name = "lantern_request_latency_seconds"
        lines = [f"# HELP {name} time from a request's arrival to its last image, successful requests",
                 f"# TYPE {name} histogram"]
        total = 0
        for le, count in zip((*LATENCY_BUCKETS, math.inf), self.latency_counts, strict=True):
            total += count
            lines.append(f'{name}_bucket{{le="{_number(le)}"}} {total}')
        lines += [f"{name}_sum {_number(self.latency_sum)}", f"{name}_count {total}"]
        return lines


def _family(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> list[str]:
    return [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}",
            *(f"{name}{labels} {_number(value)}" for labels, value in samples)]


def _number(value: float) -> str:
    if math.isinf(value):
        return "+Inf"
    return repr(float(value)) if not float(value).is_integer() else str(int(value))
