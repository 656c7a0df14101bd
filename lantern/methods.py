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
=================  ====================  ==========================================

The SJD methods (``lantern.decoding.jacobi``) load no drafter: ``MethodConfig.jacobi`` holds the window
length, initialisation and coupling (``independent`` for ``sjd*``, ``maximal`` or ``gumbel`` for
``sjd-coupled*`` and ``sjd-pac``), and the relaxed ones read the proximity table like LANTERN.
``sjd-pac`` (``lantern.decoding.pac``) also holds ``MethodConfig.pac`` (the K-ary subtree's width and
depth); its tree is the chain plus that subtree. The PJD methods
(``lantern.decoding.pjd``) hold ``MethodConfig.pjd`` (window, context) instead; their tree is a chain of the
window (each open row's chain), and the loop runs its grid round for them.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from lantern.decoding.config import RESIDUALS, RelaxationConfig, TreeConfig
from lantern.decoding.jacobi import COUPLINGS, JacobiConfig
from lantern.decoding.pac import DEFAULT_PAC_DEPTH, DEFAULT_PAC_WIDTH, PACConfig
from lantern.decoding.pjd import DEFAULT_PJD_CONTEXT, DEFAULT_PJD_WINDOW, PJDConfig
from lantern.errors import LanternError, check, first_given

COUPLED_METHODS = ("sjd-coupled", "sjd-coupled-lantern", "sjd-coupled-lantern++")
PAC_METHODS = ("sjd-pac",)  # SJD-PAC: coupled redraws (AC) and a K-ary subtree (PD); lantern.decoding.pac
SJD_METHODS = ("sjd", "sjd-lantern", "sjd-lantern++", *COUPLED_METHODS, "gsd", *PAC_METHODS)
PJD_METHODS = ("pjd", "pjd-lantern", "pjd-lantern++")
METHODS = ("ar", "sd", "sd-static", "lantern", "lantern++", *SJD_METHODS, *PJD_METHODS)
# Each relaxed method's rule: LANTERN's (absolute delta) or LANTERN++'s (relative lambda), or
# GSD's grouped acceptance.
RELAXED_RULE = {"lantern": "lantern", "lantern++": "lantern++", "sjd-lantern": "lantern", "sjd-lantern++": "lantern++",
                "sjd-coupled-lantern": "lantern", "sjd-coupled-lantern++": "lantern++", "gsd": "gsd",
                "pjd-lantern": "lantern", "pjd-lantern++": "lantern++"}
LANTERN_METHODS = tuple(m for m, rule in RELAXED_RULE.items() if rule != "gsd")  # the ones --lantern-* tunes
DEFAULT_STATIC_TREE = "naive_extend_57"  # LANTERN++'s effective tree for LlamaGen ([LANTERN code])
DEFAULT_LANTERN = RelaxationConfig(k=1000, delta=0.1, mode="absolute")  # [LANTERN code] defaults
DEFAULT_LANTERN_PP = RelaxationConfig(k=10, lam=5.0, mode="relative")  # [LANTERN code] run.sh (k, λ) = (10, 5)
# What the bound limits: each acceptance test (the paper's) or each emitted token
# (docs/relaxation_budget.md). The default was chosen from tau measurements on the photos preset.
BUDGETS = ("test", "token")
DEFAULT_BUDGET = "test"
DEFAULT_JACOBI = JacobiConfig()  # [SJD code]: window 16, random initialisation
# sjd-coupled*: the coupling and initialisation with the highest tau on the photos preset
# (docs/DESIGN.md: 12 images, window 16: maximal 2.73 / gumbel 2.51 with random guesses,
# maximal 3.25 / gumbel 2.85 with repeat_horizon; sjd 2.12 / 2.22).
DEFAULT_COUPLING = "maximal"
DEFAULT_COUPLED_INIT = "repeat_horizon"
# sjd-lantern(++) start from repeat_horizon guesses: tau on photos (16 images, batch 8) 6.38 against
# 5.07 with random ones. (Random guesses once also cost quality, FID 4.89 against AR's 1.17: the
# relaxed test credited noise. Initial guesses are now tested exactly, lantern.decoding.acceptance.)
RELAXED_JACOBI_METHODS = ("sjd-lantern", "sjd-lantern++")
# pjd*: the first guess of a cell (lantern.decoding.pjd.PJD_INITS). tau on photos (16 images, batch 8,
# window 4): pjd 2.56 random / 3.08 row_above, pjd-lantern 3.63 / 3.90, lossless (context 16) 1.66 / 1.81
# (windows running across row ends; 1.46 / 1.68 cut at them). above_mode is not measured yet, so not the default.
DEFAULT_PJD_INIT = "row_above"
DEFAULT_GSD_GROUP = 7  # GSD's released code: the tokens ranked within 7 places of the draft
# The tree ``--tree auto`` answers when speculation loses on the device (and that ``--tree`` takes
# to turn it off): a drafter method with this tree decodes as plain AR.
AR_FALLBACK_TREE = "ar"


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

    def __post_init__(self) -> None:
        check(self.method in METHODS, f"--method must be one of {', '.join(METHODS)}, got {self.method!r}")
        check(
            (self.tree.kind == "none") == (self.method == "ar"),
            f"method {self.method!r} {'takes no' if self.method == 'ar' else 'needs a'} draft tree",
        )
        sjd = self.method in SJD_METHODS
        check(
            (self.jacobi is not None) == sjd,
            f"method {self.method!r} {'needs' if sjd else 'takes no'} Jacobi settings (window, init)",
        )
        pac = self.method in PAC_METHODS
        check((self.pac is not None) == pac,
              f"method {self.method!r} {'needs' if pac else 'takes no'} proactive drafting settings (width, depth)")
        if self.jacobi is not None:  # SJD verifies its window as a chain, so the tree follows from it
            coupled = self.method in COUPLED_METHODS
            check(
                self.method in ("gsd", *PAC_METHODS) or (self.jacobi.coupling != "independent") == coupled,
                f"method {self.method!r} needs coupling {'maximal or gumbel' if coupled else 'independent'}, "
                f"got {self.jacobi.coupling!r}",
            )
            if self.pac is not None:  # the chain plus proactive drafting's subtree
                check(self.tree == self.pac.tree(self.jacobi.window),
                      f"method {self.method!r} needs the SJD-PAC tree of its window, width and depth")
            else:
                chain = TreeConfig(kind="chain", depth=self.jacobi.window)
                check(self.tree == chain, f"method {self.method!r} needs tree chain:{self.jacobi.window} (its window)")
        grid = self.method in PJD_METHODS
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
        sjd_window: int | None = None,
        sjd_init: str | None = None,
        sjd_coupling: str | None = None,
        gsd_group: int | None = None,
        pjd_window: int | None = None,
        pjd_context: int | None = None,
        pjd_init: str | None = None,
        pac_width: int | None = None,
        pac_depth: int | None = None,
    ) -> MethodConfig:
        """Defaults per method (see the module table), with the caller's settings (None: not given),
        named as everywhere (:data:`METHOD_SETTINGS`). ``tree``: a ``--tree`` spec or a TreeConfig
        (``--tree auto``'s pick carries its choices). Library code resolves through
        :func:`resolve_method`, which adds the stack's recommended tree."""
        check(method in METHODS, f"--method must be one of {', '.join(METHODS)}, got {method!r}", field="method")
        k = lantern_k
        check(method in PAC_METHODS or (pac_width is None and pac_depth is None),
              f"--pac-width / --pac-depth need --method {' or '.join(PAC_METHODS)}",
              field=first_given(pac_width=pac_width, pac_depth=pac_depth))
        relaxation = _resolve_relaxation(method, k, lantern_delta, lantern_lambda, lantern_residual, lantern_budget,
                                         gsd_group)
        if method in PJD_METHODS:
            check(tree is None, f"--tree is not used by {method}: it verifies a chain of --pjd-window guesses per row",
                  field="tree")
            check(sjd_window is None and sjd_init is None and sjd_coupling is None,
                  f"--sjd-window / --sjd-init / --sjd-coupling are not used by {method} (it takes --pjd-window, "
                  "--pjd-context)",
                  field=first_given(sjd_window=sjd_window, sjd_init=sjd_init, sjd_coupling=sjd_coupling))
            pjd = PJDConfig(window=DEFAULT_PJD_WINDOW if pjd_window is None else pjd_window,
                            context=DEFAULT_PJD_CONTEXT if pjd_context is None else pjd_context,
                            init=DEFAULT_PJD_INIT if pjd_init is None else pjd_init)
            chain = TreeConfig(kind="chain", depth=pjd.window)
            return cls(method=method, tree=chain, relaxation=relaxation, k_explicit=k is not None, pjd=pjd)
        check(pjd_window is None and pjd_context is None and pjd_init is None,
              f"--pjd-window / --pjd-context / --pjd-init need --method {' or '.join(PJD_METHODS)}",
              field=first_given(pjd_window=pjd_window, pjd_context=pjd_context, pjd_init=pjd_init))
        if method in SJD_METHODS:
            check(tree is None, f"--tree is not used by {method}: it verifies a chain of --sjd-window guesses",
                  field="tree")
            jacobi = JacobiConfig(
                window=DEFAULT_JACOBI.window if sjd_window is None else sjd_window,
                init=sjd_init if sjd_init is not None else _default_init(method),
                coupling=_resolve_coupling(method, sjd_coupling),
            )
            if method in PAC_METHODS:
                pac = PACConfig(width=DEFAULT_PAC_WIDTH if pac_width is None else pac_width,
                                depth=DEFAULT_PAC_DEPTH if pac_depth is None else pac_depth)
                return cls(method=method, tree=pac.tree(jacobi.window), relaxation=relaxation, k_explicit=k is not None,
                           jacobi=jacobi, pac=pac)
            chain = TreeConfig(kind="chain", depth=jacobi.window)
            return cls(method=method, tree=chain, relaxation=relaxation, k_explicit=k is not None, jacobi=jacobi)
        check(sjd_window is None and sjd_init is None,
              f"--sjd-window / --sjd-init need --method {' or '.join(SJD_METHODS)}",
              field=first_given(sjd_window=sjd_window, sjd_init=sjd_init))
        check(sjd_coupling is None,
              f"--sjd-coupling needs --method {' or '.join((*COUPLED_METHODS, 'gsd', *PAC_METHODS))}",
              field="sjd_coupling")
        if method == "ar" or tree == AR_FALLBACK_TREE:  # --tree ar: speculation off (auto's fallback)
            check(method != "ar" or tree in (None, "none", AR_FALLBACK_TREE),
                  "--tree is only used with speculative methods", field="tree")
            return cls(method="ar")
        if isinstance(tree, TreeConfig):
            tree_cfg = tree
        else:
            default_tree = "dynamic" if method in ("sd", "lantern") else f"static:{DEFAULT_STATIC_TREE}"
            tree_cfg = TreeConfig.parse(tree or default_tree)
        return cls(method=method, tree=tree_cfg, relaxation=relaxation, k_explicit=k is not None)

    def to_dict(self) -> dict[str, Any]:
        """As run.json records it (lists, not tuples: equal to the file read back)."""
        return json.loads(json.dumps(asdict(self)))


