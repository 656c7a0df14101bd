"""``lantern profile --trace``: where a decoding round's time goes, per method.

Each method decodes the same images twice after an untimed warm-up:

1. a **clocked** run (:class:`lantern.decoding.phases.PhaseClock`): exclusive wall time of every phase of
   the round (target verify, drafter forwards, draft sampling, tree building, acceptance,
   sampling, commit, the rest of propose) and "other" (the loop's own Python between phases);
2. a **profiled** run (``torch.profiler``, CPU activity): every dispatched op (a top-level
   ``aten::`` call, i.e. one kernel launch or more on a GPU) and every host synchronisation,
   attributed to the innermost phase around it.

Host syncs are the ops whose output size or value the host must wait for: ``item`` / ``int()`` /
``bool()`` (``aten::_local_scalar_dense``), ``nonzero`` (also behind boolean-mask indexing),
``masked_select``, ``unique``, and ``Tensor.tolist``, which dispatches no op and is counted by a
wrapper installed for the profiled run only. On CUDA, ``torch.cuda.set_sync_debug_mode`` counts
the syncs the driver actually saw as well, and the profiler's CUDA activity counts the kernels the
device ran (graph replays included: CUPTI records each kernel of a replayed graph), per round: what
a small target's round costs on a GPU, where it is launch-bound.

Under ``--compile`` a round is one compiled region (``lantern.decoding.compiling.round_fn``): its
phases are inside the region, so the clock sees one phase, ``round``, and "other" is the loop's own
Python around it. ``regions_per_round`` counts the compiled-region calls (graph replays on CUDA)
per round: 1 when the whole round is one region, 0 in eager runs.

Times are per round (one target forward); the unit "AR step" is the round time of plain AR in
the same run, so the table reads directly as "what a round costs in AR steps". The overhead of a
round is everything but the target verify and the drafter forwards. Times on a shared machine
drift; fractions and counts are the robust part, and the trace watches the machine like demo,
bench and profile do (:mod:`lantern.machine`): ``machine_load`` in trace.json, and a busy-machine
warning printed and atop trace.md when other processes took too much of the cores.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch.autograd import DeviceType

from lantern.decoding import compiling
from lantern.decoding.compiling import resolve_compile
from lantern.decoding.config import SamplingConfig
from lantern.decoding.loop import GenerationOutput
from lantern.decoding.phases import PHASES, PhaseClock, install_clock
from lantern.decoding.sampling import make_generators
from lantern.errors import check
from lantern.methods import MethodConfig
from lantern.outputs import OutputFolder
from lantern.run import PreparedMethod, image_seed, prepare_method
from lantern.targets.base import Conditions, Stack

ROUND_PHASES = tuple(p for p in PHASES if p != "prefill") + ("other",)
# The model forwards; everything else is loop overhead. A compiled ``round`` holds the forwards
# too (one region), so its overhead is the loop's Python around the region ("other").
FORWARD_PHASES = ("verify", "drafter", "round")
SYNC_OPS = frozenset({
    "aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::_unique2",
    "aten::unique_dim", "aten::unique_consecutive", "lantern_sync::tolist",
})


@dataclass(frozen=True)
class RoundTrace:
    """One method's round: ms, dispatched ops and host syncs per round, by phase."""

    method: str
    tree: str
    rounds: int  # loop iterations (one target forward each) over the traced images
    tau: float  # tokens per target forward
    ms: Mapping[str, float]  # per round, by phase (ROUND_PHASES)
    ops: Mapping[str, float]  # per round, by phase
    syncs: Mapping[str, float]  # per round, by phase
    cuda_syncs: float | None = None  # per round, as seen by the CUDA sync debug mode
    cuda_kernels: float | None = None  # device kernels per round (CUDA), the prefill's spread over the rounds
    regions: float = 0.0  # compiled-region calls (CUDA-graph replays) per round; 0 when eager

    @property
    def round_ms(self) -> float:
        return sum(self.ms.values())

    @property
    def overhead_ms(self) -> float:
        return self.round_ms - sum(self.ms.get(p, 0.0) for p in FORWARD_PHASES)

    def to_dict(self, ar_ms: float) -> dict[str, Any]:
        d = asdict(self)
        d.update(round_ms=self.round_ms, round_ar_steps=self.round_ms / ar_ms, overhead_ms=self.overhead_ms,
                 overhead_ar_steps=self.overhead_ms / ar_ms, ops_per_round=sum(self.ops.values()),
                 syncs_per_round=sum(self.syncs.values()), regions_per_round=self.regions)
        return d


