"""Device profile: measured costs of target and drafter forwards."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lantern.autotree.model import METHOD_OF_RULE, PROFILE_VERSION, CostModel, interpolate, non_decreasing
from lantern.decoding.config import SamplingConfig, TreeConfig
from lantern.decoding.loop import GenerationOutput
from lantern.decoding.trees import STATIC_TREES, chain_choices
from lantern.errors import check
from lantern.methods import resolve_method
from lantern.parts import ModelParts, parts_of
from lantern.run import PreparedMethod, image_seed, prepare_method
from lantern.targets.base import Conditions, Stack
from lantern.version import __version__


@dataclass(frozen=True)
class OverheadFit:
    """Per-round loop cost beyond verify and the drafter's forwards, for one acceptance rule.

    Fitted (non-negative least squares) to real generations with a few probe trees: the per-round
    wall time minus the modelled verify, context pass and feeds. It holds the acceptance rule, the
    drafter's sampling, cache commits and Python bookkeeping, and absorbs any error of the other
    terms on those trees.
    """

    fixed_ms: float
    per_level_ms: float
    per_node_ms: float
    runs: tuple[Mapping[str, Any], ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"fixed_ms": self.fixed_ms, "per_level_ms": self.per_level_ms, "per_node_ms": self.per_node_ms,
                "runs": [dict(r) for r in self.runs]}


@dataclass(frozen=True)
class DeviceProfile:
    """What ``lantern profile`` measures (see :func:`measure_profile`); JSON via to_dict/from_dict."""

    meta: Mapping[str, Any]
    verify_tokens: tuple[int, ...]
    verify_ms: tuple[float, ...]
    begin_tokens: tuple[int, ...]
    begin_ms: tuple[float, ...]
    feed_nodes: tuple[int, ...]
    feed_ms: tuple[float, ...]
    ar_step_ms: float
    overhead: Mapping[str, OverheadFit] = field(default_factory=dict)

    @property
    def verify_ratio(self) -> tuple[float, ...]:
        return tuple(v / self.verify_ms[0] for v in self.verify_ms)

    @property
    def max_tokens(self) -> int:
        return self.verify_tokens[-1]

    def cost_model(self, rule: str) -> CostModel:
        check(rule in self.overhead,
              f"the device profile has no loop measurements for acceptance rule {rule!r} (it has "
              f"{', '.join(sorted(self.overhead)) or 'none'}); re-run `lantern profile`")
        o = self.overhead[rule]
        return CostModel(
            verify_ms=interpolate(self.verify_tokens, non_decreasing(self.verify_ms), self.max_tokens),
            begin_ms=interpolate(self.begin_tokens, non_decreasing(self.begin_ms), self.begin_tokens[-1]),
            feed_ms=interpolate(self.feed_nodes, non_decreasing(self.feed_ms), self.feed_nodes[-1]),
            overhead_ms=(o.fixed_ms, o.per_level_ms, o.per_node_ms),
            ar_step_ms=self.ar_step_ms,
        )

    def check_matches(self, stack: Stack, sampling: SamplingConfig, batch_size: int, what: str) -> None:
        """Refuse a profile measured for another model shape, batch size or CFG setting."""
        shape = _model_shape(stack)
        check(dict(self.meta.get("model_shape", {})) == shape,
              f"{what} was measured for a model of shape {self.meta.get('model_shape')}, this one is {shape}")
        # the rows a call decodes: a run of fewer images than --batch-size decodes fewer
        measured = self.meta.get("batch_size")
        check(measured == batch_size,
              f"{what} was measured at batch size {measured}, and this run decodes {batch_size} row(s) a call (the "
              f"smaller of --batch-size and the images): measure one with `lantern profile --batch-size "
              f"{batch_size}`, or pass --batch-size {measured} with at least as many images")
        streams = 2 if sampling.use_cfg else 1
        check(self.meta.get("streams") == streams,
              f"{what} was measured with {self.meta.get('streams')} CFG stream(s), this run uses {streams}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": PROFILE_VERSION,
            **dict(self.meta),
            "verify": {"tokens": list(self.verify_tokens), "ms": list(self.verify_ms),
                       "ratio": list(self.verify_ratio)},
            "drafter": {
                "begin_new_tokens": list(self.begin_tokens), "begin_ms": list(self.begin_ms),
                "begin_ratio": [v / self.verify_ms[0] for v in self.begin_ms],
                "feed_nodes": list(self.feed_nodes), "feed_ms": list(self.feed_ms),
                "feed_ratio": [v / self.verify_ms[0] for v in self.feed_ms],
            },
            "ar_step_ms": self.ar_step_ms,
            "ar_step_ratio": self.ar_step_ms / self.verify_ms[0],
            "overhead": {rule: fit.to_dict() for rule, fit in self.overhead.items()},
        }

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], what: str = "profile") -> DeviceProfile:
        check(isinstance(raw, Mapping) and raw.get("version") == PROFILE_VERSION,
              f"{what} is not a lantern device profile of version {PROFILE_VERSION} (written by `lantern profile`)")
        meta = {k: v for k, v in raw.items()
                if k not in ("version", "verify", "drafter", "ar_step_ms", "ar_step_ratio", "overhead")}
        batch = meta.get("batch_size")
        check(type(batch) is int and batch >= 1, f"{what}: batch_size must be an integer >= 1, got {_shown(batch)}")
        check(meta.get("streams") in (1, 2), f"{what}: streams must be 1 or 2, got {_shown(meta.get('streams'))}")
        curves = {name: _curve(raw, name, what, integer) for name, integer in (
            ("verify.tokens", True), ("verify.ms", False), ("drafter.begin_new_tokens", True),
            ("drafter.begin_ms", False), ("drafter.feed_nodes", True), ("drafter.feed_ms", False))}
        for points, times in (("verify.tokens", "verify.ms"), ("drafter.begin_new_tokens", "drafter.begin_ms"),
                              ("drafter.feed_nodes", "drafter.feed_ms")):
            check(len(curves[points]) == len(curves[times]),
                  f"{what}: {points} and {times} must be as long, got {len(curves[points])} and {len(curves[times])}")
            check(list(curves[points]) == sorted(set(curves[points])), f"{what}: {points} must increase")
        check(curves["verify.tokens"][0] == 1, f"{what}: the verify curve must start at 1 token (verify.tokens)")
        ar_step = _field(raw, "ar_step_ms", what)
        check(_is_time(ar_step) and ar_step > 0, f"{what}: ar_step_ms must be a finite time > 0, got {_shown(ar_step)}")
        fits = _field(raw, "overhead", what)
        check(isinstance(fits, Mapping) and bool(fits), f"{what}: overhead must map acceptance rules to fits")
        overhead = {}
        for rule, fit in fits.items():
            terms = [_field(raw, f"overhead.{rule}.{term}", what)
                     for term in ("fixed_ms", "per_level_ms", "per_node_ms")]
            check(all(isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t) for t in terms),
                  f"{what}: overhead.{rule} must hold finite fixed_ms, per_level_ms and per_node_ms")
            runs = fit.get("runs", ())
            check(isinstance(runs, (list, tuple)), f"{what}: overhead.{rule}.runs must be a list")
            fixed_ms, per_level_ms, per_node_ms = (float(t) for t in terms)
            overhead[rule] = OverheadFit(fixed_ms, per_level_ms, per_node_ms, tuple(runs))
        profile = cls(meta=meta, verify_tokens=curves["verify.tokens"], verify_ms=curves["verify.ms"],
                      begin_tokens=curves["drafter.begin_new_tokens"], begin_ms=curves["drafter.begin_ms"],
                      feed_nodes=curves["drafter.feed_nodes"], feed_ms=curves["drafter.feed_ms"],
                      ar_step_ms=float(ar_step), overhead=overhead)
        return profile


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:39] + "…"


def _field(raw: Mapping[str, Any], dotted: str, what: str) -> Any:
    """``raw``'s value at ``dotted`` (``verify.ms``), or a one-line error naming the missing field."""
    node: Any = raw
    for key in dotted.split("."):
        check(isinstance(node, Mapping) and key in node, f"{what}: missing field {dotted}")
        node = node[key]
    return node


