"""``lantern bench``'s row grammar: ``--methods`` entries (``METHOD@TREE/KEY=VALUE``) as
:class:`MethodSpec` rows, ``--tree METHOD=TREE`` and ``--speed-batch-size 1,4,16``."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from lantern.decoding.config import TreeConfig
from lantern.errors import LanternError, check
from lantern.methods import (
    METHOD_TABLE,
    SETTING_ALIASES,
    MethodConfig,
    method_names,
    resolve_method,
    setting_name,
)

if TYPE_CHECKING:  # for annotations only: lantern.targets imports torch, the grammar needs none
    from lantern.targets.base import Stack

DEFAULT_METHODS = ("ar", "sd", "sd-static", "lantern", "lantern++", "sjd", "sjd-lantern")
DRAFTER_METHODS = method_names(lambda r: r.drafts_a_tree)  # the ones a --tree applies to


@dataclass(frozen=True)
class MethodSpec:
    """One row of the benchmark: a method, its tree and its settings, named as everywhere
    (``lantern.methods.METHOD_SETTINGS``: ``{"lantern_delta": 0.2, "sjd_window": "auto"}``)."""

    method: str
    tree: str | TreeConfig | None = None  # None = the stack's default tree for the method
    settings: Mapping[str, Any] = field(default_factory=dict)
    label: str = ""  # row name; defaults to the method

    @property
    def name(self) -> str:
        return self.label or self.method

    @property
    def window(self) -> int | str | None:
        """The row's Jacobi window (``sjd_window``, or ``pjd_window`` for PJD): a length, "auto" or None."""
        return self.settings.get(setting_name(self.method, "window"))

    def with_settings(self, **settings: Any) -> MethodSpec:
        return replace(self, settings={**self.settings, **settings})

    def resolve(self, stack: Stack | None) -> MethodConfig:
        """Through the one resolver (``resolve_method``); an "auto" window resolves with the
        default until :func:`lantern.eval.bench.resolve_auto_windows` has timed it. ``stack`` None:
        from the settings alone (an "auto" tree too stands as the default), the check that refuses
        a bad row before anything is loaded."""
        settings = {k: None if v == "auto" else v for k, v in self.settings.items()}
        tree = None if stack is None and self.tree == "auto" else self.tree
        return resolve_method(self.method, stack, tree=tree, **settings)


def parse_methods(
    spec: str, trees: Mapping[str, str] | None = None, budget: str | None = None, flag: str = "--methods"
) -> tuple[MethodSpec, ...]:
    """``"ar,sd,lantern++"`` -> specs. ``trees`` maps a method to its tree (``--tree``); an entry
    ``METHOD@TREE`` (e.g. ``lantern++@chain:5``, ``lantern++@auto``) is a row of its own, so one
    run can compare trees for the same method. Method settings follow as ``/KEY=VALUE``, KEY a
    setting's name or short alias (``lantern/lantern_delta=0.2``, ``lantern/delta=0.2/budget=token``,
    ``lantern.methods.SETTING_ALIASES``), as a relaxation's, a Jacobi method's coupling
    (``sjd-coupled/coupling=gumbel``), a Jacobi window (``sjd/window=8``, ``sjd/window=auto``) and initial
    guesses (``sjd-lantern/init=repeat_horizon``), SJD-PAC's subtree (``sjd-pac/width=3/depth=2``), and PJD's
    window and context (``pjd/window=4/context=8``, ``pjd/window=auto``);
    ``budget`` (``--lantern-budget``) is the relaxed rows'
    default budget; ``flag``: the option the errors name (``lantern profile`` reads the grammar from ``--trace``)."""
    trees = trees or {}
    entries = [m.strip() for m in spec.split(",") if m.strip()]
    check(len(entries) > 0, f"{flag} needs a comma-separated list of methods, got {spec!r}")
    out = []
    for entry in entries:
        head, *options = entry.split("/")
        name, _, tree = head.partition("@")
        check(name in METHOD_TABLE, f"{flag}: unknown method {name!r} (choose from {', '.join(METHOD_TABLE)})")
        settings = _row_settings(f"{flag} {entry!r}", name, options, budget)
        if tree:
            check(name in DRAFTER_METHODS, f"{flag} {entry!r}: {name!r} does not draft a tree")
        label = entry if tree or options else ""
        if settings.get("lantern_budget") is not None and "budget=" not in entry:  # rows say which budget they ran
            label = f"{entry}/budget={settings['lantern_budget']}"
        out.append(MethodSpec(name, tree=tree or trees.get(name), settings=settings, label=label))
    return tuple(out)


