"""A throwaway stand-in for the continuous-batching scheduler (replaced by the real one on main).

It honours the interface the HTTP layer is written against: one decode thread that runs queued
jobs of the same method and settings together, through the run path's prepared method.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from PIL import Image

from lantern.api import Pipeline, resolve_settings
from lantern.decoding.sampling import make_generators
from lantern.errors import LanternError
from lantern.run import PreparedMethod, image_seed, prepare_method


@dataclass(frozen=True)
class Job:
    condition: int | str
    seed: int
    index: int
    method: str
    settings: tuple[tuple[str, Any], ...]
    preview_every: int = 0


@dataclass
class ImageResult:
    codes: torch.Tensor
    target_forwards: int
    tokens_per_forward: float
    queue_seconds: float
    latency_seconds: float


@dataclass
class Ticket:
    job: Job
    future: concurrent.futures.Future[ImageResult] = field(default_factory=concurrent.futures.Future)
    previews: queue.SimpleQueue[torch.Tensor] = field(default_factory=queue.SimpleQueue)
    submitted: float = field(default_factory=time.perf_counter)
    cancelled: bool = False

    def cancel(self) -> None:
        self.cancelled = True


class QueueFull(LanternError):
    """The queue holds max_queue images already."""


class Scheduler:
    def __init__(self, pipeline: Pipeline, *, max_batch: int = 8, max_queue: int = 64, continuous: bool = True) -> None:
        self.pipeline = pipeline
        self.max_batch, self.max_queue, self.continuous = max_batch, max_queue, continuous
        self._queue: list[Ticket] = []
        self._lock = threading.Condition()
        self._closing = False
        self._thread: threading.Thread | None = None
        self._prepared: dict[tuple[str, tuple[tuple[str, Any], ...]], PreparedMethod] = {}
        self._counts = {"images_total": 0.0, "tokens_total": 0.0, "rounds_total": 0.0, "forwards": 0.0}
        self._rows = 0

    def check(self, job: Job) -> None:
        stack = self.pipeline.stack
        if stack.kind == "c2i":
            if not isinstance(job.condition, int) or not 0 <= job.condition < stack.num_classes:
                raise LanternError(f"label must be in 0..{stack.num_classes - 1}, got {job.condition!r}")
        self._prepare(job)

    def _prepare(self, job: Job) -> PreparedMethod:
        key = (job.method, job.settings)
        if key not in self._prepared:
            method, sampling = resolve_settings(self.pipeline.stack, job.method, **dict(job.settings))
            self._prepared[key] = prepare_method(self.pipeline.stack, method, sampling, self.pipeline.drafter,
                                                 self.pipeline.proximity, self.pipeline.compile)
        return self._prepared[key]

    def submit(self, jobs: list[Job]) -> list[Ticket]:
        with self._lock:
            if self._closing:
                raise LanternError("the server is shutting down")
            if len(self._queue) + len(jobs) > self.max_queue:
                raise QueueFull(f"the queue holds {len(self._queue)} of at most {self.max_queue} images")
            tickets = [Ticket(job) for job in jobs]
            self._queue.extend(tickets)
            self._lock.notify_all()
        return tickets

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="lantern-scheduler", daemon=True)
        self._thread.start()

    def warm_up(self, methods: list[str]) -> None:
        for method in methods:
            condition: int | str = 0 if self.pipeline.kind == "c2i" else "a"
            ticket = Ticket(Job(condition, 0, 0, method, ()))
            self._run([ticket])

    def shutdown(self, timeout: float) -> None:
        with self._lock:
            self._closing = True
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
        with self._lock:
            for ticket in self._queue:
                ticket.future.set_exception(LanternError("the server shut down before this image started"))
            self._queue.clear()

    def metrics(self) -> dict[str, float]:
        with self._lock:
            tau = self._counts["tokens_total"] / self._counts["forwards"] if self._counts["forwards"] else 0.0
            return {"images_total": self._counts["images_total"], "tokens_total": self._counts["tokens_total"],
                    "queue_depth": float(len(self._queue)), "batch_rows": float(self.max_batch),
                    "batch_occupancy": self._rows / self.max_batch, "rounds_total": self._counts["rounds_total"],
                    "mean_tokens_per_forward": tau}

    def images(self, codes: torch.Tensor) -> list[Image.Image]:
        return list(self.pipeline.stack.to_pil(codes))

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._queue and not self._closing:
                    self._lock.wait(0.5)
                if not self._queue and self._closing:
                    return
                first = self._queue[0]
                group = [t for t in self._queue if (t.job.method, t.job.settings) == (first.job.method,
                                                                                       first.job.settings)]
                group = group[: self.max_batch]
                self._queue = [t for t in self._queue if t not in group]
            live = [t for t in group if not t.cancelled]
            for t in group:
                if t.cancelled:
                    t.future.set_exception(LanternError("cancelled"))
            if live:
                self._run(live)

    def _run(self, tickets: list[Ticket]) -> None:
        stack = self.pipeline.stack
        started = time.perf_counter()
        try:
            parts = self._prepare(tickets[0].job)
            conditions = stack.encode([t.job.condition for t in tickets], 1, len(tickets))
            gens = make_generators([image_seed(t.job.seed, t.job.index) for t in tickets], stack.device)
            self._rows = len(tickets)
            out = parts.generate(conditions.cond, gens, cond_mask=conditions.mask)
        except Exception as e:  # noqa: BLE001 - every ticket learns why
            for t in tickets:
                if not t.future.done():
                    t.future.set_exception(e if isinstance(e, LanternError) else LanternError(str(e)))
            return
        finally:
            self._rows = 0
        done = time.perf_counter()
        n = out.codes.shape[1]
        with self._lock:
            self._counts["rounds_total"] += out.stats.steps
        for i, t in enumerate(tickets):
            if t.job.preview_every:
                half = out.codes[i].clone()
                half[n // 2:] = -1
                t.previews.put(half)
            forwards = int(out.stats.target_forwards[i])
            with self._lock:
                self._counts["images_total"] += 1
                self._counts["tokens_total"] += n
                self._counts["forwards"] += forwards
            t.future.set_result(ImageResult(out.codes[i].cpu(), forwards, n / forwards, started - t.submitted,
                                            done - t.submitted))
