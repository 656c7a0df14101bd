"""Hardware-aware draft trees: measure this device, measure the drafter's acceptance, pick a tree.

Which static tree is fastest depends on two things that differ between set-ups:

* the **device**: verifying n tree tokens costs about one target step on a GPU for n up to dozens,
  but grows quickly with n on a CPU; a drafter level and the loop's bookkeeping cost a device-
  dependent fraction of a step (:func:`measure_profile`, ``lantern profile``);
* the **drafter and method**: how often the drafter's k-th sample at depth d is accepted, which
  the acceptance rule (exact, LANTERN, LANTERN++) and the sampling settings decide
  (:func:`calibrate`).

From both, :func:`select_tree` scores every candidate tree by predicted tokens per second,

    (1 + E[accepted drafts]) / (verify(n nodes) + drafting(levels) + loop overhead),

and :func:`choose_tree` runs the whole chain (quick profile or a saved one, calibration, search)
for ``--tree auto`` and for the benchmark.

The acceptance model: sampled tree verification tests the children of an accepted node in
sibling (draw) order and stops at the first acceptance, so P(rank r accepted | parent accepted)
does not depend on how many later siblings exist. One calibration run with a wide *probe* tree
therefore estimates ``a[d][r]`` = P(the accepted child at depth d has rank r | depth d - 1
reached) for every (depth, rank) the probe holds, and the expected number of accepted drafts of
ANY prefix-closed static tree is the sum over its nodes of the product of ``a`` along the node's
path (:func:`expected_accepted`). Greedy verification (temperature 0) picks the longest accepted
path instead; with exact acceptance at most one sibling matches, so the same model holds there.

The search only considers static trees (chains included), also for ``sd`` and ``lantern`` whose
default is the dynamic EAGLE-2 tree: deterministic top-k drafts are not described by a[d][r].

Timings on a shared machine are noisy: the profile keeps medians, the cost model smooths them
(:func:`non_decreasing`) and ties within 0.5% go to the smaller tree.
"""

from __future__ import annotations

import heapq
import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lantern.config import SamplingConfig, TreeConfig
from lantern.errors import LanternError, check
from lantern.generate import Acceptance, Drafter, DraftTree, GenerationOutput, generate
from lantern.pipeline import AR_FALLBACK_TREE, MethodConfig, PreparedMethod, image_seed, prepare_method
from lantern.stack import Conditions, Stack
from lantern.target import Target
from lantern.trees import (
    BUILTIN_TREES,
    STATIC_TREES,
    canonical_choices,
    chain_choices,
    level_widths,
    probe_choices,
    register_tree,
    tree_hash,
)

Choice = tuple[int, ...]  # sibling ranks from the root: (a, b) = the b-th child of the root's a-th child
Rates = tuple[tuple[float, ...], ...]  # rates[d - 1][r] = a[d][r]

PROFILE_VERSION = 1
# Probe widths per depth: 5 samples at depth 1 (naive_extend_57 uses 5), fewer deeper, 8 levels
# (chain:8 is a candidate). 25 drafts: one verify over 26 tokens per calibration round.
DEFAULT_PROBE_WIDTHS = (5, 4, 4, 3, 3, 2, 2, 2)
DEFAULT_MAX_DRAFTS = 63  # largest tree the search grows (the paper's trees have 58-64 nodes)
# Acceptance rules and the method whose real runs measure their cost.
RULE_OF_METHOD = {"sd": "exact", "sd-static": "exact", "lantern": "lantern", "lantern++": "lantern++"}
METHOD_OF_RULE = {"exact": "sd", "lantern": "lantern", "lantern++": "lantern++"}
SPECULATIVE_METHODS = tuple(RULE_OF_METHOD)


# ============================================================================================
# Acceptance model (pure)
# ============================================================================================


def path_probability(choice: Sequence[int], rates: Rates) -> float:
    """P(the node ``choice`` is on the accepted path) = prod over depths of a[d][rank].

    APPROXIMATION: acceptances at different depths are taken as independent, and a[d][r] as not
    depending on the ranks above (the probe measures it along the rank-0 chain). Unknown
    (depth, rank) pairs, beyond the probe, count as never accepted.
    """
    p = 1.0
    for d, r in enumerate(choice):
        if d >= len(rates) or r >= len(rates[d]):
            return 0.0
        p *= rates[d][r]
    return p


def expected_accepted(choices: Sequence[Sequence[int]], rates: Rates) -> float:
    """E[accepted drafts] of a prefix-closed static tree: the sum of its nodes' path probabilities
    (each node contributes 1 exactly when it is on the accepted path; see :func:`path_probability`
    for the independence approximation)."""
    return sum(path_probability(c, rates) for c in choices)


