"""The decoding methods: names, defaults, and the one resolver from settings to a :class:`MethodConfig`.

A *method* is a configuration of the one loop (``lantern.generate``):

=================  ====================  ==========================================
method             tree                  acceptance
=================  ====================  ==========================================
``ar``             none                  plain sampling
``sd``             dynamic (EAGLE-2)     exact
``sd-static``      naive_extend_57       exact
``lantern``        dynamic (EAGLE-2)     relaxed, absolute delta (LANTERN)
``lantern++``      naive_extend_57       relaxed, relative lambda (LANTERN++)
``sjd``            chain of the window   exact (SJD: the target drafts for itself)
``sjd-lantern``    chain of the window   relaxed, absolute delta
``sjd-lantern++``  chain of the window   relaxed, relative lambda
``sjd-coupled``    chain of the window   exact (SJD with coupled redraws: SCD)
``sjd-coupled-*``  chain of the window   relaxed (``-lantern``: delta, ``-lantern++``: lambda)
``gsd``            chain of the window   grouped (GSD: dynamic groups, no table)
``sjd-pac``        chain + K-ary subtree exact (SJD-PAC: coupled redraws + proactive drafting)
``pjd``            a chain per open row  SJD's rule per row (PJD: 2-D parallel Jacobi; lossy
                                         unless ``--pjd-context`` = the row length)
``pjd-lantern*``   a chain per open row  relaxed (``-lantern``: delta, ``-lantern++``: lambda)
``*-sv``           as the method before  SJD-SV: runs of drafts tested on their high-confidence
                   ``-sv``               tail (relaxed; ``sjd-sv``, ``sjd-coupled-sv``,
                                         ``sjd-lantern-sv``, ``sjd-coupled-lantern-sv``,
                                         ``gsd-sv``)
=================  ====================  ==========================================

What each method is (its family, acceptance rule, whether it is lossless, needs a drafter or the
proximity table, can move rows between batches, and its defaults) is one :class:`MethodRecord` of
:data:`METHOD_TABLE`; every other module asks the record, never a list of names.

The SJD methods (``lantern.decoding.jacobi``) load no drafter: ``MethodConfig.jacobi`` holds the window
length, initialisation and coupling (``independent`` for ``sjd*``, ``maximal`` or ``gumbel`` for
``sjd-coupled*`` and ``sjd-pac``), and the relaxed ones read the proximity table like LANTERN.
``sjd-pac`` (``lantern.decoding.pac``) also holds ``MethodConfig.pac`` (the K-ary subtree's width and
depth); its tree is the chain plus that subtree. The ``-sv`` methods also hold
``MethodConfig.subsequence`` (SJD-SV's alpha, ``lantern.decoding.subsequence``). The PJD methods
(``lantern.decoding.pjd``) hold ``MethodConfig.pjd`` (window, context) instead; their tree is a chain of the
window (each open row's chain), and the loop runs its grid round for them.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, cast

from lantern.decoding.config import (
    COUPLINGS,
    CREDITS,
    DEFAULT_PAC_DEPTH,
    DEFAULT_PAC_WIDTH,
    DEFAULT_PJD_CONTEXT,
    DEFAULT_PJD_WINDOW,
    DEFAULT_SV_ALPHA,
    RESIDUALS,
    JacobiConfig,
    PACConfig,
    PJDConfig,
    RelaxationBudget,
    RelaxationConfig,
    RelaxationCredit,
    ResidualMode,
    SubsequenceConfig,
    TreeConfig,
    check_tree_nodes,
)
from lantern.errors import LanternError, check, first_given

DEFAULT_STATIC_TREE = "naive_extend_57"  # LANTERN++'s effective tree for LlamaGen ([LANTERN code])
DEFAULT_LANTERN = RelaxationConfig(k=1000, delta=0.1, mode="absolute")  # [LANTERN code] defaults
DEFAULT_LANTERN_PP = RelaxationConfig(k=10, lam=5.0, mode="relative")  # [LANTERN code] run.sh (k, λ) = (10, 5)
# What the bound limits: each acceptance test (the paper's) or each emitted token
# (docs/relaxation_budget.md). The default was chosen from tau measurements on the photos preset.
BUDGETS = ("test", "token")
DEFAULT_BUDGET = "test"
# Which drafts the relaxed test credits: drawn ones, or those with a clean context (docs/DESIGN.md, "Acceptance").
DEFAULT_CREDIT = "drawn"
DEFAULT_JACOBI = JacobiConfig()  # [SJD code]: window 16, random initialisation
# sjd-coupled*: the coupling and initialisation with the highest tau on the photos preset
# (docs/DESIGN.md: 12 images, window 16: maximal 2.73 / gumbel 2.51 with random guesses,
# maximal 3.25 / gumbel 2.85 with repeat_horizon; sjd 2.12 / 2.22).
DEFAULT_COUPLING = "maximal"
DEFAULT_COUPLED_INIT = "repeat_horizon"
# pjd*: the first guess of a cell (lantern.decoding.pjd.PJD_INITS). tau on photos (16 images, batch 8,
# window 4): pjd 2.56 random / 3.08 row_above, pjd-lantern 3.63 / 3.90, lossless (context 16) 1.66 / 1.81
# (windows running across row ends; 1.46 / 1.68 cut at them). above_mode is not measured yet, so not the default.
DEFAULT_PJD_INIT = "row_above"
DEFAULT_GSD_GROUP = 7  # GSD's released code: the tokens ranked within 7 places of the draft
# The tree ``--tree auto`` answers when speculation loses on the device (and that ``--tree`` takes
# to turn it off): a drafter method with this tree decodes as plain AR.
AR_FALLBACK_TREE = "ar"

Family = Literal["ar", "eagle", "sjd", "pjd"]
Rule = Literal["exact", "lantern", "lantern++", "gsd"]


@dataclass(frozen=True)
class MethodRecord:
    """What one method is, in one place: everything that asks "which methods ..." (the resolver,
    the CLI's choices, the bench grammar, the server's method list, the docs' tables) reads these
    records instead of keeping a list of names."""

    name: str
    # Who drafts: nobody (ar), a trained EAGLE drafter's tree (eagle), the target itself in a Jacobi
    # window verified as a chain (sjd: MethodConfig.jacobi), one such window per open image row (pjd:
    # MethodConfig.pjd).
    family: Family
    # Acceptance: exact, LANTERN's absolute delta, LANTERN++'s relative lambda, or GSD's groups.
    rule: Rule
    # The target's distribution is kept at the method's default settings (pjd: only when
    # --pjd-context is the row length, not its default).
    lossless: bool
    # A running decode's rows can move between batches (continuous batching). The server decides
    # this from the prepared objects (lantern.decoding.rows.movable: a 2-D grid drafter lists no
    # per-row state); this records the method's answer.
    movable_rows: bool = True
    # --sjd-coupling values the method takes (empty: it redraws independently and takes none), and
    # its default coupling (sjd family only).
    couplings: tuple[str, ...] = ()
    default_coupling: str | None = None
    proactive: bool = False  # sjd-pac: proactive drafting's K-ary subtree beside the window's chain
    default_tree: str | None = None  # eagle family: the tree without --tree or a stack's recommendation
    default_init: str | None = None  # sjd / pjd families: the first guesses (--sjd-init / --pjd-init)
    # Verification by runs of drafts (SJD-SV, lantern.decoding.subsequence) on top of ``rule``:
    # relaxed whatever the rule, so never lossless.
    subsequence: bool = False

    @property
    def needs_drafter(self) -> bool:
        """Needs a trained EAGLE drafter (``drafter/`` of the model folder, or ``--drafter``)."""
        return self.family == "eagle"

    @property
    def needs_proximity(self) -> bool:
        """Reads the latent proximity table (LANTERN's relaxed rules; GSD's groups need none)."""
        return self.rule in ("lantern", "lantern++")

    @property
    def relaxed(self) -> bool:
        return self.rule != "exact" or self.subsequence

    @property
    def drafts_a_tree(self) -> bool:
        """``--tree`` applies (a drafter's tree; the Jacobi families verify a chain of their window)."""
        return self.family == "eagle"

    @property
    def window_setting(self) -> str | None:
        """The setting that holds the method's Jacobi window (``sjd_window`` / ``pjd_window``), if any."""
        return f"{self.family}_window" if self.family in ("sjd", "pjd") else None


def _eagle(name: str, rule: Rule, tree: str) -> MethodRecord:
    return MethodRecord(name, "eagle", rule, lossless=rule == "exact", default_tree=tree)


def _sjd(name: str, rule: Rule, couplings: tuple[str, ...] = (), coupling: str = "independent",
         init: str = DEFAULT_COUPLED_INIT, proactive: bool = False, subsequence: bool = False) -> MethodRecord:
    return MethodRecord(name, "sjd", rule, lossless=rule == "exact" and not subsequence, couplings=couplings,
                        default_coupling=coupling, proactive=proactive, default_init=init, subsequence=subsequence)


def _pjd(name: str, rule: Rule) -> MethodRecord:
    # Lossy at the default context: a token does not see the row above's unfinished part.
    return MethodRecord(name, "pjd", rule, lossless=False, movable_rows=False, default_init=DEFAULT_PJD_INIT)


_COUPLED = tuple(c for c in COUPLINGS if c != "independent")
_DYNAMIC, _STATIC = "dynamic", f"static:{DEFAULT_STATIC_TREE}"
# Every method, in the order the CLI, the docs and the server list them (docs/methods.md).
# Initial guesses: sjd and gsd keep SJD's random ones ([SJD code]); the coupled and relaxed Jacobi
# methods start from repeat_horizon: coupling gains most with them (above), and sjd-lantern(++)'s
# tau on photos (16 images, batch 8) is 6.38 against 5.07 with random ones (random guesses once also
# cost quality, FID 4.89 against AR's 1.17: the relaxed test credited noise; initial guesses are
# now tested exactly, lantern.decoding.acceptance).
METHOD_TABLE: dict[str, MethodRecord] = {r.name: r for r in (
    MethodRecord("ar", "ar", "exact", lossless=True),
    _eagle("sd", "exact", _DYNAMIC),
    _eagle("sd-static", "exact", _STATIC),
    _eagle("lantern", "lantern", _DYNAMIC),
    _eagle("lantern++", "lantern++", _STATIC),
    _sjd("sjd", "exact", init=DEFAULT_JACOBI.init),
    _sjd("sjd-lantern", "lantern"),
    _sjd("sjd-lantern++", "lantern++"),
    _sjd("sjd-coupled", "exact", _COUPLED, DEFAULT_COUPLING),
    _sjd("sjd-coupled-lantern", "lantern", _COUPLED, DEFAULT_COUPLING),
    _sjd("sjd-coupled-lantern++", "lantern++", _COUPLED, DEFAULT_COUPLING),
    _sjd("gsd", "gsd", COUPLINGS, "independent", init=DEFAULT_JACOBI.init),  # GSD's own SJD; any coupling
    # SJD-PAC: coupled redraws (its adaptive continuation; the others for ablations) and a K-ary
    # subtree (proactive drafting); lantern.decoding.pac
    _sjd("sjd-pac", "exact", COUPLINGS, DEFAULT_COUPLING, proactive=True),
    _pjd("pjd", "exact"),
    _pjd("pjd-lantern", "lantern"),
    _pjd("pjd-lantern++", "lantern++"),
    # SJD-SV (arXiv 2609.13245): the paper's SJD-SV, GSD-SV and LANTERN-SV, and coupled SJD with it;
    # each keeps its base method's redraws and first guesses.
    _sjd("sjd-sv", "exact", init=DEFAULT_JACOBI.init, subsequence=True),
    _sjd("sjd-coupled-sv", "exact", _COUPLED, DEFAULT_COUPLING, subsequence=True),
    _sjd("sjd-lantern-sv", "lantern", subsequence=True),
    # Not in the paper: coupled SJD with LANTERN's test and SV's runs. On photos (CPU) it is within
    # AR's spread, and at batch 8 twice AR's images/s where sjd-coupled-lantern makes 1.3-1.6x.
    _sjd("sjd-coupled-lantern-sv", "lantern", _COUPLED, DEFAULT_COUPLING, subsequence=True),
    _sjd("gsd-sv", "gsd", COUPLINGS, "independent", init=DEFAULT_JACOBI.init, subsequence=True),
)}


def method_names(where: Callable[[MethodRecord], bool] = lambda r: True) -> tuple[str, ...]:
    """The names of the methods whose record satisfies ``where``, in the table's order."""
    return tuple(name for name, record in METHOD_TABLE.items() if where(record))


def method_record(method: str) -> MethodRecord:
    """``method``'s record; an unknown name is a :class:`LanternError` about ``--method``."""
    check(method in METHOD_TABLE, f"--method must be one of {', '.join(METHOD_TABLE)}, got {method!r}", field="method")
    return METHOD_TABLE[method]


@dataclass(frozen=True)
class MethodConfig:
    """A decoding method: its tree and acceptance rule, resolved from a name plus overrides."""

    method: str = "ar"
    tree: TreeConfig = field(default_factory=TreeConfig)
    relaxation: RelaxationConfig | None = None
    k_explicit: bool = False  # a default k larger than the proximity table is capped, an explicit one is an error
    jacobi: JacobiConfig | None = None  # SJD methods only: window length and initialisation
    pjd: PJDConfig | None = None  # PJD methods only: window and context
    pac: PACConfig | None = None  # sjd-pac only: proactive drafting's subtree (width K, depth D)
    subsequence: SubsequenceConfig | None = None  # the -sv methods only: SJD-SV's alpha

    @property
    def record(self) -> MethodRecord:
        return METHOD_TABLE[self.method]

    def __post_init__(self) -> None:
        record = method_record(self.method)
        plain = record.family == "ar"
        check(
            (self.tree.kind == "none") == plain,
            f"method {self.method!r} {'takes no' if plain else 'needs a'} draft tree",
        )
        sjd = record.family == "sjd"
        check(
            (self.jacobi is not None) == sjd,
            f"method {self.method!r} {'needs' if sjd else 'takes no'} Jacobi settings (window, init)",
        )
        check((self.subsequence is not None) == record.subsequence,
              f"method {self.method!r} {'needs' if record.subsequence else 'takes no'} subsequence verification "
              "settings (alpha)")
        check((self.pac is not None) == record.proactive,
              f"method {self.method!r} {'needs' if record.proactive else 'takes no'} proactive drafting settings "
              "(width, depth)")
        if self.jacobi is not None:  # SJD verifies its window as a chain, so the tree follows from it
            allowed = record.couplings or ("independent",)
            check(
                self.jacobi.coupling in allowed,
                f"method {self.method!r} needs coupling {' or '.join(allowed)}, got {self.jacobi.coupling!r}",
            )
            if self.pac is not None:  # the chain plus proactive drafting's subtree
                check(self.tree == self.pac.tree(self.jacobi.window),
                      f"method {self.method!r} needs the SJD-PAC tree of its window, width and depth")
            else:
                chain = TreeConfig(kind="chain", depth=self.jacobi.window)
                check(self.tree == chain, f"method {self.method!r} needs tree chain:{self.jacobi.window} (its window)")
        if record.drafts_a_tree:  # a drafter's tree; the Jacobi windows are bounded by their own configs
            check_tree_nodes(self.tree.round_nodes, f"--tree {self.tree.spec}", "tree")
        grid = record.family == "pjd"
        check((self.pjd is not None) == grid,
              f"method {self.method!r} {'needs' if grid else 'takes no'} PJD settings (window, context)")
        if self.pjd is not None:  # each open row's window is verified as a chain
            chain = TreeConfig(kind="chain", depth=self.pjd.window)
            check(self.tree == chain, f"method {self.method!r} needs tree chain:{self.pjd.window} (its window)")

    @classmethod
    def resolve(
        cls,
        method: str,
        *,
        tree: str | TreeConfig | None = None,
        lantern_k: int | None = None,
        lantern_delta: float | None = None,
        lantern_lambda: float | None = None,
        lantern_residual: str | None = None,
        lantern_budget: str | None = None,
        lantern_credit: str | None = None,
        sjd_window: int | None = None,
        sjd_init: str | None = None,
        sjd_coupling: str | None = None,
        gsd_group: int | None = None,
        pjd_window: int | None = None,
        pjd_context: int | None = None,
        pjd_init: str | None = None,
        pjd_coupling: str | None = None,
        pac_width: int | None = None,
        pac_depth: int | None = None,
        sv_alpha: float | None = None,
    ) -> MethodConfig:
        """Defaults per method (see the module table), with the caller's settings (None: not given),
        named as everywhere (:data:`METHOD_SETTINGS`). ``tree``: a ``--tree`` spec or a TreeConfig
        (``--tree auto``'s pick carries its choices). Library code resolves through
        :func:`resolve_method`, which adds the stack's recommended tree."""
        record = method_record(method)
        k = lantern_k
        check(record.proactive or (pac_width is None and pac_depth is None),
              f"--pac-width / --pac-depth need --method {' or '.join(method_names(lambda r: r.proactive))}",
              field=first_given(pac_width=pac_width, pac_depth=pac_depth))
        relaxation = _resolve_relaxation(method, k, lantern_delta, lantern_lambda, lantern_residual, lantern_budget,
                                         gsd_group, lantern_credit)
        subsequence = _resolve_subsequence(record, sv_alpha)
        if record.family == "pjd":
            check(tree is None, f"--tree is not used by {method}: it verifies a chain of --pjd-window guesses per row",
                  field="tree")
            check(sjd_window is None and sjd_init is None and sjd_coupling is None,
                  f"--sjd-window / --sjd-init / --sjd-coupling are not used by {method} (it takes --pjd-window, "
                  "--pjd-context, --pjd-init, --pjd-coupling)",
                  field=first_given(sjd_window=sjd_window, sjd_init=sjd_init, sjd_coupling=sjd_coupling))
            pjd = PJDConfig(window=DEFAULT_PJD_WINDOW if pjd_window is None else pjd_window,
                            context=DEFAULT_PJD_CONTEXT if pjd_context is None else pjd_context,
                            init=first_set(pjd_init, record.default_init),
                            coupling="independent" if pjd_coupling is None else pjd_coupling)
            chain = TreeConfig(kind="chain", depth=pjd.window)
            return cls(method=method, tree=chain, relaxation=relaxation, k_explicit=k is not None, pjd=pjd)
        check(pjd_window is None and pjd_context is None and pjd_init is None and pjd_coupling is None,
              f"--pjd-window / --pjd-context / --pjd-init / --pjd-coupling need --method "
              f"{' or '.join(family_methods('pjd'))}",
              field=first_given(pjd_window=pjd_window, pjd_context=pjd_context, pjd_init=pjd_init,
                                pjd_coupling=pjd_coupling))
        if record.family == "sjd":
            check(tree is None, f"--tree is not used by {method}: it verifies a chain of --sjd-window guesses",
                  field="tree")
            jacobi = JacobiConfig(
                window=DEFAULT_JACOBI.window if sjd_window is None else sjd_window,
                init=first_set(sjd_init, record.default_init),
                coupling=_resolve_coupling(record, sjd_coupling),
            )
            if record.proactive:
                pac = PACConfig(width=DEFAULT_PAC_WIDTH if pac_width is None else pac_width,
                                depth=DEFAULT_PAC_DEPTH if pac_depth is None else pac_depth)
                return cls(method=method, tree=pac.tree(jacobi.window), relaxation=relaxation, k_explicit=k is not None,
                           jacobi=jacobi, pac=pac)
            chain = TreeConfig(kind="chain", depth=jacobi.window)
            return cls(method=method, tree=chain, relaxation=relaxation, k_explicit=k is not None, jacobi=jacobi,
                       subsequence=subsequence)
        check(sjd_window is None and sjd_init is None,
              f"--sjd-window / --sjd-init need --method {' or '.join(family_methods('sjd'))}",
              field=first_given(sjd_window=sjd_window, sjd_init=sjd_init))
        check(sjd_coupling is None,
              f"--sjd-coupling needs --method {' or '.join(_coupling_takers())}",
              field="sjd_coupling")
        plain = record.family == "ar"
        if plain or tree == AR_FALLBACK_TREE:  # --tree ar: speculation off (auto's fallback)
            check(not plain or tree in (None, "none", AR_FALLBACK_TREE),
                  "--tree is only used with speculative methods", field="tree")
            return cls(method="ar")
        if isinstance(tree, TreeConfig):
            tree_cfg = tree
        elif isinstance(tree, list | tuple):  # a shape as its choices (a tree="auto" run's settings record it so)
            tree_cfg = _tree_of_choices(tree)
        else:
            tree_cfg = TreeConfig.parse(tree or str(record.default_tree))
        return cls(method=method, tree=tree_cfg, relaxation=relaxation, k_explicit=k is not None)

    def to_dict(self) -> dict[str, Any]:
        """As run.json records it (lists, not tuples: equal to the file read back)."""
        return json.loads(json.dumps({**asdict(self), "tree": self.tree.to_dict()}))


def first_set(value: str | None, default: str | None) -> str:
    """A setting as given, else the method's default (every method that takes it has one)."""
    return str(default) if value is None else value


def family_methods(family: Family) -> tuple[str, ...]:
    """The methods of one family (``"sjd"``: the Jacobi methods, ``"pjd"``: the 2-D ones, ...)."""
    return method_names(lambda r: r.family == family)


def _coupling_takers() -> tuple[str, ...]:
    return method_names(lambda r: bool(r.couplings))


def _resolve_coupling(record: MethodRecord, coupling: str | None) -> str:
    """``--sjd-coupling``: one of the method's couplings (``sjd-coupled*``: maximal | gumbel; ``gsd``
    and ``sjd-pac``: any, for ablations), else its default; the other SJD methods redraw
    independently and take none."""
    if not record.couplings:
        takers = " or ".join(_coupling_takers())
        check(coupling is None,
              f"--sjd-coupling needs --method {takers}; {record.name} redraws its guesses independently",
              field="sjd_coupling")
        return "independent"
    check(coupling is None or coupling in record.couplings,
          f"--sjd-coupling must be one of {', '.join(record.couplings)}, got {coupling!r}", field="sjd_coupling")
    return first_set(coupling, record.default_coupling)


def _resolve_subsequence(record: MethodRecord, alpha: float | None) -> SubsequenceConfig | None:
    """SJD-SV's settings for the ``-sv`` methods (the paper's alpha unless given); None for the others."""
    check(record.subsequence or alpha is None,
          f"--sv-alpha needs --method {' or '.join(method_names(lambda r: r.subsequence))}, got --method "
          f"{record.name}", field="sv_alpha")
    if not record.subsequence:
        return None
    return SubsequenceConfig(alpha=DEFAULT_SV_ALPHA if alpha is None else alpha)


def _resolve_relaxation(
    method: str,
    k: int | None,
    delta: float | None,
    lam: float | None,
    residual: str | None = None,
    budget: str | None = None,
    group: int | None = None,
    credit: str | None = None,
) -> RelaxationConfig | None:
    """A relaxed method's rule with its defaults and the CLI overrides; None for exact methods."""
    rule = method_record(method).rule
    if rule != "gsd":
        check(group is None, f"--gsd-group needs --method gsd, got --method {method}", field="gsd_group")
    if rule in ("exact", "gsd"):
        given = first_given(lantern_k=k, lantern_delta=delta, lantern_lambda=lam, lantern_residual=residual,
                            lantern_budget=budget, lantern_credit=credit)
        check(given is None, f"--{str(given).replace('_', '-')} needs a relaxed method "  # (the option given, named)
                             f"({', '.join(method_names(lambda r: r.needs_proximity))}), got --method {method}",
              field=given)
    if rule == "exact":
        return None
    if rule == "gsd":
        check(group is None or (isinstance(group, int) and not isinstance(group, bool) and group >= 1),
              f"--gsd-group must be an integer >= 1, got {group!r}", field="gsd_group")
        return RelaxationConfig(k=DEFAULT_GSD_GROUP if group is None else group, mode="group")
    check(budget in (None, *BUDGETS), f"--lantern-budget must be one of {', '.join(BUDGETS)}, got {budget!r}",
          field="lantern_budget")
    budget = DEFAULT_BUDGET if budget is None else budget
    if rule == "lantern":  # absolute bound; the relative-bound twin of method X is X++
        check(lam is None, f"--lantern-lambda belongs to {method}++ (relative bound); {method} uses --lantern-delta",
              field="lantern_lambda")
        base = replace(DEFAULT_LANTERN, delta=DEFAULT_LANTERN.delta if delta is None else delta)
    else:
        twin = method.removesuffix("++")
        check(delta is None, f"--lantern-delta belongs to {twin} (absolute bound); {method} uses --lantern-lambda",
              field="lantern_delta")
        base = replace(DEFAULT_LANTERN_PP, lam=DEFAULT_LANTERN_PP.lam if lam is None else lam)
    check(residual is None or residual in RESIDUALS,
          f"--lantern-residual must be one of {', '.join(RESIDUALS)}, got {residual!r}", field="lantern_residual")
    check(credit in (None, *CREDITS), f"--lantern-credit must be one of {', '.join(CREDITS)}, got {credit!r}",
          field="lantern_credit")
    # (the strings are checked above against the Literals' values)
    return replace(base, k=base.k if k is None else k,
                   residual=base.residual if residual is None else cast(ResidualMode, residual),
                   budget=cast(RelaxationBudget, budget),
                   credit=cast(RelaxationCredit, DEFAULT_CREDIT if credit is None else credit))


# The method settings, each with one name everywhere: a Python keyword (``pipe(method="lantern",
# lantern_delta=0.2)``, ``MethodConfig.resolve``), the CLI flag (the name with dashes:
# ``--lantern-delta``) and the bench's row grammar (``lantern/lantern_delta=0.2``, or a short alias:
# ``lantern/delta=0.2``, see SETTING_ALIASES).
METHOD_SETTINGS = ("tree", "lantern_k", "lantern_delta", "lantern_lambda", "lantern_residual", "lantern_budget",
                   "lantern_credit", "sjd_window", "sjd_init", "sjd_coupling", "gsd_group", "pjd_window", "pjd_context",
                   "pjd_init", "pjd_coupling", "pac_width", "pac_depth", "sv_alpha")
# The bench grammar's short keys. ``window``, ``init`` and ``coupling`` are the method's own: sjd_* or pjd_*.
SETTING_ALIASES = {"k": "lantern_k", "delta": "lantern_delta", "lambda": "lantern_lambda",
                   "residual": "lantern_residual", "budget": "lantern_budget", "credit": "lantern_credit",
                   "group": "gsd_group", "context": "pjd_context",
                   "width": "pac_width", "depth": "pac_depth", "alpha": "sv_alpha"}


def setting_name(method: str, key: str) -> str:
    """The setting a bench-grammar key (a short alias or a full name) stands for in ``method``'s row."""
    if key in ("window", "init", "coupling"):  # the method's own window, initialisation and coupling
        record = METHOD_TABLE.get(method)
        return f"pjd_{key}" if record is not None and record.family == "pjd" else f"sjd_{key}"
    name = SETTING_ALIASES.get(key, key)
    check(name in METHOD_SETTINGS, f"unknown method setting {key!r} (expected one of "
                                   f"{', '.join([*METHOD_SETTINGS, 'window', 'init', 'coupling', *SETTING_ALIASES])})")
    return name


def recommended_tree(stack: Any, method: str) -> str | None:
    """``stack``'s recommended tree for ``method``, its ``generation.json`` read once: every method
    it names a tree for must be a method, since a misspelt one ("lanter++") would leave the method it
    meant on its default tree, silently. (Checked here, where methods are known; the targets layer
    below checks the file's structure.) A stack without a folder's trees answers ``default_tree``."""
    read, root = getattr(stack, "default_trees", None), getattr(stack, "root", None)
    if read is None or root is None:
        return stack.default_tree(method)
    from lantern.targets.base import GENERATION_FILE

    trees = read()
    unknown = [name for name in trees if name not in METHOD_TABLE]
    check(not unknown, f"{Path(root) / GENERATION_FILE}: trees.{unknown[0] if unknown else ''}: not a method "
                       f"(expected one of {', '.join(METHOD_TABLE)})")
    return trees.get(method)


def _tree_of_choices(choices: Sequence[Any]) -> TreeConfig:
    """``tree=[[0], [1], [0, 0]]``: a static tree of that shape (EAGLE's ``choices``: each draft's
    path of child ranks), checked as :meth:`TreeConfig.from_choices` checks it, the setting named."""
    try:
        return TreeConfig.from_choices([list(c) if isinstance(c, list | tuple) else c for c in choices],
                                       prefix="custom")
    except LanternError as e:
        raise LanternError(f"tree: {e}", field="tree") from None


def tree_setting(tree: TreeConfig) -> str | list[list[int]]:
    """A tree as a call takes it back: its ``--tree`` form, or, for a shape no name spells (what
    ``tree="auto"`` may choose), its choices."""
    from lantern.decoding.trees import STATIC_TREES  # (imports torch: not at the command line's start)

    if tree.kind == "static" and tree.name not in STATIC_TREES:
        return [list(c) for c in tree.choices]
    return tree.spec


def method_settings(method: MethodConfig) -> dict[str, Any]:
    """A resolved method's settings under their request names (those it uses and a request may set,
    defaults filled in). The tree is a setting of the drafter methods only: the Jacobi and PJD
    methods verify a chain of their window, SJD-PAC a tree of its width and depth."""
    drafted = METHOD_TABLE[method.method].family == "eagle"
    out: dict[str, Any] = {"tree": tree_setting(method.tree)} if drafted and method.tree.kind != "none" else {}
    relaxation = method.relaxation
    if relaxation is not None and relaxation.mode == "group":
        out["gsd_group"] = relaxation.k
    elif relaxation is not None:
        bound = {"lantern_delta": relaxation.delta} if relaxation.mode == "absolute" else {
            "lantern_lambda": relaxation.lam}
        out.update(lantern_k=relaxation.k, **bound, lantern_residual=relaxation.residual,
                   lantern_budget=relaxation.budget, lantern_credit=relaxation.credit)
    if method.jacobi is not None:
        out.update(sjd_window=method.jacobi.window, sjd_init=method.jacobi.init)
        if METHOD_TABLE[method.method].couplings:  # the others redraw independently and take no setting
            out["sjd_coupling"] = method.jacobi.coupling
    if method.pjd is not None:
        out.update(pjd_window=method.pjd.window, pjd_context=method.pjd.context, pjd_init=method.pjd.init,
                   pjd_coupling=method.pjd.coupling)
    if method.pac is not None:
        out.update(pac_width=method.pac.width, pac_depth=method.pac.depth)
    if method.subsequence is not None:
        out["sv_alpha"] = method.subsequence.alpha
    return out


def resolve_method(method: str, stack: Any = None, **settings: Any) -> MethodConfig:
    """The one resolver every entrance uses (the API, the CLI, demo, bench, ``--tree auto``):
    ``method`` with ``settings`` (:data:`METHOD_SETTINGS`; None = not given), the tree
    recommended by ``stack`` (its ``generation.json`` "trees"; any object with ``default_tree``)
    when none is given, then the method's defaults."""
    unknown = sorted(set(settings) - set(METHOD_SETTINGS))
    if unknown:
        raise LanternError(f"unknown method setting {unknown[0]!r} (expected one of {', '.join(METHOD_SETTINGS)})",
                           field=unknown[0])
    if stack is not None:
        recommended = recommended_tree(stack, method)  # (checks the file's trees even when one is given)
        if settings.get("tree") is None:
            settings["tree"] = recommended
    return MethodConfig.resolve(method, **settings)
