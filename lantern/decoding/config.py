"""Frozen, validated configuration dataclasses.

Each config validates itself in ``__post_init__`` and raises :class:`LanternError` naming the
offending field, so a bad value fails where the user typed it and not deep inside torch.

Importing this module imports no torch (the tree helpers a static tree needs are read when one is
built): ``lantern.methods`` and the ``lantern`` command's parser read these configs, and
``lantern --help`` should not wait for torch (tests/test_cli_startup.py).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from functools import cached_property
from numbers import Real
from typing import Any, Literal, TypedDict, Unpack, get_args

from lantern.errors import check

# Guidance scales in use are 1.5-10 (LlamaGen 1.75-4, Lumina-mGPT 3-4); far beyond, the guided
# logits overflow (``--cfg-scale 1e39`` gave all-zero codes), so the range is bounded.
MAX_CFG_SCALE = 100.0

# Nodes one verify forward may hold, root included, whatever the method and tree kind (a chain, a
# static or dynamic drafter tree, a Jacobi window, SJD-PAC's chain plus K-ary subtree): checked from
# the settings alone, before any tree is built, because a round's cost grows with its nodes (4,160
# SJD-PAC nodes made one digits round take ~30 s) and SJD-PAC's subtree grows as K^(D-1) (64^63
# nodes for --pac-width 64 --pac-depth 64, built as a Python set). The largest trees the methods'
# papers use hold 58-64 nodes (EAGLE's and LANTERN's static and dynamic trees; SJD-PAC's L = 64),
# --tree auto grows at most 64 and --sjd-window auto tries windows up to 32 (51 nodes with SJD-PAC's
# subtree), so 256 leaves four times the largest of them.
MAX_TREE_NODES = 256


def check_tree_nodes(nodes: float, settings: str, field: str) -> None:
    """LanternError unless a round of ``nodes`` nodes (root included) is within :data:`MAX_TREE_NODES`.
    ``settings``: what made them, as the user typed it (``--sjd-window 300``); ``field``: the setting to lower."""
    advice = "pick a smaller --tree" if field == "tree" else f"lower --{field.replace('_', '-')}"
    check(nodes <= MAX_TREE_NODES,
          f"{settings} makes a tree of {node_count_text(nodes)} nodes per round (root included); at most "
          f"{MAX_TREE_NODES} fit one verify forward: {advice}", field=field)


def node_count_text(nodes: float) -> str:
    """A node count for a message: exact while it is readable, else its magnitude (``6.3e+113``)."""
    if math.isinf(nodes):
        return "more than 1e+308"
    return f"{nodes:.0f}" if nodes < 1e9 else f"{nodes:.2g}"


RelaxationMode = Literal["absolute", "relative", "group"]
ResidualMode = Literal["paper", "official", "official-lumina"]
RESIDUALS: tuple[str, ...] = get_args(ResidualMode)
RelaxationBudget = Literal["test", "token"]
RelaxationCredit = Literal["drawn", "clean"]
CREDITS: tuple[str, ...] = get_args(RelaxationCredit)


@dataclass(frozen=True)
class SamplingConfig:
    """How the target's next-token distribution p is formed from its logits.

    Order (LlamaGen's): CFG on raw logits -> temperature -> top-k -> top-p -> softmax.
    ``temperature == 0`` means greedy argmax decoding. ``top_k == 0`` and ``top_p == 1`` turn the
    filters off. ``cfg_scale == 1`` means no guidance and no doubled batch.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    cfg_scale: float = 1.0

    def __post_init__(self) -> None:
        # Types first: a string such as temperature="1.0" from a Python caller would otherwise
        # surface as a TypeError from math.isfinite or a comparison.
        for name in ("temperature", "top_p", "cfg_scale"):
            value = getattr(self, name)
            check(isinstance(value, Real) and not isinstance(value, bool),
                  f"{name} must be a number, got {value!r} ({type(value).__name__})", field=name)
        check(
            math.isfinite(self.temperature) and self.temperature >= 0,
            f"temperature must be >= 0 (0 means greedy), got {self.temperature}", field="temperature",
        )
        check(
            isinstance(self.top_k, int) and not isinstance(self.top_k, bool) and self.top_k >= 0,
            f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}", field="top_k",
        )
        check(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}", field="top_p")
        check(
            math.isfinite(self.cfg_scale) and 1.0 <= self.cfg_scale <= MAX_CFG_SCALE,
            f"cfg_scale must be in [1, {MAX_CFG_SCALE:g}] (1 disables guidance; usual values 1.5-10), "
            f"got {self.cfg_scale}", field="cfg_scale",
        )
        # Held as floats, as the fields say: cfg_scale=4 from Python is the CLI's --cfg-scale 4 (4.0)
        # in run.json and in the settings an output hands back, not an int beside its float.
        for name in ("temperature", "top_p", "cfg_scale"):
            object.__setattr__(self, name, float(getattr(self, name)))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def use_cfg(self) -> bool:
        return self.cfg_scale > 1.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class RelaxationConfig:
    """LANTERN's relaxed acceptance ([LANTERN], [LANTERN++]).

    A drafted token x is credited with the target mass of the longest proximity-ordered prefix of
    its ``k`` nearest latent neighbours whose cumulative mass stays within a bound:

    * ``mode="absolute"`` (LANTERN): neighbour mass <= ``delta``, i.e. per-test TVD <= delta.
    * ``mode="relative"`` (LANTERN++): neighbour mass <= (``lam`` - 1) * p(x), i.e.
      p~(x) <= lam * p(x).
    * ``mode="group"`` (GSD, So et al. 2025, arXiv 2508.07747): no proximity table; x is credited
      with its dynamic group, the tokens ranked within ``k`` places of x in the target's
      distribution whose probability is close to p(x) (``lantern.decoding.acceptance.group_mask``), and
      the test compares group masses, p(G) / q(G).

    ``delta = 0``, ``lam = 1`` or ``k = 0`` reduce exactly to the exact (lossless) rule.
    ``residual`` chooses what happens after a rejection: ``paper`` continues with the residual of
    the relaxed target ([LANTERN]); ``official`` reproduces the released LlamaGen code and
    ``official-lumina`` the released Lumina-mGPT code, for comparison only.

    ``budget`` says what the bound limits (docs/relaxation_budget.md):

    * ``test`` (the paper's): each acceptance test on its own; a level that tests several
      siblings, or draws them at random, can move its emitted token further than ``delta``.
    * ``token``: the emitted token at every tree level, whatever the siblings:
      TV(emitted, p) <= ``delta``, or emitted(x) <= ``lam`` * p(x) for every x. Each level
      shares one budget among its tests; only ``residual="paper"`` applies.

    ``credit`` says which drafts the relaxed test may credit (``lantern.decoding.acceptance``:
    drawn / clean); every other draft gets the exact test and residual:

    * ``drawn``: every draft a model drew (a Jacobi fill, drawn from no model, is tested exactly).
    * ``clean``: a drawn draft whose context, when it is tested, is the tokens the test conditions
      on, but for the one guess rejected in the round it was drawn, itself a model's draw
      (clean-context credit; tree drafters' drafts always are).
    """

    k: int = 1000
    delta: float = 0.0
    lam: float = 1.0
    mode: RelaxationMode = "absolute"
    residual: ResidualMode = "paper"
    budget: RelaxationBudget = "test"
    credit: RelaxationCredit = "drawn"

    def __post_init__(self) -> None:
        check(isinstance(self.k, int) and not isinstance(self.k, bool) and self.k >= 0,
              f"lantern_k must be an integer >= 0, got {self.k!r}", field="lantern_k")
        check(
            self.mode in ("absolute", "relative", "group"),
            f"relaxation mode must be 'absolute', 'relative' or 'group', got {self.mode!r}",
        )
        check(self.residual in RESIDUALS, f"residual must be one of {', '.join(RESIDUALS)}, got {self.residual!r}",
              field="lantern_residual")
        check(
            self.budget in ("test", "token"),
            f"lantern_budget must be 'test' or 'token', got {self.budget!r}", field="lantern_budget",
        )
        check(
            self.budget == "test" or self.residual == "paper",
            f"the token budget needs residual='paper'; residual={self.residual!r} needs budget='test'",
        )
        for name, value in (("lantern_delta", self.delta), ("lantern_lambda", self.lam)):  # types first, as above
            check(isinstance(value, Real) and not isinstance(value, bool),
                  f"{name} must be a number, got {value!r} ({type(value).__name__})", field=name)
        # jadohu/LANTERN's one --lantern_delta flag meant LANTERN++'s lambda above 1: say where that went
        above = (f" (a value above 1 was LANTERN++'s lambda in jadohu/LANTERN: use method lantern++ with "
                 f"lantern_lambda={self.delta:g})" if math.isfinite(self.delta) and self.delta > 1.0 else "")
        check(
            math.isfinite(self.delta) and 0.0 <= self.delta <= 1.0,
            f"lantern_delta must be in [0, 1], got {self.delta}{above}", field="lantern_delta",
        )
        check(self.credit in CREDITS, f"lantern_credit must be one of {', '.join(CREDITS)}, got {self.credit!r}",
              field="lantern_credit")
        check(math.isfinite(self.lam) and self.lam >= 1.0,
              f"lantern_lambda must be >= 1, got {self.lam}",
              field="lantern_lambda")
        if self.mode != "relative":
            check(self.lam == 1.0, "lantern lambda is only used with mode='relative' (LANTERN++)")
        if self.mode != "absolute":
            check(self.delta == 0.0, "lantern delta is only used with mode='absolute' (LANTERN)")
        if self.mode == "group":  # GSD continues with the exact residual, as its released code
            check(self.residual == "paper", f"the group rule (GSD) has no {self.residual!r} residual")
            check(self.budget == "test", "the group rule (GSD) has no token budget: it bounds no mass")
            check(self.credit == "drawn", "the group rule (GSD) credits every draft with its group: it takes no "
                                          "lantern credit")

    @property
    def is_exact(self) -> bool:
        """True when the relaxation moves no mass: the rule is exact speculative sampling."""
        if self.mode == "group":
            return self.k == 0
        return self.k == 0 or (self.delta == 0.0 if self.mode == "absolute" else self.lam == 1.0)

    @property
    def uses_table(self) -> bool:
        """LANTERN's rules read a latent proximity table; the group rule (GSD) needs none."""
        return self.mode != "group"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