def greedy_trees(rates: Rates, max_drafts: int) -> list[tuple[Choice, ...]]:
    """Trees grown one node at a time, each time adding the addable node of highest path
    probability (Sequoia-style); element i has i + 1 drafts.

    Addable nodes keep the tree prefix-closed with contiguous sibling ranks: the first child of a
    node, or the next sibling of a node. When a[d][r] does not increase with r (which
    :func:`estimate_rates` enforces), each addable node is worth no more than the node it
    extends, so the greedy tree of size n holds the n most probable nodes and maximises
    :func:`expected_accepted` over all trees of that size. Stops early when no addable node has a
    positive probability (it would only add cost).
    """
    check(max_drafts >= 0, f"max_drafts must be >= 0, got {max_drafts}")
    heap: list[tuple[float, Choice, float]] = []  # (-path probability, node, parent's probability)
    if rates and rates[0]:
        heap.append((-rates[0][0], (0,), 1.0))
    nodes: list[Choice] = []
    trees: list[tuple[Choice, ...]] = []
    while heap and len(nodes) < max_drafts:
        neg, node, parent_p = heapq.heappop(heap)
        p = -neg
        if p <= 0.0:
            break
        nodes.append(node)
        trees.append(tuple(nodes))
        depth, rank = len(node), node[-1]
        if rank + 1 < len(rates[depth - 1]):
            heapq.heappush(heap, (-parent_p * rates[depth - 1][rank + 1], node[:-1] + (rank + 1,), parent_p))
        if depth < len(rates) and rates[depth]:
            heapq.heappush(heap, (-p * rates[depth][0], node + (0,), p))
    return trees


@dataclass(frozen=True)
class RoundRecord:
    """One verify round of one row: the sibling ranks of the accepted path (empty: nothing
    accepted) and the deepest depth the loop allowed (the image's remaining tokens)."""

    ranks: Choice
    depth_cap: int


def count_trials(
    records: Sequence[RoundRecord], probe: Sequence[Sequence[int]]
) -> tuple[list[list[int]], list[list[int]]]:
    """(trials, accepts) per (depth, rank) from probe rounds.

    A trial of (d, r) is a round in which the accepted path reached depth d - 1 at a node with
    more than r children in the probe, within the depth cap; it is a success if the accepted child
    at depth d has rank r. Whether rank r is accepted does not depend on later siblings, so each
    such round counts for every rank the node has.
    """
    nodes = canonical_choices(probe)
    n_children: dict[Choice, int] = {}
    for c in nodes:
        n_children[c[:-1]] = n_children.get(c[:-1], 0) + 1
    depth = max(len(c) for c in nodes)
    widths = [max((n for p, n in n_children.items() if len(p) == d), default=0) for d in range(depth)]
    trials = [[0] * w for w in widths]
    accepts = [[0] * w for w in widths]
    known = set(nodes)
    for rec in records:
        check(
            all(rec.ranks[:d] in known for d in range(1, len(rec.ranks) + 1)),
            f"accepted path {list(rec.ranks)} is not a path of the probe tree",
        )
        reached: Choice = ()
        for d in range(1, min(depth, rec.depth_cap) + 1):
            kids = n_children.get(reached, 0)
            if kids == 0:
                break
            for r in range(kids):
                trials[d - 1][r] += 1
            if len(rec.ranks) < d:
                break
            accepts[d - 1][rec.ranks[d - 1]] += 1
            reached = rec.ranks[:d]
    return trials, accepts


def estimate_rates(
    trials: Sequence[Sequence[int]], accepts: Sequence[Sequence[int]], prior_strength: float = 2.0
) -> Rates:
    """a[d][r] from counts, shrunk toward the previous depth and made non-increasing in rank.

    Deep levels are reached in few rounds, so each estimate is shrunk toward the estimate one
    level up with ``prior_strength`` pseudo-trials (negligible once a level has dozens of trials;
    depth 1 is shrunk toward 0 only when it has no trials at all). Then a pool-adjacent-violators
    pass makes a[d][r] non-increasing in r (a later sample is never more likely accepted than an
    earlier one in expectation), which keeps the greedy tree builder optimal; pooling averages
    neighbours, so the level's total is unchanged.
    """
    rates: list[tuple[float, ...]] = []
    for d, (tr, ac) in enumerate(zip(trials, accepts, strict=True)):
        prior = [rates[d - 1][r] if d > 0 and r < len(rates[d - 1]) else 0.0 for r in range(len(tr))]
        s = prior_strength if d > 0 else 0.0
        raw = [(a + s * p) / (t + s) if t + s > 0 else p for t, a, p in zip(tr, ac, prior, strict=True)]
        rates.append(tuple(_non_increasing(raw, [t + s for t in tr])))
    return tuple(rates)