def trace_methods(
    stack: Stack,
    sampling: SamplingConfig,
    methods: Mapping[str, MethodConfig],
    labels: Sequence[Any],
    *,
    seed: int = 0,
    batch_size: int = 1,
    compile: str | None = None,
) -> list[RoundTrace]:
    """Trace every method on the same ``labels`` (class labels, or prompts for a text model; one
    batch of ``batch_size`` rows at a time).

    With ``compile``, each compiled region shows as one ``Torch-Compiled Region`` op plus the
    library kernels it calls (matmuls); its fused kernels are not counted."""
    check("ar" in methods, "--trace needs ar among the methods: its round is the unit (an AR step)")
    check(len(labels) >= 1, "--trace-images must be >= 1")
    conditions = stack.encode(list(labels))  # checked and encoded once: every method runs the same rows
    out = []
    for name, cfg in methods.items():
        prepared = prepare_method(stack, cfg, sampling, compile=compile)
        size = min(batch_size, len(labels))  # warm-up (and compilation) at the traced batch shape
        warm = conditions.rows(0, size)
        prepared.generate(warm.cond, make_generators([image_seed(seed + 7, i) for i in range(size)], stack.device),
                          cond_mask=warm.mask)
        out.append(_trace_one(name, prepared, conditions, seed, batch_size))
    return out


def _run(prepared: PreparedMethod, conditions: Conditions, seed: int, batch_size: int) -> list[GenerationOutput]:
    outs = []
    for lo in range(0, len(conditions), batch_size):
        chunk = conditions.rows(lo, lo + batch_size)
        gens = make_generators([image_seed(seed, i) for i in range(lo, lo + len(chunk))], prepared.stack.device)
        outs.append(prepared.generate(chunk.cond, gens, cond_mask=chunk.mask, guidance=chunk.guidance_rows()))
    return outs


def _trace_one(name: str, prepared: PreparedMethod, conditions: Conditions, seed: int, batch_size: int) -> RoundTrace:
    from lantern.eval.report import tree_label

    device = prepared.stack.device
    clock = PhaseClock(device)
    install_clock(clock)
    try:
        t0, calls0 = clock._now(), compiling.region_calls
        outs = _run(prepared, conditions, seed, batch_size)
        wall_ms = 1000.0 * (clock._now() - t0)
        calls = compiling.region_calls - calls0
    finally:
        install_clock(None)
    rounds = sum(o.stats.steps for o in outs)
    check(rounds > 0, f"method {name}: no decoding rounds to trace")
    ms = {p: clock.ms.get(p, 0.0) / rounds for p in PHASES if p != "prefill"}
    ms["other"] = (wall_ms - sum(clock.ms.values())) / rounds
    counts = count_ops(lambda: _run(prepared, conditions, seed, batch_size), device)
    tokens = sum(o.codes.numel() for o in outs)
    forwards = sum(int(o.stats.target_forwards.sum()) for o in outs)
    return RoundTrace(
        method=name, tree=tree_label(prepared.method), rounds=rounds, tau=tokens / forwards, ms=ms,
        ops={p: v / rounds for p, v in counts.ops.items()}, syncs={p: v / rounds for p, v in counts.syncs.items()},
        cuda_syncs=None if counts.cuda_syncs is None else counts.cuda_syncs / rounds, regions=calls / rounds,
        cuda_kernels=None if counts.cuda_kernels is None else counts.cuda_kernels / rounds,
    )