TreeKind = Literal["none", "chain", "static", "dynamic"]


class DynamicTreeSize(TypedDict, total=False):
    """A dynamic tree's size settings (:class:`TreeConfig`'s defaults where absent)."""

    depth: int
    top_k: int
    total_tokens: int


@dataclass(frozen=True)
class TreeConfig:
    """Shape of the draft tree.

    * ``none``: no drafter (plain AR decoding, one token per target forward).
    * ``chain``: ``depth`` drafts in a line (sampled from the drafter).
    * ``static``: an EAGLE-1 tree, children sampled without replacement: a named one of
      :data:`lantern.decoding.trees.STATIC_TREES`, or any shape (``--tree auto``'s pick, a probe
      tree) built with :meth:`from_choices`. The tree's ``choices`` ride in the config itself, so a
      tree is parsed once and no process-wide registry is needed.
    * ``dynamic``: EAGLE-2 tree of ``total_tokens`` drafted nodes chosen by cumulative drafter
      log-probability, expanded ``depth`` times with ``top_k`` children each (deterministic drafts).
    """

    kind: TreeKind = "none"
    name: str = ""
    depth: int = 4
    top_k: int = 10
    total_tokens: int = 58
    # Static trees: each draft's path from the root, as child ranks (EAGLE's ``choices``).
    choices: tuple[tuple[int, ...], ...] = field(default=(), repr=False)

    def __post_init__(self) -> None:
        check(self.kind in ("none", "chain", "static", "dynamic"), f"unknown tree kind {self.kind!r}")
        check(self.depth >= 1, f"tree depth must be >= 1, got {self.depth}")
        check(self.top_k >= 1, f"tree top_k must be >= 1, got {self.top_k}")
        check(self.total_tokens >= 1, f"tree total_tokens must be >= 1, got {self.total_tokens}")
        if self.kind == "static":
            check(bool(self.name), "a static tree needs a name, e.g. 'static:naive_extend_57'")
            if not self.choices:  # a named tree: its choices from the built-in table
                from lantern.decoding.trees import STATIC_TREES

                check(self.name in STATIC_TREES,
                      f"unknown static tree {self.name!r}; known: {', '.join(sorted(STATIC_TREES))}")
                object.__setattr__(self, "choices", tuple(tuple(c) for c in STATIC_TREES[self.name]))
        else:
            check(not self.choices, f"a {self.kind} tree takes no choices")

    @classmethod
    def _from_json(cls, spec: str) -> TreeConfig:
        import json

        from lantern.errors import LanternError

        try:
            choices = json.loads(spec)
            return cls.from_choices(choices, prefix="custom")
        except (ValueError, LanternError) as e:  # (JSONDecodeError is a ValueError)
            raise LanternError(f"--tree {spec[:60]}: expected a JSON list of choices, each a path of child ranks "
                               f"like [[0], [1], [0, 0]] ({e})", field="tree") from None

    @classmethod
    def from_choices(cls, choices: Sequence[Sequence[int]], prefix: str = "auto") -> TreeConfig:
        """A static tree of any shape, named ``PREFIX_<hash of the shape>`` (its ``--tree`` form,
        ``static:PREFIX_<hash>``, is for display and records only: run.json holds the choices)."""
        from lantern.decoding.trees import canonical_choices, tree_hash

        check(isinstance(prefix, str) and prefix.isidentifier(),
              f"tree name prefix must be an identifier, got {prefix!r}")
        nodes = canonical_choices(choices)
        return cls(kind="static", name=f"{prefix}_{tree_hash(nodes)}", choices=nodes)

    @classmethod
    def parse(cls, spec: str, **dynamic: Unpack[DynamicTreeSize]) -> TreeConfig:
        """Parse the CLI form: ``none``, ``dynamic``, ``chain:N`` or ``static:NAME``."""
        from lantern.errors import LanternError

        if not isinstance(spec, str):
            raise LanternError(f"--tree must be a string (none, dynamic, chain:N or static:NAME), got {spec!r} "
                               f"({type(spec).__name__})", field="tree")
        spec = spec.strip()
        if spec.startswith("["):  # a shape as its choices, '[[0], [1], [0, 0]]': what run.json records of --tree auto
            return cls._from_json(spec)
        if spec in ("none", "ar"):
            return cls(kind="none")
        if spec == "dynamic":
            return cls(kind="dynamic", **dynamic)
        if spec.startswith("chain:"):
            try:
                n = int(spec.split(":", 1)[1])
            except ValueError:
                raise LanternError(f"--tree chain:N needs an integer N, got {spec!r}", field="tree") from None
            check(n >= 1, f"--tree chain:N needs N >= 1, got {spec!r}", field="tree")
            return cls(kind="chain", depth=n)
        if spec.startswith("static:"):
            try:
                return cls(kind="static", name=spec.split(":", 1)[1])
            except LanternError as e:  # the flag named: the tree is what the user typed
                raise LanternError(f"--tree {spec}: {e}", field="tree") from None
        raise LanternError(f"--tree must be 'dynamic', 'chain:N' or 'static:NAME' (or 'auto' in generate, bench and "
                           f"Python calls: measured on this device), got {spec!r}", field="tree")

    @property
    def spec(self) -> str:
        """The ``--tree`` form that :meth:`parse` reads back: ``none``, ``dynamic``, ``chain:N``,
        ``static:NAME`` (dynamic's size settings are not part of it)."""
        if self.kind in ("none", "dynamic"):
            return self.kind
        return f"static:{self.name}" if self.kind == "static" else f"chain:{self.depth}"

    @property
    def choices_name(self) -> str:
        """A name unique to a chain or static tree's shape (built-in names are fixed, others end in
        the shape's hash): the key of the drafters' per-process plan caches."""
        check(self.kind in ("chain", "static"), f"a {self.kind} tree has no fixed choices")
        return self.name if self.kind == "static" else f"chain:{self.depth}"

    def fixed_choices(self) -> list[list[int]]:
        """A chain or static tree's choices (a fresh list: safe to mutate)."""
        check(self.kind in ("chain", "static"), f"a {self.kind} tree has no fixed choices")
        if self.kind == "chain":
            from lantern.decoding.trees import chain_choices

            return chain_choices(self.depth)
        return [list(c) for c in self.choices]

    # Sizes, computed here once for every caller (caches, checks, drafters); chains are counted,
    # never built: ``chain:100000``'s choices alone would take tens of GB.
    @cached_property
    def num_nodes(self) -> int:
        """Nodes per verify forward, root included: what a target's cache leaves room for."""
        if self.kind == "none":
            return 1
        if self.kind == "dynamic":
            return self.total_tokens + 1
        return self.depth + 1 if self.kind == "chain" else len(self.choices) + 1

    @cached_property
    def max_depth(self) -> int:
        """Deepest draft below the root (0 for ``none``)."""
        if self.kind == "none":
            return 0
        if self.kind == "dynamic":
            return self.depth + 1  # level 1 from the root, then ``depth`` expansions
        return self.depth if self.kind == "chain" else max(len(c) for c in self.choices)

    @property
    def fed_per_round(self) -> int:
        """Upper bound on the nodes a drafter is fed in one round (its cache's per-round need)."""
        if self.kind == "none":
            return 0
        return self.depth * self.top_k if self.kind == "dynamic" else self.num_nodes

    @property
    def round_nodes(self) -> int:
        """The most nodes one forward of a round holds (the target's verify, or a dynamic drafter's
        feeds): what :data:`MAX_TREE_NODES` bounds."""
        return max(self.num_nodes, self.fed_per_round)

    @property
    def drafter_slots(self) -> int:
        """Drafter cache entries beyond the condition and the image: one accepted path (root
        included), the nodes fed in one round, and the bonus token."""
        return self.max_depth + 1 + self.fed_per_round + 1

    def to_dict(self) -> dict[str, Any]:
        """The fields this kind of tree reads (a chain's record carries no dynamic tree's size)."""
        if self.kind == "none":
            return {"kind": "none"}
        if self.kind == "chain":
            return {"kind": "chain", "depth": self.depth}
        if self.kind == "static":
            return {"kind": "static", "name": self.name, "choices": [list(c) for c in self.choices]}
        return {"kind": "dynamic", "depth": self.depth, "top_k": self.top_k, "total_tokens": self.total_tokens}