def _non_increasing(values: Sequence[float], weights: Sequence[float]) -> list[float]:
    """Weighted pool-adjacent-violators fit of a non-increasing sequence."""
    blocks: list[list[float]] = []  # [mean, weight, count]
    for v, w in zip(values, weights, strict=True):
        blocks.append([v, max(w, 1e-9), 1])
        while len(blocks) > 1 and blocks[-2][0] < blocks[-1][0]:
            m2, w2, c2 = blocks.pop()
            m1, w1, c1 = blocks.pop()
            blocks.append([(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2, c1 + c2])
    return [b[0] for b in blocks for _ in range(int(b[2]))]


@dataclass(frozen=True)
class AcceptanceModel:
    """Per-(depth, rank) acceptance of one drafter + method + sampling, from a probe run."""

    rates: Rates
    trials: tuple[tuple[int, ...], ...]
    accepts: tuple[tuple[int, ...], ...]
    rounds: int
    method: str = ""
    probe: tuple[Choice, ...] = ()
    measured_tokens_per_round: float = 0.0  # of the probe run itself: (N - 1) / rounds per row

    @classmethod
    def from_records(
        cls, records: Sequence[RoundRecord], probe: Sequence[Sequence[int]], method: str = "",
        prior_strength: float = 2.0,
    ) -> AcceptanceModel:
        check(len(records) > 0, "calibration recorded no verify rounds")
        trials, accepts = count_trials(records, probe)
        tau = 1.0 + sum(len(r.ranks) for r in records) / len(records)
        return cls(
            rates=estimate_rates(trials, accepts, prior_strength),
            trials=tuple(map(tuple, trials)),
            accepts=tuple(map(tuple, accepts)),
            rounds=len(records),
            method=method,
            probe=canonical_choices(probe),
            measured_tokens_per_round=tau,
        )

    def expected_tokens(self, choices: Sequence[Sequence[int]]) -> float:
        """Predicted tokens per verify round of a tree: 1 + E[accepted drafts]."""
        return 1.0 + expected_accepted(choices, self.rates)

    def summary(self) -> str:
        levels = [f"d{d + 1}: " + "/".join(f"{a:.2f}" for a in r) for d, r in enumerate(self.rates[:4])]
        return f"acceptance by rank ({self.rounds} rounds) " + ", ".join(levels)

    def to_dict(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "rounds": self.rounds,
            "rates": [list(r) for r in self.rates],
            "trials": [list(t) for t in self.trials],
            "accepts": [list(a) for a in self.accepts],
            "probe": [list(c) for c in self.probe],
            "probe_tokens_per_round": self.measured_tokens_per_round,
        }


# ============================================================================================
# Cost model (pure)
# ============================================================================================


def _curve(values: Sequence[float], x: float) -> float:
    """values[i] is the cost at x = i + 1; linear in between, linear extrapolation past the end
    (slope of the last two points, never negative), flat below 1."""
    check(len(values) > 0, "a cost curve needs at least one point")
    n = len(values)
    if x <= 1 or n == 1:
        return values[0]
    if x >= n:
        slope = max(values[-1] - values[-2], 0.0)
        return values[-1] + slope * (x - n)
    lo = int(math.floor(x))
    frac = x - lo
    return values[lo - 1] * (1 - frac) + values[lo] * frac


def non_decreasing(values: Sequence[float]) -> tuple[float, ...]:
    """Least-squares non-decreasing fit (pool adjacent violators). More tree tokens or drafter
    nodes is a superset of the work, so a measured dip is timing noise of a shared machine; the
    profile keeps the raw medians, the cost model uses this fit."""
    return tuple(-v for v in _non_increasing([-v for v in values], [1.0] * len(values)))


def interpolate(xs: Sequence[int], ys: Sequence[float], upto: int) -> tuple[float, ...]:
    """Costs at x = 1..upto from measurements at sorted integer points ``xs`` (linear)."""
    check(len(xs) == len(ys) and len(xs) > 0, "interpolate needs matching, non-empty xs and ys")
    out = []
    for x in range(1, upto + 1):
        if x <= xs[0]:
            out.append(ys[0])
            continue
        if x >= xs[-1]:
            slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]) if len(xs) > 1 else 0.0
            out.append(ys[-1] + max(slope, 0.0) * (x - xs[-1]))
            continue
        i = next(i for i in range(1, len(xs)) if xs[i] >= x)
        f = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
        out.append(ys[i - 1] * (1 - f) + ys[i] * f)
    return tuple(out)


@dataclass(frozen=True)
class CostModel:
    """Wall time of one speculative round, in ms, as a function of the tree.

    round(T) = verify(n nodes incl. root) + drafter context pass over the last round's new tokens
    + one drafter feed per expanded level below the root + overhead, with
    overhead = fixed + per_level * depth + per_node * n (acceptance, sampling, bookkeeping).
    """

    verify_ms: tuple[float, ...]  # [n - 1]: target verify over n tree tokens
    begin_ms: tuple[float, ...]  # [A - 1]: drafter context pass over A new tokens
    feed_ms: tuple[float, ...]  # [E - 1]: drafter feed over E nodes
    overhead_ms: tuple[float, float, float] = (0.0, 0.0, 0.0)  # fixed, per level, per node
    ar_step_ms: float = 0.0  # one plain AR step (the speed-up baseline); 0 = verify_ms[0]

    def __post_init__(self) -> None:
        for name in ("verify_ms", "begin_ms", "feed_ms"):
            values = getattr(self, name)
            check(len(values) > 0 and all(v >= 0 and math.isfinite(v) for v in values),
                  f"cost model {name} must be a non-empty list of finite times >= 0")

    @property
    def ar_ms(self) -> float:
        return self.ar_step_ms if self.ar_step_ms > 0 else self.verify_ms[0]

    def drafting_ms(self, choices: Sequence[Sequence[int]], tokens_per_round: float) -> float:
        _, expanded = level_widths(choices)
        begin = _curve(self.begin_ms, max(tokens_per_round, 1.0))
        return begin + sum(_curve(self.feed_ms, e) for e in expanded[1:] if e > 0)

    def round_ms(self, choices: Sequence[Sequence[int]], tokens_per_round: float) -> float:
        n = len(choices) + 1
        depth = max(len(c) for c in choices)
        fixed, per_level, per_node = self.overhead_ms
        return (_curve(self.verify_ms, n) + self.drafting_ms(choices, tokens_per_round)
                + fixed + per_level * depth + per_node * n)