@contextlib.contextmanager
def _counted_tolist() -> Iterator[None]:
    """Make ``Tensor.tolist`` visible to the profiler (it copies to the host without an op)."""
    original = torch.Tensor.tolist

    def tolist(self: torch._C.TensorBase) -> list[Any]:  # (the type of Tensor.tolist's self)
        with torch.profiler.record_function("lantern_sync::tolist"):
            return original(self)

    torch.Tensor.tolist = tolist  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.tolist = original  # type: ignore[method-assign]


@dataclass(frozen=True)
class OpCounts:
    """What :func:`count_ops` saw while a run ran."""

    ops: dict[str, float]  # dispatched ops by phase (the prefill's left out)
    syncs: dict[str, float]  # host syncs by phase (the prefill's left out)
    cuda_syncs: float | None  # syncs the CUDA sync debug mode saw (None off CUDA)
    cuda_kernels: float | None  # kernels the device ran, the prefill's included (None off CUDA)


def device_kernels(events: Iterable[Any]) -> int:
    """Kernels among profiler events: device-side (CUDA) events that are not copies or fills
    (``Memcpy`` / ``Memset`` records, which CUPTI lists beside kernels)."""
    return sum(1 for e in events if e.device_type == DeviceType.CUDA and "mem" not in e.name.lower())


def count_ops(run: Callable[[], Any], device: torch.device) -> OpCounts:
    """Dispatched ops and host syncs by phase while ``run()`` runs (ops inside ``phase("prefill")``
    are left out: they are not part of a round), and on CUDA the syncs and kernels the device saw."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    with warnings.catch_warnings(record=True) as caught, _counted_tolist():
        warnings.simplefilter("always")
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
        prof = profile(activities=activities)
        try:
            with _without_kineto_notices():
                prof.start()
            try:
                run()
            finally:
                with _without_kineto_notices():
                    prof.stop()
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode("default")
    ops = dict.fromkeys(ROUND_PHASES, 0.0)
    syncs = dict.fromkeys(ROUND_PHASES, 0.0)
    events = prof.events()
    for event in events:
        if event.device_type != DeviceType.CPU:
            continue
        is_op = event.name.startswith(("aten::", "Torch-Compiled Region"))
        is_sync = event.name in SYNC_OPS
        if not (is_op or is_sync):
            continue
        where, nested_op, nested_sync = _ancestry(event)
        if where == "prefill":
            continue
        if is_op and not nested_op:
            ops[where] += 1
        if is_sync and not nested_sync:
            syncs[where] += 1
    cuda_syncs = float(sum("synchroniz" in str(w.message) for w in caught)) if cuda else None
    return OpCounts(ops, syncs, cuda_syncs, float(device_kernels(events)) if cuda else None)


@contextlib.contextmanager
def _without_kineto_notices() -> Iterator[None]:
    """Drop the ``USDT:... profiler_start`` / ``profiler_stop`` lines that torch's profiler
    library writes to file descriptor 2 at each start and stop (no log level silences them): the
    descriptor goes to a temporary file meanwhile, and every other line is written on afterwards."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            kept = [line for line in held.read().decode(errors="replace").splitlines(keepends=True)
                    if not line.startswith("USDT:")]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()


def _ancestry(event: Any) -> tuple[str, bool, bool]:
    """(innermost phase or "other", has an aten:: ancestor, has a sync-op ancestor)."""
    nested_op = nested_sync = False
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("lantern::"):
            return parent.name.removeprefix("lantern::"), nested_op, nested_sync
        nested_op |= parent.name.startswith("aten::")
        nested_sync |= parent.name in SYNC_OPS
        parent = parent.cpu_parent
    return "other", nested_op, nested_sync


# ---- reports --------------------------------------------------------------------------------


def _ar_ms(traces: Sequence[RoundTrace]) -> float:
    return next(t for t in traces if t.method == "ar").round_ms


def trace_dict(traces: Sequence[RoundTrace], meta: Mapping[str, Any]) -> dict[str, Any]:
    ar_ms = _ar_ms(traces)
    return {**meta, "ar_step_ms": ar_ms, "phases": list(ROUND_PHASES),
            "methods": [t.to_dict(ar_ms) for t in traces]}