# The Jacobi family's settings (SJD and coupled SJD, SJD-PAC, PJD, SJD-SV). They live here, beside
# the other configs and away from the drafters that use them (lantern.decoding.jacobi, pac, pjd,
# subsequence), so that reading a method's settings (lantern.methods, the CLI's parser) imports
# no torch. Each drafter module re-exports its own.

JACOBI_INITS = ("random", "repeat_horizon")
# How a carried guess is redrawn from one iteration to the next: independently (SJD), or coupled
# with the guess it replaces (SCD: ``maximal`` coupling or shared ``gumbel`` noise).
COUPLINGS = ("independent", "maximal", "gumbel")
DEFAULT_WINDOW = 16  # SJD's max_num_new_tokens ([SJD code])


@dataclass(frozen=True)
class JacobiConfig:
    """SJD's window: ``window`` guesses per row; ``init`` fills new window positions.

    * ``random``: a token drawn uniformly from the image vocabulary (SJD's default for
      Lumina-mGPT and Emu3).
    * ``repeat_horizon``: the token one cell to the left in the same image row (SJD's default for
      LlamaGen). At the start of an image row there is no left cell; we copy the token one row up
      instead (always a known token or an earlier guess), since image tokens correlate vertically
      as well as horizontally and the copy costs no randomness.

    ``coupling`` redraws a carried guess (the next iteration's draft at a position that is still
    open) from the new forward's p, either independently (``independent``: SJD) or coupled with the
    guess it replaces (SCD, So et al., arXiv 2510.24211), which keeps every draft's law p and so
    stays lossless but changes far fewer drafts between iterations:

    * ``maximal``: keep the old guess x (drawn from q) with probability min(1, p(x)/q(x)), else
      draw from norm(max(p - q, 0)) (:func:`lantern.decoding.acceptance.maximal_coupling`): the coupling
      that keeps x most often, Pr = 1 - TV(p, q).
    * ``gumbel``: y = argmax(log p + g) with the same Gumbel noise g at a position in every
      iteration (until it is decided), so y only changes where p moved enough to change the argmax.
    """

    window: int = DEFAULT_WINDOW
    init: str = "random"
    coupling: str = "independent"

    def __post_init__(self) -> None:
        check(
            isinstance(self.window, int) and not isinstance(self.window, bool) and self.window >= 1,
            f"--sjd-window must be an integer >= 1, got {self.window!r}", field="sjd_window",
        )
        check_tree_nodes(self.window + 1, f"--sjd-window {self.window}", "sjd_window")  # the root and its guesses
        check(self.init in JACOBI_INITS, f"--sjd-init must be one of {', '.join(JACOBI_INITS)}, got {self.init!r}",
              field="sjd_init")
        check(
            self.coupling in COUPLINGS,
            f"--sjd-coupling must be one of {', '.join(COUPLINGS)}, got {self.coupling!r}", field="sjd_coupling",
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def check_window_fits(config: JacobiConfig, num_tokens: int) -> None:
    """A window as long as the image can never be used in full (after token 0 only N - 1 remain):
    almost surely a wrong ``--sjd-window`` for this image size (mirrors ``check_tree_fits``)."""
    check(
        config.window < num_tokens,
        f"--sjd-window ({config.window}) must be less than the image's {num_tokens} tokens", field="sjd_window",
    )


DEFAULT_PAC_WIDTH = 4  # K, candidates per tree position (README: K = 4, D = 3, "the paper's Tab. 3")
DEFAULT_PAC_DEPTH = 3  # D, the tree's depth counting its root: candidates at the D - 1 positions after it


def pac_tree_nodes(window: int, width: int, depth: int) -> float:
    """Nodes SJD-PAC verifies per round, root included, by arithmetic (the tree is never built):
    the root, the chain of ``window`` guesses, and the full ``width``-ary subtree of ``depth`` - 1
    levels (K + K^2 + ... + K^(D-1)) less its D - 1 first-candidate nodes, which are the chain's.
    A float, so that any K and D cost one power: exact below 2^53, inf past 1e308."""
    levels = depth - 1
    try:
        subtree = float(levels) if width == 1 else width * (float(width) ** levels - 1) / (width - 1)
    except OverflowError:
        return math.inf
    return 1 + window + subtree - min(levels, window)


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@dataclass(frozen=True)
class PACConfig:
    """Proactive drafting's tree (SJD-PAC, ``lantern.decoding.pac``): ``width`` candidates (K) at
    each of the ``depth`` - 1 positions after the root (D counts the root, as the paper's).
    ``width`` 1 or ``depth`` 1: no siblings."""

    width: int = DEFAULT_PAC_WIDTH
    depth: int = DEFAULT_PAC_DEPTH

    def __post_init__(self) -> None:
        # Each alone within the cap (a K or D past it cannot make a tree that fits, but a depth of 1 would
        # hide any width); together they are checked with the window (check_window).
        for flag, value in (("--pac-width", self.width), ("--pac-depth", self.depth)):
            name = flag[2:].replace("-", "_")
            check(_positive_int(value), f"{flag} must be an integer >= 1, got {value!r}", field=name)
            check(value <= MAX_TREE_NODES, f"{flag} must be at most {MAX_TREE_NODES} (the nodes a tree may have), "
                                           f"got {value}", field=name)

    @property
    def levels(self) -> int:
        """Positions after the root that get K candidates."""
        return self.depth - 1

    def check_window(self, window: int) -> None:
        """The subtree fits under ``window``'s chain, and the whole tree within MAX_TREE_NODES:
        checked by arithmetic, before :meth:`choices` builds anything."""
        check(self.levels <= window,
              f"--pac-depth {self.depth} needs a window of at least {self.levels} guesses, got --sjd-window {window}",
              field="pac_depth")
        check_tree_nodes(pac_tree_nodes(window, self.width, self.depth),
                         f"--pac-width {self.width} --pac-depth {self.depth} (--sjd-window {window})",
                         self._to_lower(window))

    def _to_lower(self, window: int) -> str:
        """The setting a too large tree names: the first of K, D and the window whose default
        would make it fit (the one the user raised), else D (the exponent)."""
        for name, nodes in (("pac_width", pac_tree_nodes(window, DEFAULT_PAC_WIDTH, self.depth)),
                            ("pac_depth", pac_tree_nodes(window, self.width, DEFAULT_PAC_DEPTH)),
                            ("sjd_window", pac_tree_nodes(DEFAULT_WINDOW, self.width, self.depth))):
            if nodes <= MAX_TREE_NODES:
                return name
        return "pac_depth"

    def choices(self, window: int) -> tuple[tuple[int, ...], ...]:
        """The tree as child ranks (EAGLE's choices): the chain of ``window`` guesses and the full
        K-ary subtree of D - 1 levels under the root; sorted by depth, then lexicographically."""
        self.check_window(window)
        nodes = {(0,) * d for d in range(1, window + 1)}
        for d in range(1, self.levels + 1):
            nodes.update(itertools.product(range(self.width), repeat=d))
        return tuple(sorted(nodes, key=lambda c: (len(c), c)))

    def tree(self, window: int) -> TreeConfig:
        """What ``sjd-pac`` verifies per round (``MethodConfig.tree``: sizes the target's cache)."""
        return TreeConfig.from_choices(self.choices(window), prefix="sjd_pac")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


DEFAULT_PJD_WINDOW = 4
DEFAULT_PJD_CONTEXT = 8
# How a cell's first guess is made, before any forward predicted it: uniform noise (SJD's
# ``random``), or the token of the cell above (``row_above``: images are 2-D, and a new row's best
# cheap guess is the row it continues), falling back to the cell to the left, then to noise; or
# ``above_mode``: the same neighbours, but the most likely token of the target's last prediction
# for that neighbour instead of the token it holds. A point-mass guess x is accepted with
# probability p(x); were the cell's law the neighbour's law p', guessing a draw from p' would be
# accepted with sum p'^2 <= max p', the mode's chance. (Greedy: the mode is the token, so it is
# ``row_above``.)
PJD_INITS = ("random", "row_above", "above_mode")
# How PJD redraws a carried guess: independently (SJD's rule, the PJD paper's) or with SCD's
# maximal coupling to the guess it replaces (as ``sjd-coupled``). SCD's shared Gumbel noise would
# need a [V] row of noise per image cell (64 MB per image at LlamaGen's 1024 cells x 16384 codes), so
# PJD does not take it.
PJD_COUPLINGS = ("independent", "maximal")


@dataclass(frozen=True)
class PJDConfig:
    """PJD's grid (``lantern.decoding.pjd``): ``window``: drafts per active row and round;
    ``context``: committed tokens row r needs before row r + 1 opens (``context`` >= the row
    length: one row at a time, which is lossless); ``init``: how a cell's first guess is made
    (:data:`PJD_INITS`); ``coupling``: how a carried guess is redrawn (:data:`PJD_COUPLINGS`;
    ``maximal`` keeps the one-row-at-a-time grid lossless, as it keeps SJD's chain)."""

    window: int = DEFAULT_PJD_WINDOW
    context: int = DEFAULT_PJD_CONTEXT
    init: str = "random"
    coupling: str = "independent"

    def __post_init__(self) -> None:
        for flag, value in (("--pjd-window", self.window), ("--pjd-context", self.context)):
            check(isinstance(value, int) and not isinstance(value, bool) and value >= 1,
                  f"{flag} must be an integer >= 1, got {value!r}", field=flag[2:].replace("-", "_"))
        # Each open row's chain: the root and its guesses (the rows' chains together are bounded
        # by the image, as the window is by its row: check_pjd_fits).
        check_tree_nodes(self.window + 1, f"--pjd-window {self.window}", "pjd_window")
        check(self.init in PJD_INITS, f"--pjd-init must be one of {', '.join(PJD_INITS)}, got {self.init!r}",
              field="pjd_init")
        check(self.coupling in PJD_COUPLINGS,
              f"--pjd-coupling must be one of {', '.join(PJD_COUPLINGS)}, got {self.coupling!r}", field="pjd_coupling")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def check_pjd_fits(config: PJDConfig, height: int, width: int) -> None:
    """A window or context longer than an image row can never be used as such."""
    check(config.window <= width, f"--pjd-window ({config.window}) must be at most the image row length ({width})",
          field="pjd_window")
    check(config.context <= width,
          f"--pjd-context ({config.context}) must be at most the image row length ({width}); "
          f"{width} already decodes one row at a time", field="pjd_context")
    check(height >= 1, f"the image needs at least one row, got {height}")


DEFAULT_SV_ALPHA = 0.8  # the paper's confidence proportion threshold (its ablation: 0.5 .. 1.0)


@dataclass(frozen=True)
class SubsequenceConfig:
    """SJD-SV's one setting (``lantern.decoding.subsequence``): ``alpha`` in (0, 1], the share of a
    run's confidence its tested tail holds (1: the whole run, but drafts of probability 0 at its start)."""

    alpha: float = DEFAULT_SV_ALPHA

    def __post_init__(self) -> None:
        value = self.alpha
        check(isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(value) and 0 < value <= 1,
              f"--sv-alpha must be a number in (0, 1] (the paper's 0.8), got {value!r}", field="sv_alpha")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