# ============================================================================================
# Tree search (pure)
# ============================================================================================


@dataclass(frozen=True)
class TreeCandidate:
    """One scored tree. ``spec`` is what ``--tree`` takes (``static:auto_*`` once registered)."""

    spec: str
    choices: tuple[Choice, ...]
    tokens_per_round: float  # predicted: 1 + E[accepted drafts]
    round_ms: float
    ar_step_ms: float

    @property
    def num_nodes(self) -> int:
        return len(self.choices) + 1

    @property
    def depth(self) -> int:
        return max(len(c) for c in self.choices)

    @property
    def cost_units(self) -> float:
        """Round cost in plain AR steps."""
        return self.round_ms / self.ar_step_ms

    @property
    def tokens_per_second(self) -> float:
        return 1000.0 * self.tokens_per_round / self.round_ms

    @property
    def speedup(self) -> float:
        """Predicted wall-clock speed-up over plain AR decoding."""
        return self.tokens_per_round / self.cost_units

    def to_dict(self) -> dict[str, Any]:
        return {
            "tree": self.spec,
            "nodes": self.num_nodes,
            "depth": self.depth,
            "predicted_tokens_per_round": round(self.tokens_per_round, 4),
            "predicted_round_ms": round(self.round_ms, 4),
            "predicted_cost_ar_steps": round(self.cost_units, 4),
            "predicted_tokens_per_second": round(self.tokens_per_second, 2),
            "predicted_speedup": round(self.speedup, 4),
        }


@dataclass(frozen=True)
class AutoTreeChoice:
    """The chosen tree, the scored alternatives (best first) and why."""

    method: str
    best: TreeCandidate
    ranking: tuple[TreeCandidate, ...]
    explanation: str
    acceptance: AcceptanceModel
    cost: CostModel
    profile_seconds: float = 0.0
    calibration_seconds: float = 0.0

    @property
    def falls_back_to_ar(self) -> bool:
        """Speculation is predicted to lose on this device and batch size: even the best tree's
        round costs more AR steps than it yields tokens, so plain AR is the fastest choice."""
        return self.best.speedup < 1.0

    @property
    def tree_spec(self) -> str:
        """``--tree`` form of the chosen tree (``static:auto_*`` names need :meth:`register`), or
        ``ar`` (:data:`lantern.pipeline.AR_FALLBACK_TREE`) when plain AR is predicted faster."""
        return AR_FALLBACK_TREE if self.falls_back_to_ar else self.best.spec

    @property
    def choices(self) -> list[list[int]]:
        return [list(c) for c in self.best.choices]

    def register(self) -> str:
        """Make ``tree_spec`` resolvable in this process (a no-op for chains and named trees)."""
        if (self.best.spec.startswith("static:") and not self.falls_back_to_ar
                and self.tree_spec[7:] not in STATIC_TREES):
            name = register_tree(self.best.choices, prefix="auto")
            check(f"static:{name}" == self.tree_spec, f"registered {name}, expected {self.tree_spec}")
        return self.tree_spec

    def candidate(self, spec: str) -> TreeCandidate | None:
        """The scored candidate for a chain or named tree spec (e.g. ``chain:3``), if scored."""
        return next((c for c in self.ranking if c.spec == spec), None)

    def to_dict(self, top: int = 10) -> dict[str, Any]:
        shown = list(self.ranking[:top])
        shown += [c for c in self.ranking[top:] if not c.spec.startswith("static:auto_")]
        return {
            "method": self.method,
            "tree": self.tree_spec,
            "choices": self.choices,
            "explanation": self.explanation,
            "best": self.best.to_dict(),
            "ranking": [c.to_dict() for c in shown],
            "acceptance": self.acceptance.to_dict(),
            "cost_model": {
                "verify_ms": list(self.cost.verify_ms),
                "begin_ms": list(self.cost.begin_ms),
                "feed_ms": list(self.cost.feed_ms),
                "overhead_ms": {"fixed": self.cost.overhead_ms[0], "per_level": self.cost.overhead_ms[1],
                                "per_node": self.cost.overhead_ms[2]},
                "ar_step_ms": self.cost.ar_ms,
            },
            "profile_seconds": round(self.profile_seconds, 2),
            "calibration_seconds": round(self.calibration_seconds, 2),
        }


def candidate_trees(rates: Rates, max_drafts: int, max_depth: int) -> list[tuple[str, tuple[Choice, ...]]]:
    """(spec, choices) of every candidate, deduplicated by shape: chains 1..8, the built-in named
    trees, and the greedy tree of every size up to ``max_drafts``. A shape keeps its simplest
    name (chain, then named, then ``static:auto_<hash>``). Trees deeper than ``max_depth`` (the
    image's token count minus one) are left out."""
    out: dict[tuple[Choice, ...], str] = {}

    def add(spec: str, choices: Sequence[Sequence[int]]) -> None:
        shape = canonical_choices(choices)
        if max(len(c) for c in shape) <= max_depth and shape not in out:
            out[shape] = spec

    for n in range(1, 9):
        add(f"chain:{n}", chain_choices(n))
    for name in sorted(BUILTIN_TREES):
        add(f"static:{name}", STATIC_TREES[name])
    for tree in greedy_trees(rates, max_drafts):
        add(f"static:auto_{tree_hash(tree)}", tree)
    return [(spec, shape) for shape, spec in out.items()]