def trace_markdown(traces: Sequence[RoundTrace]) -> str:
    """Per method: round cost in AR steps, each phase's share of the round, overhead, ops, syncs."""
    ar_ms = _ar_ms(traces)
    shown = [p for p in ROUND_PHASES if any(t.ms.get(p, 0.0) > 0 for t in traces)]
    kernels = any(t.cuda_kernels is not None for t in traces)
    head = ["method", "tree", "τ", "round (AR steps)", *[f"{p} %" for p in shown], "overhead (AR steps)",
            "ops/round", "syncs/round", "regions/round", *(["kernels/round"] if kernels else [])]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for t in traces:
        cells = [t.method, t.tree, f"{t.tau:.2f}", f"{t.round_ms / ar_ms:.2f}"]
        cells += [f"{100 * t.ms.get(p, 0.0) / t.round_ms:.0f}" for p in shown]
        cells += [f"{t.overhead_ms / ar_ms:.2f}", f"{sum(t.ops.values()):.0f}", f"{sum(t.syncs.values()):.1f}",
                  f"{t.regions:.1f}"]
        if kernels:
            cells.append("-" if t.cuda_kernels is None else f"{t.cuda_kernels:.0f}")
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines.append(f"AR step = {ar_ms:.3f} ms (plain AR's round). Syncs by phase: "
                 + "; ".join(f"{t.method}: " + ", ".join(f"{p} {v:.1f}" for p, v in t.syncs.items() if v)
                             for t in traces))
    return "\n".join(lines)


def trace_meta(stack: Stack, sampling: SamplingConfig, labels: Sequence[Any], batch_size: int,
               model_name: str) -> dict[str, Any]:
    from lantern.eval.report import machine_description
    from lantern.version import software

    return {"model": model_name, **software(), "device": str(stack.device),
            "dtype": str(stack.dtype).replace("torch.", ""), "machine": machine_description(),
            "torch_threads": torch.get_num_threads(), "sampling": sampling.to_dict(), "images": len(labels),
            "batch_size": batch_size}


def cmd_trace(args: Any, stack: Stack, sampling: SamplingConfig, out: OutputFolder, command: str) -> int:
    """``lantern profile --trace METHODS``: trace, print the table, write trace.json / trace.md
    (all-or-nothing, into the checked ``--out``)."""
    from lantern.eval.bench import bench_labels
    from lantern.eval.methods_grammar import parse_methods
    from lantern.io import write_json
    from lantern.machine import watch_load

    methods = {m.name: m.resolve(stack) for m in parse_methods(args.trace, flag="--trace")}
    # labels spread over the classes (as bench's), or the stack's measurement prompts
    labels = (bench_labels(stack.num_classes, args.trace_images) if stack.num_classes
              else stack.sample_conditions(args.trace_images))
    with watch_load() as watch:  # were other processes competing for the cores while we timed?
        traces = trace_methods(stack, sampling, methods, labels, seed=args.seed, batch_size=args.batch_size,
                               compile=args.compile)
    assert watch.result is not None
    table = trace_markdown(traces)
    meta = trace_meta(stack, sampling, labels, args.batch_size, str(args.model))
    meta["command"] = command
    meta["compile"] = resolve_compile(args.compile, stack.device)
    meta["machine_load"] = watch.result.to_dict()
    meta["busy_warning"] = warning = watch.result.warning()
    if warning is not None:
        print(warning)
    print(table)
    with out.write() as folder:
        write_json(folder / "trace.json", trace_dict(traces, meta))
        made = f"`{meta['command']}` (lantern {meta['lantern']}, torch {meta['torch']}, {meta['date']})"
        (folder / "trace.md").write_text((f"**{warning}**\n\n" if warning is not None else "") + table + "\n\n"
                                         + made + "\n")
    print(f"wrote {out.path / 'trace.json'} and {out.path / 'trace.md'}")
    return 0