# How each setting's value is read from the grammar's text.
_VALUE_KINDS: dict[str, Callable[[str], Any]] = {
    "lantern_k": int, "lantern_delta": float, "lantern_lambda": float, "lantern_residual": str, "lantern_credit": str,
    "lantern_budget": str, "sjd_window": lambda text: _window_value(text), "sjd_init": str, "sjd_coupling": str,
    "gsd_group": int, "pjd_window": lambda text: _window_value(text), "pjd_context": int, "pjd_init": str,
    "pjd_coupling": str,
    "pac_width": int, "pac_depth": int, "sv_alpha": float,
}


def _row_settings(where: str, name: str, options: list[str], budget: str | None) -> dict[str, Any]:
    """The ``/KEY=VALUE`` settings of one ``--methods`` entry (``where``: the flag and entry, for
    errors), by their full names; KEY is a full name (``lantern_delta``) or a short alias (``delta``,
    ``lambda``, ``window``: SETTING_ALIASES)."""
    keys = sorted({*SETTING_ALIASES, "window", "init", "coupling", *_VALUE_KINDS})
    tuned = METHOD_TABLE[name].needs_proximity  # the rules --lantern-budget bounds (not GSD's groups)
    out: dict[str, Any] = {"lantern_budget": budget} if tuned and budget is not None else {}
    for option in options:
        key, eq, value = option.partition("=")
        check(eq == "=" and key in keys, f"{where}: expected /KEY=VALUE with KEY one of {', '.join(keys)}, "
                                         f"got {option!r}")
        setting = setting_name(name, key)
        try:
            out[setting] = _VALUE_KINDS[setting](value)
        except ValueError:
            raise LanternError(f"{where}: {key} must be a number, got {value!r}") from None
    return out


def _window_value(text: str) -> int | str:
    return text if text == "auto" else int(text)


def parse_tree_options(values: Sequence[str]) -> dict[str, str]:
    trees: dict[str, str] = {}
    for v in values:
        if v.strip() == "auto":  # every speculative method
            trees.update({m: "auto" for m in DRAFTER_METHODS})
            continue
        check("=" in v, f"--tree takes METHOD=TREE (e.g. lantern++=chain:5), got {v!r}")
        method, tree = (x.strip() for x in v.split("=", 1))
        check(method in DRAFTER_METHODS, f"--tree {v!r}: {method!r} does not draft a tree "
                                          f"(methods with a drafter: {', '.join(DRAFTER_METHODS)})")
        trees[method] = tree
    return trees


def parse_batch_sizes(spec: str | int, flag: str = "--speed-batch-size") -> list[int]:
    """``--speed-batch-size``: one size (latency rows) or a list ``1,4,16`` (the first gives the
    latency rows, the others a throughput table); ``calibrate --batch-sizes`` too. Distinct: a
    size given twice was timed twice, and its calibration was refused when read back."""
    try:
        sizes = [int(x) for x in str(spec).split(",") if x.strip()]
    except ValueError:
        sizes = []
    check(len(sizes) >= 1 and all(b >= 1 for b in sizes) and len(set(sizes)) == len(sizes),
          f"{flag} must be an integer >= 1 or distinct ones like 1,4,16, got {spec!r}")
    return sizes