def select_tree(
    acceptance: AcceptanceModel,
    cost: CostModel,
    *,
    method: str = "",
    max_drafts: int = DEFAULT_MAX_DRAFTS,
    max_depth: int = 1 << 30,
) -> AutoTreeChoice:
    """Score every candidate (:func:`candidate_trees`) by predicted tokens per second; best first.
    Pure: an ``auto`` tree is only registered by :meth:`AutoTreeChoice.register`."""
    check(max_drafts >= 1, f"max_drafts must be >= 1, got {max_drafts}")
    scored = []
    for spec, choices in candidate_trees(acceptance.rates, max_drafts, max_depth):
        tau = acceptance.expected_tokens(choices)
        scored.append(TreeCandidate(spec, choices, tau, cost.round_ms(choices, tau), cost.ar_ms))
    check(bool(scored), f"no candidate tree fits an image of {max_depth + 1} tokens")
    ranking = sorted(scored, key=lambda c: (-c.tokens_per_second, c.num_nodes, c.spec))
    # Near-ties go to the smaller tree: the prediction is not that precise, and fewer nodes is
    # less work on every device.
    top = ranking[0].tokens_per_second
    best = min((c for c in ranking if c.tokens_per_second >= top * (1 - TIE_TOLERANCE)),
               key=lambda c: (c.num_nodes, c.spec))
    ranking = [best, *(c for c in ranking if c is not best)]
    return AutoTreeChoice(method, best, tuple(ranking), explain(best, ranking, acceptance), acceptance, cost)


TIE_TOLERANCE = 0.005


def _describe(c: TreeCandidate) -> str:
    if c.spec.startswith("static:auto_"):
        return f"a {c.num_nodes - 1}-draft tree of depth {c.depth}"
    return f"{c.spec} ({c.num_nodes - 1} drafts)"


def explain(best: TreeCandidate, ranking: Sequence[TreeCandidate], acceptance: AcceptanceModel) -> str:
    """One paragraph: the pick, its prediction, and what the strongest alternatives would do."""
    name = best.spec
    if best.spec.startswith("static:auto_"):
        name += f" ({best.num_nodes - 1} drafts, depth {best.depth}, nodes per depth {level_widths(best.choices)[0]})"
    text = (f"{name} — expected {best.tokens_per_round:.2f} tokens per round at {best.cost_units:.2f} AR steps per "
            f"round: predicted {best.speedup:.2f}x vs AR")
    if best.speedup < 1.0:
        text = f"plain AR (speculation loses here: the best tree, {text})"
    most = max(ranking, key=lambda c: c.tokens_per_round)
    others = []
    if most is not best:
        others.append(f"{_describe(most)} would accept {most.tokens_per_round:.2f} but costs "
                      f"{most.cost_units:.2f} AR steps on this device ({most.speedup:.2f}x)")
    for spec in ("chain:3", "static:naive_extend_57"):
        c = next((c for c in ranking if c.spec == spec), None)
        if c is not None and c is not best and c is not most:
            others.append(f"{spec}: {c.tokens_per_round:.2f} tokens at {c.cost_units:.2f} steps ({c.speedup:.2f}x)")
    tail = ("; " + "; ".join(others)) if others else ""
    return f"{text}{tail}. {acceptance.summary()}."


# ============================================================================================
# Calibration: run a probe tree and record the accepted ranks
# ============================================================================================


class RecordingDrafter:
    """Wraps the loop's drafter and records, per round and row, the ranks of the accepted path.

    The loop is not changed: ``commit`` receives ``next_tokens`` = the accepted drafts, then the
    next token, and ``num_new`` = accepted + 1. Static trees draw siblings without replacement
    (distinct tokens), so the accepted child at each depth is the unique child of the previous
    accepted node whose token matches; its rank is its position among the node's children
    (children are stored in sibling order). Works for any batch size; rows that are finished
    (``num_new == 0``) record nothing.
    """

    def __init__(self, inner: Drafter) -> None:
        self.inner = inner
        self.records: list[RoundRecord] = []
        self._last: tuple[Tensor, Tensor, Tensor] | None = None  # tokens, children, depth caps (CPU)

    @property
    def forwards(self) -> int:
        return int(self.inner.forwards)

    def start(self, hidden: Tensor, root: Tensor) -> None:
        self.inner.start(hidden, root)

    def propose(self, generators: list[torch.Generator] | None, active: Tensor, max_depth: Tensor) -> DraftTree:
        tree = self.inner.propose(generators, active, max_depth)
        self._last = (tree.tokens.cpu(), tree.buffers.children.cpu(), max_depth.cpu())
        return tree

    def commit(self, hidden: Tensor, next_tokens: Tensor, num_new: Tensor) -> None:
        assert self._last is not None, "commit before propose"
        tokens, children, caps = self._last
        nxt, new = next_tokens.cpu(), num_new.cpu()
        for b in range(tokens.shape[0]):
            if int(new[b]) > 0:
                self.records.append(RoundRecord(_accepted_ranks(tokens[b], children[b], nxt[b], int(new[b]) - 1),
                                                int(caps[b])))
        self.inner.commit(hidden, next_tokens, num_new)


