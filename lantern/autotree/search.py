"""Tree search over the acceptance and cost models (pure)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lantern.autotree.model import DEFAULT_MAX_DRAFTS, AcceptanceModel, Choice, CostModel, Rates, greedy_trees
from lantern.decoding.config import TreeConfig
from lantern.decoding.trees import STATIC_TREES, canonical_choices, chain_choices, level_widths, tree_hash
from lantern.errors import check
from lantern.methods import AR_FALLBACK_TREE


@dataclass(frozen=True)
class TreeCandidate:
    """One scored tree. ``spec``: its ``--tree`` form (``static:auto_<hash>`` for a searched shape,
    which only :attr:`config` can run: the shape rides in the config, not in a registry)."""

    spec: str
    choices: tuple[Choice, ...]
    tokens_per_round: float  # predicted: 1 + E[accepted drafts]
    round_ms: float
    ar_step_ms: float

    @property
    def num_nodes(self) -> int:
        return len(self.choices) + 1

    @property
    def config(self) -> TreeConfig:
        """The tree as the loop runs it."""
        if self.spec.startswith("static:auto_"):
            return TreeConfig.from_choices(self.choices, prefix="auto")
        return TreeConfig.parse(self.spec)

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
    # Under --compile: the compile mode and each timed candidate's measured ms per image token
    # (lantern.autotree.choose.time_compiled); empty when the choice is the cost model's alone.
    compile: str | None = None
    compiled_ms_per_token: tuple[tuple[str, float], ...] = ()  # plain AR as "ar"
    timing_seconds: float = 0.0
    # Under --compile, what the compiled timing found fastest: "ar" or "tree" (None: not timed, the
    # cost model's prediction decides). It overrides the prediction either way.
    compiled_winner: str | None = None

    @property
    def falls_back_to_ar(self) -> bool:
        """Speculation loses on this device and batch size, so plain AR is the fastest choice: under
        --compile, compiled AR was timed faster than every tree; else even the best tree's round is
        predicted to cost more AR steps than it yields tokens."""
        if self.compiled_winner is not None:
            return self.compiled_winner == "ar"
        return self.best.speedup < 1.0

    @property
    def tree_spec(self) -> str:
        """``--tree`` form of the chosen tree (for display and records), or ``ar``
        (:data:`lantern.methods.AR_FALLBACK_TREE`) when plain AR is predicted faster."""
        return AR_FALLBACK_TREE if self.falls_back_to_ar else self.best.spec

    @property
    def tree(self) -> TreeConfig | str:
        """What to resolve the method with (``tree=``): the chosen tree's config, which carries its
        choices, or ``ar`` when plain AR is predicted faster."""
        return AR_FALLBACK_TREE if self.falls_back_to_ar else self.best.config

    @property
    def choices(self) -> list[list[int]]:
        return [list(c) for c in self.best.choices]

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
            "compile": self.compile,
            "compiled_ms_per_token": {spec: round(ms, 4) for spec, ms in self.compiled_ms_per_token},
            "compiled_winner": self.compiled_winner,
            "timing_seconds": round(self.timing_seconds, 2),
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
    for name in sorted(STATIC_TREES):
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
    Pure."""
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