def _default_init(method: str) -> str:
    if method in COUPLED_METHODS or method in RELAXED_JACOBI_METHODS or method in PAC_METHODS:
        return DEFAULT_COUPLED_INIT
    return DEFAULT_JACOBI.init


def _resolve_coupling(method: str, coupling: str | None) -> str:
    """``sjd-coupled*``: ``--sjd-coupling`` (maximal | gumbel, default DEFAULT_COUPLING); ``gsd``:
    any coupling, independent by default (GSD's own SJD); ``sjd-pac``: any coupling, maximal by
    default (its adaptive continuation; the others for ablations); the other SJD methods redraw
    independently and take no coupling."""
    if method in ("gsd", *PAC_METHODS):
        check(coupling is None or coupling in COUPLINGS,
              f"--sjd-coupling must be one of {', '.join(COUPLINGS)}, got {coupling!r}", field="sjd_coupling")
        if coupling is None:
            return "independent" if method == "gsd" else DEFAULT_COUPLING
        return coupling
    if method not in COUPLED_METHODS:
        takers = " or ".join((*COUPLED_METHODS, "gsd", *PAC_METHODS))
        check(coupling is None, f"--sjd-coupling needs --method {takers}; {method} redraws its guesses independently",
              field="sjd_coupling")
        return "independent"
    choices = [c for c in COUPLINGS if c != "independent"]
    check(coupling is None or coupling in choices,
          f"--sjd-coupling must be one of {', '.join(choices)}, got {coupling!r}", field="sjd_coupling")
    return DEFAULT_COUPLING if coupling is None else coupling