def _accepted_ranks(tokens: Tensor, children: Tensor, next_tokens: Tensor, num_accepted: int) -> Choice:
    """Follow the accepted drafts down the tree: tokens [T], children [T, C], next_tokens [A]."""
    node, ranks = 0, []
    for j in range(num_accepted):
        kids = children[node]
        match = ((kids >= 0) & (tokens[kids.clamp(min=0)] == next_tokens[j])).nonzero().flatten()
        if match.numel() != 1:
            raise RuntimeError(f"accepted draft {j} matches {match.numel()} children of node {node}; "
                               "expected exactly one (siblings are distinct samples)")
        ranks.append(int(match[0]))
        node = int(kids[match[0]])
    return tuple(ranks)


def probe_tree(num_tokens: int, widths: Sequence[int] = DEFAULT_PROBE_WIDTHS) -> tuple[TreeConfig, list[list[int]]]:
    """The registered probe tree (``static:probe_<hash>``), no deeper than the image allows."""
    check(num_tokens >= 2, f"calibration needs an image of >= 2 tokens, got {num_tokens}")
    choices = probe_choices(list(widths)[: num_tokens - 1])
    return TreeConfig.parse(f"static:{register_tree(choices, prefix='probe')}"), choices


def record_rounds(
    target: Target,
    drafter: Drafter,
    cond: Tensor,
    generators: list[torch.Generator] | None,
    acceptance: Acceptance | None = None,
    cond_mask: Tensor | None = None,
) -> tuple[list[RoundRecord], GenerationOutput]:
    """Run one ``generate`` with ``drafter`` wrapped in a :class:`RecordingDrafter`."""
    recorder = RecordingDrafter(drafter)
    out = generate(target, cond, generators=generators, drafter=recorder, acceptance=acceptance, cond_mask=cond_mask)
    return recorder.records, out