def _is_time(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


def _curve(raw: Mapping[str, Any], dotted: str, what: str, integer: bool) -> tuple[Any, ...]:
    """A profile's list at ``dotted``: token / node counts (``integer``: >= 1) or times in ms (>= 0)."""
    values = _field(raw, dotted, what)
    fits = (lambda x: type(x) is int and x >= 1) if integer else _is_time
    check(isinstance(values, list) and bool(values) and all(fits(x) for x in values),
          f"{what}: {dotted} must be a non-empty list of {'integers >= 1' if integer else 'finite times >= 0 (ms)'}, "
          f"got {_shown(values)}")
    return tuple(int(x) if integer else float(x) for x in values)


def load_profile(path: str | Path, what: str = "--profile") -> DeviceProfile:
    from lantern.io import read_json

    return DeviceProfile.from_dict(read_json(path, f"{what} file"), f"{what} {path}")


def _model_shape(stack: Stack) -> dict[str, int | str]:
    # The precision is part of the shape: bf16 and fp32 forwards have different cost curves.
    return {**stack.model_shape(), "dtype": str(stack.dtype).replace("torch.", "")}


def _device_string(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return str(device)


def _cpu_name() -> str:
    import platform

    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


class _Timer:
    """Wall time of a callable in ms, with the device's queued work finished before and after."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def __call__(self, fn: Callable[[], Any]) -> float:
        self._sync()
        t0 = time.perf_counter()
        fn()
        self._sync()
        return 1000.0 * (time.perf_counter() - t0)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def _median_curve(
    points: Sequence[int], measure: Callable[[int], float], repeats: int, warmup: int, bar: Any
) -> tuple[float, ...]:
    """Median over ``repeats`` of ``measure(x)``; the points are interleaved within each repeat so
    a slow moment of a shared machine hits every point alike, not one end of the curve."""
    samples: dict[int, list[float]] = {x: [] for x in points}
    for rep in range(warmup + repeats):
        for x in points:
            t = measure(x)
            if rep >= warmup:
                samples[x].append(t)
            bar.update(1)
    return tuple(statistics.median(samples[x]) for x in points)


QUICK_VERIFY_POINTS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48, 56, 64)


@dataclass(frozen=True)
class ProfileSettings:
    batch_size: int = 1
    max_tokens: int = 64
    repeats: int = 5
    quick: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        check(isinstance(self.batch_size, int) and self.batch_size >= 1,
              f"--batch-size must be an integer >= 1, got {self.batch_size!r}")
        check(isinstance(self.max_tokens, int) and 2 <= self.max_tokens <= 512,
              f"--max-tokens must be an integer in [2, 512] (tree tokens incl. the root), got {self.max_tokens!r}")
        check(isinstance(self.repeats, int) and self.repeats >= 1, f"--repeats must be >= 1, got {self.repeats!r}")

    def verify_points(self) -> list[int]:
        if not self.quick:
            return list(range(1, self.max_tokens + 1))
        return sorted({x for x in QUICK_VERIFY_POINTS if x <= self.max_tokens} | {self.max_tokens})

    def begin_points(self) -> list[int]:
        return [1, 2, 4, 8] if self.quick else list(range(1, 9))

    def feed_points(self) -> list[int]:
        return [1, 2, 4, 8, 16] if self.quick else list(range(1, 17))


def measure_profile(
    stack: Stack,
    sampling: SamplingConfig,
    settings: ProfileSettings | None = None,
    *,
    rules: Sequence[str] | None = None,
    model_name: str = "",
    parts: ModelParts | None = None,
    progress: bool = False,
) -> DeviceProfile:
    """Measure the cost model on the device the stack's target is on.

    (a) target verify over n tokens (a chain mask; half the image committed as the prefix),
    (b) the EAGLE drafter's context pass over A new tokens and a feed over E nodes, the same
    prefix, (c) the per-round loop overhead of each acceptance rule (:class:`OverheadFit`) and the
    plain AR step, from short real generations. ``rules`` defaults to every rule the stack supports
    (relaxed rules need its proximity table). ``parts``: the loaded drafter and proximity table
    (default: the stack's own), read once for every measurement.
    """
    from tqdm.auto import tqdm

    settings = settings or ProfileSettings()
    parts = parts_of(stack, parts)
    check(parts.has_drafter, f"--model {stack.root} has no drafter/ folder and no --drafter was given")
    if rules is None:
        rules = ("exact", "lantern", "lantern++") if parts.has_table else ("exact",)
    for rule in rules:
        check(rule in METHOD_OF_RULE, f"unknown acceptance rule {rule!r}; known: {', '.join(METHOD_OF_RULE)}")
    q = settings.quick
    reps, warm = settings.repeats, 1
    v_pts, b_pts, f_pts = settings.verify_points(), settings.begin_points(), settings.feed_points()
    total = (reps + warm) * (len(v_pts) + len(b_pts) + len(f_pts)) + 1 + len(rules) * len(_overhead_trees(stack))
    timer = _Timer(stack.device)
    with torch.no_grad(), tqdm(total=total, desc="profile", disable=not progress, leave=False) as bar:
        verify_ms = _measure_verify(stack, sampling, settings, v_pts, timer, reps, warm, bar)
        begin_ms, feed_ms = _measure_drafter(stack, parts, sampling, settings, b_pts, f_pts, timer, reps, warm, bar)
        partial = CostModel(
            verify_ms=interpolate(v_pts, non_decreasing(verify_ms), settings.max_tokens),
            begin_ms=interpolate(b_pts, non_decreasing(begin_ms), b_pts[-1]),
            feed_ms=interpolate(f_pts, non_decreasing(feed_ms), f_pts[-1]),
        )
        ar_ms, overhead = _measure_loop(stack, sampling, settings, rules, partial, bar, parts)
    meta = {
        "device": _device_string(stack.device),
        "torch_threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
        "lantern": __version__,
        "machine": __import__("platform").machine(),
        "cpu": _cpu_name(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "model": model_name or str(stack.root),
        "model_shape": _model_shape(stack),
        "sampling": sampling.to_dict(),
        "streams": 2 if sampling.use_cfg else 1,
        "batch_size": settings.batch_size,
        "prefix_tokens": stack.num_tokens // 2,
        "quick": q,
        "repeats": reps,
        "notes": "times are medians in ms after warm-up; ratios are relative to verify over 1 token; "
                 "overhead is fitted to real generations (see lantern.autotree.profile.OverheadFit)",
    }
    return DeviceProfile(meta, tuple(v_pts), verify_ms, tuple(b_pts), begin_ms, tuple(f_pts), feed_ms, ar_ms, overhead)


def _conditions(stack: Stack, batch: int) -> Conditions:
    return stack.encode(stack.sample_conditions(batch))


def _measure_verify(
    stack: Stack, sampling: SamplingConfig, settings: ProfileSettings, points: list[int],
    timer: _Timer, reps: int, warm: int, bar: Any,
) -> tuple[float, ...]:
    """Target verify over n chain tokens after a committed prefix of half the image."""
    device, b, vocab = stack.device, settings.batch_size, stack.vocab_size
    prefix = max(stack.num_tokens // 2, 1)
    target = stack.make_target(sampling, max(settings.max_tokens, prefix))
    cond = _conditions(stack, b)
    target.start(cond.cond, cond.mask)
    gen = torch.Generator().manual_seed(settings.seed)
    fill = torch.randint(vocab, (b, prefix), generator=gen).to(device)
    target.verify(fill, *_chain(b, prefix, device))
    target.commit(torch.arange(prefix, device=device).expand(b, -1), torch.full((b,), prefix, device=device))
    tokens = torch.randint(vocab, (b, settings.max_tokens), generator=gen).to(device)
    chains = {n: _chain(b, n, device) for n in points}
    # verify() writes K/V past the committed length but does not advance it: repeats are identical.
    return _median_curve(points, lambda n: timer(lambda: target.verify(tokens[:, :n], *chains[n])), reps, warm, bar)


def _chain(b: int, n: int, device: torch.device) -> tuple[Tensor, Tensor]:
    mask = torch.ones(n, n, dtype=torch.bool, device=device).tril().expand(b, -1, -1)
    return mask, torch.arange(n, device=device).expand(b, -1)


def _measure_drafter(
    stack: Stack, parts: ModelParts, sampling: SamplingConfig, settings: ProfileSettings, begin_pts: list[int],
    feed_pts: list[int], timer: _Timer, reps: int, warm: int, bar: Any,
) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """The drafter's begin over A new tokens and feed over E nodes, after half the image.

    Each measurement restores the drafter cache's committed length afterwards, so every repeat
    sees the same prefix (the cache's K/V past that length are ignored by the masks)."""
    device, b, vocab = stack.device, settings.batch_size, stack.vocab_size
    # Loaded and placed as prepare_method loads it for generation.
    prepared = prepare_method(stack, resolve_method("sd", tree="chain:1"), sampling, parts)
    assert prepared.drafter is not None
    target = stack.make_target(sampling, 1)
    cond = _conditions(stack, b)
    _, hidden0 = target.start(cond.cond, cond.mask)
    s = target.streams
    prefix = max(stack.num_tokens // 2, 1)
    width = max(max(begin_pts), prefix)
    backend = stack.draft_backend(prepared.drafter, prepared.drafter_head(target.lm_head), sampling, target,
                                  width + max(feed_pts) + 8)
    gen = torch.Generator().manual_seed(settings.seed + 1)
    backend.start(hidden0, torch.randint(vocab, (b,), generator=gen).to(device))
    backend.begin()
    feats = (torch.randn(s * b, width, hidden0.shape[-1], generator=gen) * 0.5).to(device, hidden0.dtype)
    toks = torch.randint(vocab, (b, max(width, max(feed_pts))), generator=gen).to(device)
    backend.commit(feats[:, :prefix], toks[:, :prefix], torch.full((b,), prefix, device=device))
    backend.begin()
    cache: Any = getattr(backend, "cache", None)  # EagleBackend's KVCache (not part of DraftBackend)
    check(cache is not None and hasattr(cache, "lengths"), "EagleBackend has no cache with lengths to restore")
    base = cache.lengths.clone()

    def pending(a: int) -> None:
        cache.lengths.copy_(base)
        backend.commit(feats[:, :a], toks[:, :a], torch.full((b,), a, device=device))

    def begin(a: int) -> float:
        pending(a)
        return timer(backend.begin)

    def feed(e: int) -> float:
        pending(1)
        backend.begin()
        parent = torch.full((b, e), -1, dtype=torch.long, device=device)
        anc = torch.zeros(b, e, 0, dtype=torch.bool, device=device)
        return timer(lambda: backend.feed(parent, toks[:, :e], 1, anc))

    begin_ms = _median_curve(begin_pts, begin, reps, warm, bar)
    feed_ms = _median_curve(feed_pts, feed, reps, warm, bar)
    cache.lengths.copy_(base)
    return begin_ms, feed_ms


def _overhead_trees(stack: Stack) -> list[tuple[str, list[list[int]]]]:
    """Probe trees for the overhead fit: chains vary depth and size together, the star varies
    size at depth 1, so (fixed, per level, per node) are identifiable; a 26-node tree anchors the
    per-node term near the sizes the search considers (a slope fitted on <= 9 nodes alone is
    noisy, and the paper's trees have ~60)."""
    max_depth = stack.num_tokens - 1
    trees = [(f"chain:{n}", chain_choices(n)) for n in (1, 4, 8) if n <= max_depth]
    trees.append(("star:8", [[r] for r in range(8)]))
    if max_depth >= 5:
        trees.append(("static:reverse_balanced_25", STATIC_TREES["reverse_balanced_25"]))
    return trees


def _measure_loop(
    stack: Stack, sampling: SamplingConfig, settings: ProfileSettings, rules: Sequence[str],
    partial: CostModel, bar: Any, parts: ModelParts,
) -> tuple[float, dict[str, OverheadFit]]:
    """Real generations: plain AR (the per-step baseline) and the overhead trees per rule."""
    cond = _conditions(stack, settings.batch_size)
    gens = [image_seed(settings.seed, i) for i in range(settings.batch_size)]
    ar = prepare_method(stack, resolve_method("ar"), sampling)
    _timed_run(ar, cond, gens, sampling)  # warm-up (kernels, allocator), not used
    ar_wall, ar_out = _timed_run(ar, cond, gens, sampling)
    bar.update(1)
    ar_ms = ar_wall / (ar_out.stats.steps + 1)  # + 1: the prefill forward
    fits = {}
    for rule in rules:
        base = prepare_method(stack, resolve_method(METHOD_OF_RULE[rule], tree="chain:1"), sampling, parts)
        runs = []
        for spec, choices in _overhead_trees(stack):
            named = spec.startswith(("chain:", "static:"))
            tree = TreeConfig.parse(spec) if named else TreeConfig.from_choices(choices, prefix="probe")
            prepared = replace(base, method=replace(base.method, tree=tree))
            wall, out = _timed_run(prepared, cond, gens, sampling)
            bar.update(1)
            runs.append(_overhead_run(spec, choices, wall, out, partial))
        fits[rule] = _fit_overhead(runs)
    return ar_ms, fits


def _timed_run(
    prepared: PreparedMethod, cond: Conditions, seeds: list[int], sampling: SamplingConfig
) -> tuple[float, GenerationOutput]:
    from lantern.decoding.sampling import make_generators

    gens = make_generators(seeds, cond.cond.device)
    timer = _Timer(cond.cond.device)
    out: list[GenerationOutput] = []
    guidance = cond.guidance_rows()
    ms = timer(lambda: out.append(prepared.generate(cond.cond, gens, cond_mask=cond.mask, guidance=guidance)))
    return ms, out[0]


def _overhead_run(
    spec: str, choices: list[list[int]], wall_ms: float, out: GenerationOutput, partial: CostModel
) -> dict[str, Any]:
    stats = out.stats
    rounds = stats.steps + 1  # + 1: the prefill forward, counted as for AR
    per_row_rounds = float((stats.target_forwards - 1).clamp(min=1).float().mean())
    tau = (stats.generated_tokens - 1) / per_row_rounds
    round_ms = wall_ms / rounds
    modelled = partial.round_ms(choices, tau)  # verify + drafter, overhead 0
    depth = max(len(c) for c in choices)
    return {"tree": spec, "nodes": len(choices) + 1, "depth": depth, "tokens_per_round": round(tau, 4),
            "round_ms": round_ms, "modelled_without_overhead_ms": modelled, "residual_ms": round_ms - modelled}


def _fit_overhead(runs: list[dict[str, Any]]) -> OverheadFit:
    """Non-negative least squares of residual = fixed + per_level * depth + per_node * nodes, by
    trying every subset of the three terms (an exact NNLS for three unknowns)."""
    import itertools

    x = torch.tensor([[1.0, r["depth"], r["nodes"]] for r in runs], dtype=torch.float64)
    y = torch.tensor([r["residual_ms"] for r in runs], dtype=torch.float64)
    best, best_err = torch.zeros(3, dtype=torch.float64), float((y**2).sum())
    for k in (1, 2, 3):
        for cols in itertools.combinations(range(3), k):
            sol = torch.linalg.lstsq(x[:, cols], y[:, None]).solution[:, 0]
            if bool((sol >= 0).all()):
                coef = torch.zeros(3, dtype=torch.float64)
                coef[list(cols)] = sol
                err = float(((x @ coef - y) ** 2).sum())
                if err < best_err - 1e-12:
                    best, best_err = coef, err
    fixed, per_level, per_node = (float(v) for v in best)
    return OverheadFit(fixed, per_level, per_node, tuple(runs))


def format_profile(profile: DeviceProfile) -> str:
    """A short table: verify cost ratio at a few sizes, drafter costs, AR step, overheads."""
    lines = [f"device {profile.meta.get('device')} | {profile.meta.get('cpu')} | torch threads "
             f"{profile.meta.get('torch_threads')} | batch {profile.meta.get('batch_size')} | "
             f"streams {profile.meta.get('streams')}"]
    lines.append(f"{'tree tokens':>11} {'verify ms':>10} {'x 1-token':>10}")
    ratio = profile.verify_ratio
    for i, n in enumerate(profile.verify_tokens):
        if n in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512) or n == profile.max_tokens:
            lines.append(f"{n:>11d} {profile.verify_ms[i]:>10.3f} {ratio[i]:>10.2f}")
    one = profile.verify_ms[0]
    lines.append(f"drafter context pass (1 new token) {profile.begin_ms[0]:.3f} ms ({profile.begin_ms[0] / one:.2f}x); "
                 f"feed 1 / {profile.feed_nodes[-1]} nodes {profile.feed_ms[0]:.3f} / {profile.feed_ms[-1]:.3f} ms")
    lines.append(f"plain AR step {profile.ar_step_ms:.3f} ms ({profile.ar_step_ms / one:.2f}x)")
    for rule, fit in profile.overhead.items():
        lines.append(f"loop overhead [{rule}]: {fit.fixed_ms:.3f} ms + {fit.per_level_ms:.3f} ms/level + "
                     f"{fit.per_node_ms:.3f} ms/node")
    return "\n".join(lines)


def save_profile(profile: DeviceProfile, out: str | Path) -> tuple[Path, Path | None]:
    """Write ``OUT/profile.json`` and ``OUT/verify_cost.png`` (atomically; the PNG needs
    matplotlib, and is skipped with a note if it is missing)."""
    from lantern.io import atomic_path, ensure_writable_dir, write_json

    out = ensure_writable_dir(out, "--out")
    write_json(out / "profile.json", profile.to_dict())
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("lantern: note: matplotlib is not installed; skipped verify_cost.png")
        return out / "profile.json", None
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(profile.verify_tokens, profile.verify_ratio, marker="o", markersize=3, label="verify (measured)")
    ax.plot(profile.verify_tokens, profile.verify_tokens, linestyle="--", color="gray", label="n (no parallelism)")
    ax.set_ylim(0, max(max(profile.verify_ratio) * 1.1, 2.0))
    ax.set_xlabel("tree tokens verified in one forward (root included)")
    ax.set_ylabel("time / time of a 1-token step")
    ax.set_title(f"{profile.meta.get('model')} on {profile.meta.get('device')}, batch {profile.meta.get('batch_size')}",
                 fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    with atomic_path(out / "verify_cost.png") as tmp:
        fig.savefig(tmp, format="png", dpi=120)
    plt.close(fig)
    return out / "profile.json", out / "verify_cost.png"