def _resolve_relaxation(
    method: str,
    k: int | None,
    delta: float | None,
    lam: float | None,
    residual: str | None = None,
    budget: str | None = None,
    group: int | None = None,
) -> RelaxationConfig | None:
    """A relaxed method's rule with its defaults and the CLI overrides; None for exact methods."""
    rule = RELAXED_RULE.get(method)
    if rule != "gsd":
        check(group is None, f"--gsd-group needs --method gsd, got --method {method}", field="gsd_group")
    if rule in (None, "gsd"):
        check(
            k is None and delta is None and lam is None and residual is None and budget is None,
            f"--lantern-* options need a relaxed method ({', '.join(LANTERN_METHODS)})",
            field=first_given(lantern_k=k, lantern_delta=delta, lantern_lambda=lam, lantern_residual=residual,
                              lantern_budget=budget),
        )
    if rule is None:
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
    return replace(base, k=base.k if k is None else k, residual=base.residual if residual is None else residual,
                   budget=budget)  # type: ignore[arg-type]


# The method settings, each with one name everywhere: a Python keyword (``pipe(method="lantern",
# lantern_delta=0.2)``, ``MethodConfig.resolve``), the CLI flag (the name with dashes:
# ``--lantern-delta``) and the bench's row grammar (``lantern/lantern_delta=0.2``, or a short alias:
# ``lantern/delta=0.2``, see SETTING_ALIASES).
METHOD_SETTINGS = ("tree", "lantern_k", "lantern_delta", "lantern_lambda", "lantern_residual", "lantern_budget",
                   "sjd_window", "sjd_init", "sjd_coupling", "gsd_group", "pjd_window", "pjd_context", "pjd_init",
                   "pac_width", "pac_depth")
