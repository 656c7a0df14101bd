"""The serving engine: queued image jobs decoded in batches that rows join and leave between rounds.

Continuous batching (Orca; vLLM's and SGLang's schedulers): one decode batch per method and
settings (a :class:`Lane`). At every round boundary the lane retires finished rows and fills free
ones with queued jobs, whose prefill joins the batch (``lantern.decoding.rows``), so no job waits
for another's image to finish. A row's random stream is its own (``lantern.decoding.rng``), so an
image does not depend on what else is being served: image ``index`` of a request with ``seed`` is
the image ``lantern.load(model)(..., seed=seed)`` gives at that index.

A lane's batch has a size from 1, 2, 4 ... up to ``max_batch`` rows, and all lanes together decode
at most ``max_batch`` rows at a time: a batch grows (rows moved into a
larger batch) when jobs wait and shrinks when half of it is idle, so a lone request runs at batch
1, as ``lantern generate`` would. With ``--compile`` each size compiles once (``warm_up`` at
start-up), and rows join in place, so no request compiles anything: after a warm-up, a request
whose method or settings were not warmed up runs its rounds eagerly (a first compile takes
seconds to minutes, and the decode thread would hold every lane meanwhile). With ``continuous=False``
(or a method whose decode cannot move rows, e.g. PJD's grid) a lane takes new jobs only when
its whole batch has finished: static batches.

A request is resolved once, in the caller's thread (:meth:`Scheduler.resolve`: its settings as
configs, its method prepared, its condition encoded, a text-to-image prompt through T5 included)
into a :class:`Resolved` record; queueing, admission and the rounds take that record and never
resolve, check or encode again (SGLang keeps tokenizing off its scheduler loop for the same reason).
One thread runs every lane's rounds, one lane round at a time; callers only queue requests and wait
on futures (and on a preview callback), so the HTTP layer never touches decode state.

Threads and torch: only the decode thread should run torch with several intra-op threads. Every
other live thread that has run a parallel torch op keeps its own OpenMP team, and on this 2-core
machine one idle team beside the decoding one made decoding 40 % slower (0.54 s -> 0.77 s per
`digits` image; AR on `photos` 1.7x slower at 2 threads: libgomp's workers sleep between ops once
the teams outnumber the cores; a thread that set one intra-op thread before its first op cost
nothing). So the process that serves runs its other threads, the main one included, at one
intra-op thread (:func:`side_thread`), loading runs in a thread that ends with it
(``lantern.machine.in_a_thread_that_ends``, which takes the batch-invariance probe's team along),
and the decode thread runs at ``threads`` (``lantern serve --threads auto``: every core on a CPU,
fewer while other processes keep cores busy), each set with :func:`own_threads`: torch gives a
thread the count another thread set last unless the thread asked for its own first.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import secrets
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from PIL import Image
from torch import Tensor

from lantern.api import resolve_settings
from lantern.decoding.cache import CachePool
from lantern.decoding.config import SamplingConfig
from lantern.decoding.loop import Decode
from lantern.decoding.rows import movable
from lantern.decoding.sampling import validate_sampling_for_vocab
from lantern.errors import LanternError
from lantern.machine import AdaptiveThreads
from lantern.methods import MethodConfig
from lantern.run import PreparedMethod, image_seed
from lantern.targets.base import Conditions, check_condition_kind, negative_prompts

Settings = tuple[tuple[str, Any], ...]
MethodKey = tuple[MethodConfig, SamplingConfig]  # a prepared method's key (lantern.api.Pipeline.prepare)
# Kept at most: lanes (each holds its batch's caches); idle ones go first, least recently used, so
# a client sending ever new settings cannot grow memory (prepared methods: lantern.api.MAX_PREPARED).
# Busy lanes are bounded by the rows the server decodes at once (max_batch, server-wide: _admit).
MAX_LANES = 8


@dataclass(frozen=True, eq=False)  # (identity: it holds tensors and a prepared method)
class Resolved:
    """A request resolved once (:meth:`Scheduler.resolve`): what its images decode with, as configs,
    a prepared method and encoded conditions. Everything after resolution takes this record."""

    condition: int | str  # a class label (c2i) or a prompt (t2i, Chameleon)
    conditions: Conditions  # the condition, encoded (one row), in the resolving thread
    seed: int
    indices: tuple[int, ...]  # the request's images: image i draws from image_seed(seed, i)
    method: str
    settings: Settings  # sorted (name, value) pairs the request set (lantern.api's vocabulary)
    method_cfg: MethodConfig  # the settings as the run uses them (defaults filled in)
    sampling: SamplingConfig
    prepared: PreparedMethod  # the pipeline's, prepared once per key (drafter, table, compiled round)
    preview_every: int = 0  # rounds between previews of the codes so far (0: none)
    auto_method: Mapping[str, Any] | None = None  # what the server's --method auto chose (None: named)
    negative_prompt: str | None = None  # the request's own (Emu3; None: the model's), in ``conditions``

    @property
    def key(self) -> MethodKey:
        """Requests with the same key share a prepared method and a decode batch (two that set
        their settings differently but resolve alike included)."""
        return self.method_cfg, self.sampling


@dataclass
class ImageResult:
    codes: Tensor  # [N] image codes, raster order
    target_forwards: int  # the target's forwards for this image, prefill included
    tokens_per_forward: float  # N / target_forwards: the method's tau for this image
    queue_seconds: float  # submitted -> its row started
    latency_seconds: float  # submitted -> finished


class QueueFull(LanternError):
    """The queue holds ``max_queue`` images already (HTTP 429)."""


class Cancelled(LanternError):
    """The job was cancelled (its client went away, or the server stopped before it ran)."""


PreviewSink = Callable[["Ticket", Tensor], None]  # called on the decode thread: it must only hand over


@dataclass(eq=False)
class Ticket:
    """One image of a request, queued or running: its result future, its preview callback, and its
    cancel switch."""

    request: Resolved
    index: int  # image ``index`` of the request
    on_preview: PreviewSink | None = None
    future: concurrent.futures.Future[ImageResult] = field(default_factory=concurrent.futures.Future)
    submitted: float = field(default_factory=time.perf_counter)
    started: float = 0.0
    forwards: int = 0  # target forwards so far (prefill included)
    rounds: int = 0
    cancelled: bool = False

    def cancel(self) -> None:
        """The client went away: the row is freed at the next round boundary (or never starts)."""
        self.cancelled = True


def side_thread() -> None:
    """Call in a thread other than the decode thread before its first torch op (the main thread
    before loading the model, a web worker before decoding images): one intra-op thread, so its
    OpenMP team does not slow the decode thread (see the module docstring)."""
    own_threads(1)


def own_threads(threads: int) -> None:
    """This thread's intra-op thread count. torch (OpenMP builds) sets a thread's count from the
    process-wide one the first time the thread runs an op or asks for its count, and every
    ``torch.set_num_threads`` writes that process-wide one: a decode thread that set 2 and then
    waited for work ran its first op after a web worker's ``side_thread`` had written 1, and
    decoded on one thread (tests/test_serve_scheduler.py). Asking first settles it now."""
    torch.get_num_threads()
    torch.set_num_threads(threads)


LOG = logging.getLogger("lantern.serve")


def engine_failure(error: BaseException) -> LanternError:
    """What a client is told when decoding failed: an incident id, never the exception's text (a
    kernel's message can hold paths, shapes or allocator detail); the server's log has the
    traceback under that id. Call inside the ``except`` block (the traceback is the current one)."""
    incident = secrets.token_hex(4)
    LOG.error("generation failed (incident %s)", incident, exc_info=error)
    return LanternError(f"generation failed (incident {incident}; the server's log has the cause)")


def rows_move(prepared: PreparedMethod) -> bool:
    """Whether this method's decode rows can join and leave a running batch: every piece lists its
    row state (adapters are cheap to build: nothing is allocated before a prefill)."""
    return movable(*prepared.parts())


def _bucket(n: int, max_batch: int) -> int:
    """The batch size for ``n`` rows: the next power of two, at most ``max_batch``."""
    size = 1
    while size < n:
        size *= 2
    return min(size, max_batch)


class Lane:
    """One decode batch for one method and settings; rows join and leave at round boundaries."""

    def __init__(self, scheduler: Scheduler, prepared: PreparedMethod) -> None:
        self.scheduler, self.prepared = scheduler, prepared
        self.stack = prepared.stack
        self.decode: Decode | None = None
        self.rows: list[Ticket | None] = []
        self.continuous = scheduler.continuous and rows_move(prepared)
        # The batch's caches are the lane's own, not the prepared method's: a process that embeds a
        # scheduler may call its pipeline too, and a call of the same method and batch size would
        # reset the running batch's caches under it (a pure server never allocates the method's).
        self._caches = CachePool()
        self._join_caches = CachePool()  # joining rows' prefill: never the running batch's caches

    # -- what the scheduler asks -----------------------------------------------------------------

    @property
    def busy(self) -> int:
        return sum(t is not None for t in self.rows)

    def capacity_for_new(self) -> int:
        """Jobs this lane can take now."""
        if self.busy and not self.continuous:
            return 0  # static batches: a new batch only once the whole batch has finished
        return self.scheduler.max_batch - self.busy

    def admit(self, tickets: list[Ticket]) -> None:
        """Start ``tickets`` in free rows (growing the batch if needed); their prefill runs now."""
        if not tickets:
            return
        if self.decode is None or not self.busy:
            self._new_batch(tickets)
            return
        free = [r for r, t in enumerate(self.rows) if t is None]
        if len(free) < len(tickets):
            self._resize(_bucket(self.busy + len(tickets), self.scheduler.max_batch))
            free = [r for r, t in enumerate(self.rows) if t is None]
        assert self.decode is not None and len(free) >= len(tickets)
        joining = self._prefill(tickets, eager=True)
        rows = torch.tensor(free[: len(tickets)], device=self.stack.device)
        self.decode.take_rows(joining, rows)
        for r, t in zip(free, tickets, strict=False):
            self._place(r, t)

    def step(self) -> None:
        """One round for every running row, then retire finished and cancelled rows."""
        decode = self.decode
        assert decode is not None
        n_total = self.stack.num_tokens
        self._drop_cancelled()
        running = torch.tensor([t is not None for t in self.rows], device=self.stack.device)
        active = running & (decode.n < n_total)
        decode.round(active)
        done = (decode.n >= n_total).tolist()  # the round's one host sync
        for r, t in enumerate(self.rows):
            if t is None:
                continue
            t.forwards += 1
            t.rounds += 1
            if done[r]:
                self._finish(r, t)
            elif t.on_preview is not None and t.request.preview_every and t.rounds % t.request.preview_every == 0:
                t.on_preview(t, decode.codes[r, :n_total].clone())
        if self.continuous and self.busy and self.busy * 2 <= decode.batch and decode.batch > 1:
            self._resize(_bucket(self.busy, self.scheduler.max_batch))  # half idle: a smaller batch costs less

    def cancel_all(self, error: LanternError) -> None:
        """Fail every running row with ``error`` and drop the batch (after a failed round its state
        is not trusted): ``Cancelled`` when the server stops (503), a plain LanternError when the
        engine failed (500)."""
        tickets = [t for t in self.rows if t is not None]
        self.rows, self.decode = [], None
        for t in tickets:
            _fail(t, error)

    # -- rows ---------------------------------------------------------------------------------------

    def _conditions(self, tickets: Sequence[Ticket], size: int) -> Conditions:
        """The tickets' conditions (encoded when they were resolved), padded to ``size`` rows with
        copies of the first (free rows)."""
        rows = [t.request.conditions for t in tickets]
        return batch_conditions(rows + [rows[0]] * (size - len(rows)))

    def _prefill(self, tickets: Sequence[Ticket], size: int | None = None, eager: bool = False) -> Decode:
        size = size or len(tickets)
        seeds = [image_seed(t.request.seed, t.index) for t in tickets] + [0] * (size - len(tickets))
        return self.prepared.start(self._conditions(tickets, size), seeds, eager=eager,
                                   caches=self._join_caches if eager else self._caches)

    def _new_batch(self, tickets: list[Ticket]) -> None:
        size = _bucket(len(tickets), self.scheduler.max_batch)
        if not self.continuous:
            size = len(tickets)  # static batches: exactly the jobs, as ``lantern generate`` batches them
        self.decode = self._prefill(tickets, size)
        self.rows = [None] * size
        for r, t in enumerate(tickets):
            self._place(r, t)
        if size > len(tickets):
            self.decode.finish_rows(torch.arange(len(tickets), size, device=self.stack.device))

    def _resize(self, size: int) -> None:
        """Move the running rows into a batch of ``size`` rows (the same compiled round per size)."""
        old = self.decode
        assert old is not None
        if size == old.batch:
            return
        keep = [r for r, t in enumerate(self.rows) if t is not None]
        first = self.rows[keep[0]]
        assert first is not None
        new = self._prefill([first], size)  # placeholder rows, overwritten or finished below
        new.finish_rows(torch.arange(size, device=self.stack.device))
        device = self.stack.device
        new.take_rows(old, torch.arange(len(keep), device=device), torch.tensor(keep, device=device))
        self.rows = [self.rows[r] for r in keep] + [None] * (size - len(keep))
        self.decode = new

    def _place(self, row: int, ticket: Ticket) -> None:
        self.rows[row] = ticket
        ticket.started = time.perf_counter()
        ticket.forwards = 1  # the prefill

    def _free(self, row: int) -> None:
        self.rows[row] = None
        assert self.decode is not None
        self.decode.finish_rows(torch.tensor([row], device=self.stack.device))

    def _drop_cancelled(self) -> None:
        for r, t in enumerate(self.rows):
            if t is not None and t.cancelled:
                self._free(r)
                _fail(t, Cancelled("cancelled: the client went away"))

    def _finish(self, row: int, ticket: Ticket) -> None:
        assert self.decode is not None
        n_total = self.stack.num_tokens
        codes = self.decode.codes[row, :n_total].clone()
        self.rows[row] = None
        now = time.perf_counter()
        result = ImageResult(codes=codes, target_forwards=ticket.forwards,
                             tokens_per_forward=n_total / ticket.forwards,
                             queue_seconds=ticket.started - ticket.submitted,
                             latency_seconds=now - ticket.submitted)
        self.scheduler._record(result)
        with contextlib.suppress(concurrent.futures.InvalidStateError):  # a caller cancelled the future itself
            ticket.future.set_result(result)


def batch_conditions(rows: Sequence[Conditions]) -> Conditions:
    """Conditions encoded one request at a time, as one batch: prompts of different lengths are
    left-padded to the longest, as ``Stack.encode`` pads a batch it encodes (mask False there), and
    so are their guidance rows (Emu3's negative prompts, which every Emu3 request carries)."""
    if len(rows) == 1:
        return rows[0]
    if rows[0].mask is None:  # labels
        return Conditions(torch.cat([r.cond for r in rows]))
    width = max(int(r.cond.shape[1]) for r in rows)

    def left_pad(t: Tensor) -> Tensor:
        # F.pad's spec runs from the last dimension: (0, 0) per trailing dim, then dim 1's left pad
        return torch.nn.functional.pad(t, (0, 0) * (t.dim() - 2) + (width - int(t.shape[1]), 0))

    guides = [r.guidance for r in rows if r.guidance is not None]
    assert len(guides) in (0, len(rows)), "a model's requests all carry guidance rows or none do"
    return Conditions(torch.cat([left_pad(r.cond) for r in rows]),
                      torch.cat([left_pad(r.mask) for r in rows if r.mask is not None]),
                      batch_conditions(guides) if guides else None)


def _fail(ticket: Ticket, error: BaseException) -> None:
    with contextlib.suppress(concurrent.futures.InvalidStateError):
        ticket.future.set_exception(error)


class Scheduler:
    """Queued jobs, one :class:`Lane` per method and settings, and the thread that runs their rounds."""

    def __init__(self, pipeline: Any, *, max_batch: int = 8, max_queue: int = 64, continuous: bool = True,
                 threads: int | None = None, adapt_threads: bool = False) -> None:
        """pipeline: a :class:`lantern.api.Pipeline` (its stack, drafter, proximity table and compile mode);
        threads: the decode thread's intra-op threads (default: torch's count now); adapt_threads: at
        most that many, fewer while other processes keep cores busy (``lantern.machine.AdaptiveThreads``)."""
        if max_batch < 1 or max_queue < 1:
            raise LanternError(f"max_batch and max_queue must be >= 1, got {max_batch} and {max_queue}")
        self.pipeline, self.stack = pipeline, pipeline.stack
        self.max_batch, self.max_queue, self.continuous = max_batch, max_queue, continuous
        self.threads = threads or torch.get_num_threads()
        self.adapt_threads = adapt_threads
        self.decode_threads = 0  # the decode thread's intra-op threads now (0 before it starts)
        self._queue: deque[Ticket] = deque()
        self._lanes: OrderedDict[MethodKey, Lane] = OrderedDict()
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._stop_now = False
        # the (method, sampling) keys warm_up compiled; None: no warm-up, a request may compile
        self._warmed: set[MethodKey] | None = None
        self._counters = {"images_total": 0.0, "tokens_total": 0.0, "rounds_total": 0.0, "forwards_total": 0.0,
                          "busy_row_rounds": 0.0, "row_rounds": 0.0}
        self.started_at = time.time()

    # -- callers ------------------------------------------------------------------------------------

    def resolve(self, condition: int | str, seed: int, method: str, settings: Mapping[str, Any] | None = None,
                indices: Sequence[int] = (0,), preview_every: int = 0,
                bound: Callable[[MethodConfig], None] | None = None, negative_prompt: str | None = None) -> Resolved:
        """A request resolved once, in the caller's thread (never the decode thread: this may load
        what the method needs and encodes the condition, through T5 for a text-to-image model): its
        settings as configs, checked against the model, its method prepared, its condition encoded.
        ``bound``: the caller's check of the resolved method before anything is prepared (the
        server's bound on a round's size). A refusal is a one-line LanternError whose ``field``
        names the setting (or the condition) it is about. ``negative_prompt``: the request's
        (Emu3 models), encoded with the condition."""
        given = dict(settings or {})
        method_cfg, sampling = resolve_settings(self.stack, method, **given)
        if bound is not None:
            bound(method_cfg)
        validate_sampling_for_vocab(sampling, self.stack.vocab_size)  # else the decode round would fail
        # prepared once, kept by the pipeline; uncompiled if a warm-up compiled other settings only
        eager = self._warmed is not None and (method_cfg, sampling) not in self._warmed
        prepared = self.pipeline.prepare(method_cfg, sampling, eager=eager)
        try:
            conditions = self.encode([condition], negative_prompt)
        except LanternError as e:
            e.field = e.field or ("prompt" if isinstance(condition, str) else "label")
            raise
        return Resolved(condition=condition, conditions=conditions, seed=seed, indices=tuple(indices),
                        method=method, settings=tuple(sorted(given.items())), method_cfg=method_cfg,
                        sampling=sampling, prepared=prepared, preview_every=preview_every,
                        negative_prompt=negative_prompt)

    def submit(self, request: Resolved, on_preview: PreviewSink | None = None) -> list[Ticket]:
        """Queue every image of ``request`` (all or none) and return their tickets. ``on_preview``:
        called on the decode thread with a ticket and its codes so far, every ``preview_every`` rounds."""
        tickets = [Ticket(request, i, on_preview) for i in request.indices]
        with self._wake:
            if self._stopping:
                raise LanternError("the server is shutting down; no new requests")
            if len(self._queue) + len(tickets) > self.max_queue:
                raise QueueFull(f"the queue is full ({len(self._queue)} of {self.max_queue} images waiting); "
                                "retry later")
            self._queue.extend(tickets)
            self._wake.notify()
        return tickets

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="lantern-decode", daemon=True)
            self._thread.start()

    def warm_up(self, methods: Sequence[str], condition: int | str) -> None:
        """Decode one batch per method and batch size, so that a compiled server compiles now (and
        loads every method's weights), never in a request. Starts the decode thread if it is not
        running (compiled graphs are the decode thread's)."""
        buckets = sorted({_bucket(n, self.max_batch) for n in range(1, self.max_batch + 1)})
        self.start()
        warmed: set[MethodKey] = set()
        for method in methods:
            request = self.resolve(condition, 0, method)
            warmed.add(request.key)
            # Static batches are exactly their jobs: every size from 1 to max_batch may come.
            moves = self.continuous and rows_move(request.prepared)
            for size in buckets if moves else range(1, self.max_batch + 1):
                tickets = [Ticket(request, i) for i in range(size)]
                with self._wake:  # not submit(): warm-up is not held to max_queue
                    self._queue.extend(tickets)
                    self._wake.notify()
                for t in tickets:
                    t.future.result()
        if self.pipeline.compile is not None:
            self._warmed = warmed
        for key in self._counters:
            self._counters[key] = 0.0

    def run_until_idle(self) -> None:
        """Run rounds in the calling thread until nothing is queued or running: what the decode thread
        does, for warm-up and tests (never while :meth:`start`'s thread runs)."""
        if self._thread is not None:
            raise LanternError("run_until_idle() runs rounds itself; the decode thread is already running")
        with torch.inference_mode():
            while self._queue or self._busy_lanes():
                self._cycle()

    def shutdown(self, timeout: float) -> None:
        """Stop taking jobs; finish the running and queued ones, cancelling what is left after ``timeout`` s."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout)
        with self._wake:
            self._stop_now = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(10.0)
        for ticket in list(self._queue):
            _fail(ticket, Cancelled("the server stopped before this image started"))
        self._queue.clear()
        for lane in list(self._lanes.values()):
            lane.cancel_all(Cancelled("the server stopped before this image finished"))

    def metrics(self) -> dict[str, float]:
        with self._lock:
            c = dict(self._counters)
            lanes = list(self._lanes.values())  # (the decode thread may add or drop one meanwhile)
            rows = sum(len(lane.rows) for lane in lanes)
            busy = sum(lane.busy for lane in lanes)
            c["queue_depth"] = float(len(self._queue))
        c["decode_threads"] = float(self.decode_threads)
        c["batch_rows"], c["busy_rows"] = float(rows), float(busy)
        c["batch_occupancy"] = c["busy_row_rounds"] / c["row_rounds"] if c["row_rounds"] else 0.0
        c["mean_tokens_per_forward"] = c["tokens_total"] / c["forwards_total"] if c["forwards_total"] else 0.0
        return c

    def encode(self, conditions: list[Any], negative: str | None = None) -> Conditions:
        """Conditions, as ``Stack.encode`` makes them (``negative``: a negative prompt for them all);
        called where a request is resolved, never on the decode thread. A text-to-image model's T5
        encoder stays loaded (the pipeline's, read once): ``Stack.encode`` loads it per call, right
        for one run, not for a server."""
        if self.stack.kind != "t2i":
            return self.stack.encode(conditions, 1, len(conditions), negative=negative)
        self.stack.negative_rows(negative_prompts(negative, len(conditions)), len(conditions), 1)  # refused
        prompts = check_condition_kind(conditions, str, self.stack.root)
        encoder = self.pipeline.t5_encoder()
        with torch.inference_mode():
            return self.stack.from_captions(encoder.encode(prompts, batch_size=len(prompts)))

    def images(self, codes: Tensor) -> list[Image.Image]:
        """Decode codes [k, N] to images with the model's VQ decoder."""
        with torch.inference_mode():
            return list(self.stack.to_pil(codes))

    # -- the decode thread ------------------------------------------------------------------------------

    def _lane(self, request: Resolved) -> Lane:
        """The lane of ``request``'s key (decode thread only), made with its prepared method if needed
        (one lane per prepared method: the lane's batch owns the method's caches)."""
        key = request.key
        lane = self._lanes.get(key)
        if lane is None:
            lane = self._lanes[key] = Lane(self, request.prepared)
            if self._warmed is not None and key not in self._warmed:
                LOG.info("%s with settings the warm-up did not compile runs eagerly (%s)", request.method,
                         ", ".join(f"{k}={v}" for k, v in request.settings) or "its default settings")
        self._lanes.move_to_end(key)
        return lane

    def _drop_idle_lanes(self) -> None:
        """Idle lanes past MAX_LANES, least recently used first (after admission or a round: never one
        chosen for jobs meanwhile)."""
        idle = [k for k, v in self._lanes.items() if not v.busy]
        for k in idle[: max(0, len(self._lanes) - MAX_LANES)]:
            del self._lanes[k]

    def _run(self) -> None:
        own_threads(self.threads)
        self.decode_threads = self.threads
        adapt = AdaptiveThreads(self.threads, self._set_threads) if self.adapt_threads else None
        with torch.inference_mode():
            while True:
                if adapt is not None:
                    adapt.check()
                with self._wake:
                    while not self._queue and not self._busy_lanes() and not self._stop_now:
                        if self._stopping:
                            return
                        self._wake.wait()
                    if self._stop_now:
                        return
                self._cycle()

    def _set_threads(self, threads: int) -> None:
        lower = threads < torch.get_num_threads()
        own_threads(threads)
        self.decode_threads = threads
        if lower:  # an operator's reason for slower images: said where the server's errors are
            LOG.warning("other processes keep cores busy: decoding on %d intra-op thread%s, not %d (a thread on a "
                        "busy core stalls every op; --threads N fixes the count)", threads,
                        "s" if threads > 1 else "", self.threads)
        else:
            LOG.warning("decoding on %d intra-op threads again: cores were freed", threads)

    def _cycle(self) -> None:
        """Admit what fits, then one round of every lane with rows running."""
        self._admit()
        for lane in self._busy_lanes():
            self._step(lane)

    def _busy_lanes(self) -> list[Lane]:
        return [lane for lane in list(self._lanes.values()) if lane.busy]

    def _admit(self) -> None:
        """Queued jobs, in order, into their lanes' free rows (a job behind a full lane waits there),
        while the server decodes fewer than ``max_batch`` rows in all: requests of other settings
        open other lanes, and without the server-wide bound a client varying its settings would
        have every lane decode at once (memory and every request's latency growing with them)
        instead of waiting in the queue, where ``max_queue`` answers 429."""
        with self._lock:
            waiting = list(self._queue)
        chosen: dict[MethodKey, list[Ticket]] = {}
        room: dict[MethodKey, int] = {}
        free = self.max_batch - sum(lane.busy for lane in self._lanes.values())  # rows, server-wide
        dropped = [t for t in waiting if t.cancelled]  # never started
        for ticket in waiting:
            if free <= 0:
                break
            if ticket.cancelled:
                continue
            key = ticket.request.key
            if key not in room:
                room[key] = self._lane(ticket.request).capacity_for_new()
            if room[key] > 0:
                room[key] -= 1
                free -= 1
                chosen.setdefault(key, []).append(ticket)
        with self._lock:
            taken = {id(t) for group in (*chosen.values(), dropped) for t in group}
            self._queue = deque(t for t in self._queue if id(t) not in taken)
        for t in dropped:
            _fail(t, Cancelled("cancelled: the client went away"))
        for key, tickets in chosen.items():
            try:
                self._lanes[key].admit(tickets)
            except Exception as e:  # one failing request never takes the server down
                error = e if isinstance(e, LanternError) else engine_failure(e)
                for t in tickets:
                    _fail(t, error)
                self._lanes.pop(key, None)
        self._drop_idle_lanes()

    def _step(self, lane: Lane) -> None:
        decode = lane.decode
        assert decode is not None
        busy, rows = lane.busy, decode.batch
        try:
            lane.step()
        except Exception as e:  # a failed round fails its rows, not the server
            lane.cancel_all(engine_failure(e))
            self._lanes = OrderedDict((k, v) for k, v in self._lanes.items() if v is not lane)
            return
        if not lane.busy:
            self._drop_idle_lanes()
        with self._lock:
            self._counters["rounds_total"] += 1
            self._counters["busy_row_rounds"] += busy
            self._counters["row_rounds"] += rows

    def _record(self, result: ImageResult) -> None:
        with self._lock:
            self._counters["images_total"] += 1
            self._counters["tokens_total"] += float(result.codes.numel())
            self._counters["forwards_total"] += result.target_forwards