def calibration_labels(num_classes: int, count: int = 4) -> list[int]:
    """``count`` labels spread over the classes (0 and evenly spaced ones)."""
    count = max(1, min(count, num_classes))
    return [i * num_classes // count for i in range(count)]


def _calibration_conditions(stack: Stack, count: int = 4) -> list[Any]:
    """Calibration conditions: labels spread over the classes, or the stack's measurement prompts."""
    return calibration_labels(stack.num_classes, count) if stack.num_classes else stack.sample_conditions(count)


# Calibration images use seeds of image indices from here on, so they never repeat the seeds of
# the images a run then generates (image_seed(seed, 0..N-1)).
CALIBRATION_SEED_OFFSET = 1_000_000


def calibrate(
    stack: Stack,
    method: str | MethodConfig,
    sampling: SamplingConfig,
    *,
    labels: Sequence[Any] | None = None,
    seed: int = 0,
    batch_size: int = 1,
    widths: Sequence[int] = DEFAULT_PROBE_WIDTHS,
    drafter_dir: str | None = None,
    proximity: str | None = None,
    progress: bool = False,
) -> AcceptanceModel:
    """Generate a few images with the method's acceptance rule and a probe tree; estimate a[d][r].

    ``method`` is a method name or a resolved :class:`lantern.pipeline.MethodConfig`; only its
    acceptance rule (and relaxation parameters) matter, its tree is replaced by the probe.
    """
    from tqdm.auto import tqdm

    from lantern.sampling import make_generators

    method_cfg = _method_config(method)
    labels = list(labels) if labels is not None else _calibration_conditions(stack)
    check(len(labels) >= 1, "calibration needs at least one label")
    tree, choices = probe_tree(stack.num_tokens, widths)
    prepared = prepare_method(stack, replace(method_cfg, tree=tree), sampling, drafter_dir, proximity)
    conditions = stack.encode(labels)
    records: list[RoundRecord] = []
    for lo in tqdm(range(0, len(labels), batch_size), desc=f"calibrate {method_cfg.method}", disable=not progress,
                   leave=False):
        chunk = conditions.rows(lo, lo + batch_size)
        gens = make_generators([image_seed(seed, CALIBRATION_SEED_OFFSET + i) for i in range(lo, lo + len(chunk))],
                               stack.device)
        assert prepared.drafter is not None
        target, drafter = prepared.parts()
        assert drafter is not None
        got, _ = record_rounds(target, drafter, chunk.cond, None if sampling.greedy else gens, prepared.acceptance,
                               chunk.mask)
        records.extend(got)
    return AcceptanceModel.from_records(records, choices, method=method_cfg.method)


def _method_config(method: str | MethodConfig) -> MethodConfig:
    if isinstance(method, MethodConfig):
        cfg = method
    else:
        check(isinstance(method, str), f"method must be a name or a MethodConfig, got {type(method).__name__}")
        check(method in SPECULATIVE_METHODS,
              f"--tree auto needs a speculative --method ({', '.join(SPECULATIVE_METHODS)}), got {method!r}")
        cfg = MethodConfig.resolve(method)
    check(cfg.method in SPECULATIVE_METHODS,
          f"--tree auto needs a speculative --method ({', '.join(SPECULATIVE_METHODS)}), got {cfg.method!r}")
    return cfg


# ============================================================================================
# Device profile: measured costs
# ============================================================================================


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
        check(self.meta.get("batch_size") == batch_size,
              f"{what} was measured at batch size {self.meta.get('batch_size')}, this run uses {batch_size}")
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
        try:
            meta = {k: v for k, v in raw.items()
                    if k not in ("version", "verify", "drafter", "ar_step_ms", "ar_step_ratio", "overhead")}
            v, d = raw["verify"], raw["drafter"]
            profile = cls(
                meta=meta,
                verify_tokens=tuple(int(x) for x in v["tokens"]), verify_ms=tuple(float(x) for x in v["ms"]),
                begin_tokens=tuple(int(x) for x in d["begin_new_tokens"]),
                begin_ms=tuple(float(x) for x in d["begin_ms"]),
                feed_nodes=tuple(int(x) for x in d["feed_nodes"]), feed_ms=tuple(float(x) for x in d["feed_ms"]),
                ar_step_ms=float(raw["ar_step_ms"]),
                overhead={rule: OverheadFit(float(f["fixed_ms"]), float(f["per_level_ms"]), float(f["per_node_ms"]),
                                            tuple(f.get("runs", ())))
                          for rule, f in raw["overhead"].items()},
            )
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise LanternError(f"{what} is not a lantern device profile: missing or bad field {e}") from None
        check(len(profile.verify_tokens) == len(profile.verify_ms) > 0 and profile.verify_tokens[0] == 1,
              f"{what}: the verify curve must start at 1 token")
        return profile


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
    drafter_dir: str | None = None,
    proximity: str | None = None,
    progress: bool = False,
) -> DeviceProfile:
    """Measure the cost model on the device the stack's target is on.

    (a) target verify over n tokens (a chain mask; half the image committed as the prefix),
    (b) the EAGLE drafter's context pass over A new tokens and a feed over E nodes, the same
    prefix, (c) the per-round loop overhead of each acceptance rule (:class:`OverheadFit`) and the
    plain AR step, from short real generations. ``rules`` defaults to every rule the stack supports
    (relaxed rules need its proximity table).
    """
    from tqdm.auto import tqdm

    settings = settings or ProfileSettings()
    drafter = drafter_dir or stack.drafter_dir
    check(drafter is not None, f"--model {stack.root} has no drafter/ folder and no --drafter was given")
    if rules is None:
        has_table = proximity is not None or stack.proximity_file is not None
        rules = ("exact", "lantern", "lantern++") if has_table else ("exact",)
    for rule in rules:
        check(rule in METHOD_OF_RULE, f"unknown acceptance rule {rule!r}; known: {', '.join(METHOD_OF_RULE)}")
    q = settings.quick
    reps, warm = settings.repeats, 1
    v_pts, b_pts, f_pts = settings.verify_points(), settings.begin_points(), settings.feed_points()
    total = (reps + warm) * (len(v_pts) + len(b_pts) + len(f_pts)) + 1 + len(rules) * len(_overhead_trees(stack))
    timer = _Timer(stack.device)
    with torch.no_grad(), tqdm(total=total, desc="profile", disable=not progress, leave=False) as bar:
        verify_ms = _measure_verify(stack, sampling, settings, v_pts, timer, reps, warm, bar)
        begin_ms, feed_ms = _measure_drafter(stack, str(drafter), sampling, settings, b_pts, f_pts, timer, reps, warm,
                                             bar)
        partial = CostModel(
            verify_ms=interpolate(v_pts, non_decreasing(verify_ms), settings.max_tokens),
            begin_ms=interpolate(b_pts, non_decreasing(begin_ms), b_pts[-1]),
            feed_ms=interpolate(f_pts, non_decreasing(feed_ms), f_pts[-1]),
        )
        ar_ms, overhead = _measure_loop(stack, sampling, settings, rules, partial, bar, drafter_dir, proximity)
    meta = {
        "device": _device_string(stack.device),
        "torch_threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
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
                 "overhead is fitted to real generations (see lantern.autotree.OverheadFit)",
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
    stack: Stack, drafter_dir: str, sampling: SamplingConfig, settings: ProfileSettings, begin_pts: list[int],
    feed_pts: list[int], timer: _Timer, reps: int, warm: int, bar: Any,
) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """The drafter's begin over A new tokens and feed over E nodes, after half the image.

    Each measurement restores the drafter cache's committed length afterwards, so every repeat
    sees the same prefix (the cache's K/V past that length are ignored by the masks)."""
    device, b, vocab = stack.device, settings.batch_size, stack.vocab_size
    # Loaded and placed as prepare_method loads it for generation.
    prepared = prepare_method(stack, MethodConfig.resolve("sd", "chain:1"), sampling, drafter_dir)
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
    cache = getattr(backend, "cache", None)
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
    partial: CostModel, bar: Any, drafter_dir: str | None, proximity: str | None,
) -> tuple[float, dict[str, OverheadFit]]:
    """Real generations: plain AR (the per-step baseline) and the overhead trees per rule."""
    cond = _conditions(stack, settings.batch_size)
    gens = [image_seed(settings.seed, i) for i in range(settings.batch_size)]
    ar = prepare_method(stack, MethodConfig.resolve("ar"), sampling)
    _timed_run(ar, cond, gens, sampling)  # warm-up (kernels, allocator), not used
    ar_wall, ar_out = _timed_run(ar, cond, gens, sampling)
    bar.update(1)
    ar_ms = ar_wall / (ar_out.stats.steps + 1)  # + 1: the prefill forward
    fits = {}
    for rule in rules:
        base = prepare_method(stack, MethodConfig.resolve(METHOD_OF_RULE[rule], "chain:1"), sampling, drafter_dir,
                              proximity)
        runs = []
        for spec, choices in _overhead_trees(stack):
            named = spec.startswith(("chain:", "static:"))
            name = spec if named else f"static:{register_tree(choices, prefix='probe')}"
            prepared = replace(base, method=replace(base.method, tree=TreeConfig.parse(name)))
            wall, out = _timed_run(prepared, cond, gens, sampling)
            bar.update(1)
            runs.append(_overhead_run(spec, choices, wall, out, partial))
        fits[rule] = _fit_overhead(runs)
    return ar_ms, fits