# The bench grammar's short keys. ``window`` and ``init`` are the method's own: sjd_* or pjd_*.
SETTING_ALIASES = {"k": "lantern_k", "delta": "lantern_delta", "lambda": "lantern_lambda",
                   "residual": "lantern_residual", "budget": "lantern_budget",
                   "coupling": "sjd_coupling", "group": "gsd_group", "context": "pjd_context",
                   "width": "pac_width", "depth": "pac_depth"}


def setting_name(method: str, key: str) -> str:
    """The setting a bench-grammar key (a short alias or a full name) stands for in ``method``'s row."""
    if key in ("window", "init"):  # the method's own window and initialisation
        return f"pjd_{key}" if method in PJD_METHODS else f"sjd_{key}"
    name = SETTING_ALIASES.get(key, key)
    check(name in METHOD_SETTINGS, f"unknown method setting {key!r} (expected one of "
                                   f"{', '.join([*METHOD_SETTINGS, 'window', 'init', *SETTING_ALIASES])})")
    return name


def resolve_method(method: str, stack: Any = None, **settings: Any) -> MethodConfig:
    """The one resolver every entrance uses (the API, the CLI, demo, bench, ``--tree auto``):
    ``method`` with ``settings`` (:data:`METHOD_SETTINGS`; None = not given), the tree
    recommended by ``stack`` (its ``generation.json`` "trees"; any object with ``default_tree``)
    when none is given, then the method's defaults."""
    unknown = sorted(set(settings) - set(METHOD_SETTINGS))
    if unknown:
        raise LanternError(f"unknown method setting {unknown[0]!r} (expected one of {', '.join(METHOD_SETTINGS)})",
                           field=unknown[0])
    if settings.get("tree") is None and stack is not None:
        settings["tree"] = stack.default_tree(method)
    return MethodConfig.resolve(method, **settings)
