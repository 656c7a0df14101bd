"""``lantern bench``'s row grammar: ``--methods`` entries (``METHOD@TREE/KEY=VALUE``) as
:class:`MethodSpec` rows, ``--tree METHOD=TREE`` and ``--speed-batch-size 1,4,16``."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lantern.errors import LanternError, check
from lantern.methods import LANTERN_METHODS, METHODS, SJD_METHODS, MethodConfig
from lantern.targets.base import Stack

DEFAULT_METHODS = ("ar", "sd", "sd-static", "lantern", "lantern++", "sjd", "sjd-lantern")
DRAFTER_METHODS = ("sd", "sd-static", "lantern", "lantern++")  # the ones a --tree applies to


@dataclass(frozen=True)
class MethodSpec:
    """One row of the benchmark: a method name, its tree and relaxation overrides."""

    method: str
    tree: str | None = None  # None = the stack's default tree for the method
    k: int | None = None
    delta: float | None = None
    lam: float | None = None
    label: str = ""  # row name; defaults to the method
    budget: str | None = None  # relaxed methods: "test" | "token" (None: the default)
    coupling: str | None = None  # sjd-coupled*, gsd: --sjd-coupling (None: the default)
    window: int | str | None = None  # sjd*, gsd: --sjd-window; pjd*: --pjd-window (None: default; "auto": timed)
    context: int | None = None  # pjd*: --pjd-context (None: the default)
    init: str | None = None  # sjd*, gsd: --sjd-init (None: the method's default)

    @property
    def name(self) -> str:
        return self.label or self.method

    def resolve(self, stack: Stack) -> MethodConfig:
        tree = self.tree if self.tree is not None else stack.default_tree(self.method)
        window = None if self.window == "auto" else self.window  # auto: the default, until resolve_auto_windows
        sjd = self.method in SJD_METHODS
        return MethodConfig.resolve(self.method, tree, self.k, self.delta, self.lam, budget=self.budget,
                                    coupling=self.coupling, window=window if sjd else None, init=self.init,
                                    pjd_window=None if sjd else window, pjd_context=self.context)


def parse_methods(
    spec: str, trees: Mapping[str, str] | None = None, budget: str | None = None
) -> tuple[MethodSpec, ...]:
    """``"ar,sd,lantern++"`` -> specs. ``trees`` maps a method to its tree (``--tree``); an entry
    ``METHOD@TREE`` (e.g. ``lantern++@chain:5``, ``lantern++@auto``) is a row of its own, so one
    run can compare trees for the same method. Relaxation settings follow as ``/KEY=VALUE``
    (``lantern/delta=0.2/budget=token``), and so does a Jacobi method's coupling
    (``sjd-coupled/coupling=gumbel``), a Jacobi window (``sjd/window=8``, ``sjd/window=auto``) and initial
    guesses (``sjd-lantern/init=repeat_horizon``), and PJD's
    window and context (``pjd/window=4/context=8``, ``pjd/window=auto``);
    ``budget`` (``--lantern-budget``) is the relaxed rows'
    default budget."""
    trees = trees or {}
    entries = [m.strip() for m in spec.split(",") if m.strip()]
    check(len(entries) > 0, f"--methods needs a comma-separated list of methods, got {spec!r}")
    out = []
    for entry in entries:
        head, *options = entry.split("/")
        name, _, tree = head.partition("@")
        check(name in METHODS, f"--methods: unknown method {name!r} (choose from {', '.join(METHODS)})")
        settings = _row_settings(entry, name, options, budget)
        if tree:
            check(name in DRAFTER_METHODS, f"--methods {entry!r}: {name!r} does not draft a tree")
        label = entry if tree or options else ""
        if settings["budget"] is not None and "budget=" not in entry:  # rows say which budget they ran
            label = f"{entry}/budget={settings['budget']}"
        out.append(MethodSpec(name, tree=tree or trees.get(name), label=label, **settings))
    return tuple(out)


def _row_settings(entry: str, name: str, options: list[str], budget: str | None) -> dict[str, Any]:
    """The ``/KEY=VALUE`` relaxation settings of one ``--methods`` entry as MethodSpec fields."""
    kinds: dict[str, Callable[[str], Any]] = {"k": int, "delta": float, "lambda": float, "budget": str,
                                              "coupling": str, "window": _window_value, "context": int,
                                              "init": str}
    out: dict[str, Any] = {"budget": budget if name in LANTERN_METHODS else None}
    for option in options:
        key, eq, value = option.partition("=")
        check(eq == "=" and key in kinds, f"--methods {entry!r}: expected /KEY=VALUE with KEY one of "
                                          f"{', '.join(kinds)}, got {option!r}")
        try:
            out["lam" if key == "lambda" else key] = kinds[key](value)
        except ValueError:
            raise LanternError(f"--methods {entry!r}: {key} must be a number, got {value!r}") from None
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


def parse_batch_sizes(spec: str | int) -> list[int]:
    """``--speed-batch-size``: one size (latency rows) or a list ``1,4,16`` (the first gives the
    latency rows, the others a throughput table)."""
    try:
        sizes = [int(x) for x in str(spec).split(",") if x.strip()]
    except ValueError:
        sizes = []
    check(len(sizes) >= 1 and all(b >= 1 for b in sizes),
          f"--speed-batch-size must be an integer >= 1 or a list like 1,4,16, got {spec!r}")
    return sizes