def _timed_run(
    prepared: PreparedMethod, cond: Conditions, seeds: list[int], sampling: SamplingConfig
) -> tuple[float, GenerationOutput]:
    from lantern.sampling import make_generators

    gens = make_generators(seeds, cond.cond.device)
    timer = _Timer(cond.cond.device)
    out: list[GenerationOutput] = []
    ms = timer(lambda: out.append(prepared.generate(cond.cond, gens, cond_mask=cond.mask)))
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


# ============================================================================================
# The whole chain
# ============================================================================================


def choose_tree(
    stack: Stack,
    method: str | MethodConfig,
    sampling: SamplingConfig,
    *,
    profile: DeviceProfile | str | Path | None = None,
    calibration_labels: Sequence[Any] | None = None,
    seed: int = 0,
    batch_size: int = 1,
    max_drafts: int = DEFAULT_MAX_DRAFTS,
    drafter_dir: str | None = None,
    proximity: str | None = None,
    progress: bool = False,
) -> AutoTreeChoice:
    """Pick the fastest static tree for ``method`` on this device (``--tree auto``).

    ``method``: a speculative method name or resolved ``MethodConfig`` (its relaxation settings are
    used). ``profile``: a :class:`DeviceProfile`, a ``profile.json`` from ``lantern profile``, or
    None for a quick measurement now (~10-20 s on a CPU). Calibration generates
    ``calibration_labels`` (default: 4 labels spread over the classes) with a probe tree. The
    chosen tree is registered, so ``choice.tree_spec`` can be passed to ``MethodConfig.resolve``.
    """
    method_cfg = _method_config(method)
    rule = RULE_OF_METHOD[method_cfg.method]
    t0 = time.perf_counter()
    if profile is None:
        profile = measure_profile(stack, sampling, ProfileSettings(batch_size=batch_size, quick=True, seed=seed),
                                  rules=(rule,), drafter_dir=drafter_dir, proximity=proximity, progress=progress)
    elif not isinstance(profile, DeviceProfile):
        profile = load_profile(profile)
    profile.check_matches(stack, sampling, batch_size, "--profile")
    t1 = time.perf_counter()
    acceptance = calibrate(stack, method_cfg, sampling, labels=calibration_labels, seed=seed,
                           batch_size=batch_size, drafter_dir=drafter_dir, proximity=proximity, progress=progress)
    t2 = time.perf_counter()
    max_drafts = min(max_drafts, profile.max_tokens - 1)
    choice = select_tree(acceptance, profile.cost_model(rule), method=method_cfg.method, max_drafts=max_drafts,
                         max_depth=stack.num_tokens - 1)
    choice = replace(choice, profile_seconds=t1 - t0, calibration_seconds=t2 - t1)
    choice.register()
    return choice


def choose_trees(
    stack: Stack,
    methods: Sequence[str],
    sampling: SamplingConfig,
    *,
    profile: DeviceProfile | str | Path | None = None,
    seed: int = 0,
    batch_size: int = 1,
    progress: bool = False,
) -> dict[str, AutoTreeChoice]:
    """:func:`choose_tree` for every speculative method in ``methods`` (others are skipped), with
    one device profile shared by all (measured once, quick, for the rules they need)."""
    wanted = [m for m in methods if m in SPECULATIVE_METHODS]
    seconds = 0.0
    if profile is None and wanted:
        rules = tuple(dict.fromkeys(RULE_OF_METHOD[m] for m in wanted))
        t0 = time.perf_counter()
        profile = measure_profile(stack, sampling, ProfileSettings(batch_size=batch_size, quick=True, seed=seed),
                                  rules=rules, progress=progress)
        seconds = time.perf_counter() - t0
    chosen = {m: choose_tree(stack, m, sampling, profile=profile, seed=seed, batch_size=batch_size, progress=progress)
              for m in wanted}
    return {m: replace(c, profile_seconds=c.profile_seconds + seconds) for m, c in chosen.items()}  # shared


@dataclass
class StackWithTrees:
    """A stack whose :meth:`default_tree` answers from ``trees`` first, so code that asks the
    stack for a method's tree (``lantern demo``) uses trees chosen at run time; everything else is
    the wrapped stack's (any :class:`~lantern.stack.Stack`)."""

    def __init__(self, stack: Stack, trees: Mapping[str, str]) -> None:
        self.stack, self.trees = stack, dict(trees)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stack, name)

    def default_tree(self, method: str) -> str | None:
        return self.trees.get(method) or self.stack.default_tree(method)


def with_trees(stack: Stack, trees: Mapping[str, str]) -> StackWithTrees:
    base = stack.stack if isinstance(stack, StackWithTrees) else stack
    return StackWithTrees(base, trees)
