"""Acceptance model and cost model of a draft tree (pure functions)."""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lantern.decoding.trees import canonical_choices, level_widths
from lantern.errors import check
from lantern.methods import METHOD_TABLE

Choice = tuple[int, ...]  # sibling ranks from the root: (a, b) = the b-th child of the root's a-th child


Rates = tuple[tuple[float, ...], ...]  # rates[d - 1][r] = a[d][r]


PROFILE_VERSION = 1


# Probe widths per depth: 5 samples at depth 1 (naive_extend_57 uses 5), fewer deeper, 8 levels
# (chain:8 is a candidate). 25 drafts: one verify over 26 tokens per calibration round.
DEFAULT_PROBE_WIDTHS = (5, 4, 4, 3, 3, 2, 2, 2)


DEFAULT_MAX_DRAFTS = 63  # largest tree the search grows (the paper's trees have 58-64 nodes)


# Acceptance rules and the method whose real runs measure their cost.
RULE_OF_METHOD = {r.name: r.rule for r in METHOD_TABLE.values() if r.drafts_a_tree}


METHOD_OF_RULE = {"exact": "sd", "lantern": "lantern", "lantern++": "lantern++"}


SPECULATIVE_METHODS = tuple(RULE_OF_METHOD)


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
