"""The one table of methods (``lantern.methods.METHOD_TABLE``): its records say what each method
is, the resolver's defaults follow them, the run-time answer to "can rows move" agrees with them,
and the CLI, the server and the docs list exactly its methods."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

import lantern
from lantern.api import resolve_settings
from lantern.cli.main import build_parser
from lantern.decoding.config import TreeConfig
from lantern.decoding.rows import movable
from lantern.errors import LanternError
from lantern.methods import (
    METHOD_TABLE,
    MethodConfig,
    MethodRecord,
    family_methods,
    method_names,
    method_record,
)
from lantern.run import prepare_method

ROOT = Path(__file__).resolve().parents[1]
ALL = ("ar", "sd", "sd-static", "lantern", "lantern++", "sjd", "sjd-lantern", "sjd-lantern++", "sjd-coupled",
       "sjd-coupled-lantern", "sjd-coupled-lantern++", "gsd", "sjd-pac", "pjd", "pjd-lantern", "pjd-lantern++",
       "sjd-sv", "sjd-coupled-sv", "sjd-lantern-sv", "sjd-coupled-lantern-sv", "gsd-sv")


def test_the_table_holds_what_each_method_is() -> None:
    """Pinned by hand, so a changed record shows up here (these sets were nine loose tuples)."""
    assert tuple(METHOD_TABLE) == ALL and all(r.name == n for n, r in METHOD_TABLE.items())
    assert method_names(lambda r: r.needs_drafter) == ("sd", "sd-static", "lantern", "lantern++")
    assert family_methods("sjd") == ("sjd", "sjd-lantern", "sjd-lantern++", "sjd-coupled", "sjd-coupled-lantern",
                                     "sjd-coupled-lantern++", "gsd", "sjd-pac", "sjd-sv", "sjd-coupled-sv",
                                     "sjd-lantern-sv", "sjd-coupled-lantern-sv", "gsd-sv")
    assert family_methods("pjd") == ("pjd", "pjd-lantern", "pjd-lantern++")
    assert method_names(lambda r: r.lossless) == ("ar", "sd", "sd-static", "sjd", "sjd-coupled", "sjd-pac")
    assert method_names(lambda r: r.needs_proximity) == ("lantern", "lantern++", "sjd-lantern", "sjd-lantern++",
                                                         "sjd-coupled-lantern", "sjd-coupled-lantern++",
                                                         "pjd-lantern", "pjd-lantern++", "sjd-lantern-sv",
                                                         "sjd-coupled-lantern-sv")
    assert method_names(lambda r: r.rule == "gsd") == ("gsd", "gsd-sv")
    assert method_names(lambda r: not r.movable_rows) == ("pjd", "pjd-lantern", "pjd-lantern++")
    assert method_names(lambda r: bool(r.couplings)) == ("sjd-coupled", "sjd-coupled-lantern",
                                                         "sjd-coupled-lantern++", "gsd", "sjd-pac", "sjd-coupled-sv",
                                                         "sjd-coupled-lantern-sv", "gsd-sv")
    assert method_names(lambda r: r.proactive) == ("sjd-pac",)
    assert method_names(lambda r: r.subsequence) == ("sjd-sv", "sjd-coupled-sv", "sjd-lantern-sv",
                                                     "sjd-coupled-lantern-sv", "gsd-sv")


def test_a_record_is_frozen_and_an_unknown_name_names_its_field() -> None:
    with pytest.raises(AttributeError):
        METHOD_TABLE["ar"].lossless = False  # type: ignore[misc]
    with pytest.raises(LanternError, match="--method must be one of ar, sd, .*got 'nope'") as err:
        method_record("nope")
    assert err.value.field == "method"


@pytest.mark.parametrize("name", ALL)
def test_resolved_defaults_follow_the_record(name: str) -> None:
    record = METHOD_TABLE[name]
    cfg = MethodConfig.resolve(name)
    assert cfg.record is record
    assert (cfg.relaxation is None) == (record.rule == "exact")
    assert (cfg.jacobi is not None) == (record.family == "sjd") and (cfg.pjd is not None) == (record.family == "pjd")
    assert (cfg.pac is not None) == record.proactive
    if record.family == "eagle":
        assert cfg.tree == TreeConfig.parse(str(record.default_tree))
    if cfg.jacobi is not None:
        assert (cfg.jacobi.init, cfg.jacobi.coupling) == (record.default_init, record.default_coupling)
    if cfg.pjd is not None:
        assert cfg.pjd.init == record.default_init


def test_defaults_pinned_for_a_few_methods() -> None:
    """The values the table replaced (methods.py's tuples and the resolver's branches)."""
    assert MethodConfig.resolve("sd").tree.kind == "dynamic" and MethodConfig.resolve("lantern").tree.kind == "dynamic"
    assert MethodConfig.resolve("lantern++").tree == TreeConfig.parse("static:naive_extend_57")
    assert MethodConfig.resolve("sd-static").tree == TreeConfig.parse("static:naive_extend_57")
    inits = {m: MethodConfig.resolve(m).jacobi.init for m in family_methods("sjd")}  # type: ignore[union-attr]
    random = ("sjd", "gsd", "sjd-sv", "gsd-sv")
    assert inits == {m: "random" if m in random else "repeat_horizon" for m in family_methods("sjd")}
    couplings = {m: MethodConfig.resolve(m).jacobi.coupling for m in family_methods("sjd")}  # type: ignore[union-attr]
    assert couplings == {"sjd": "independent", "sjd-lantern": "independent", "sjd-lantern++": "independent",
                         "sjd-coupled": "maximal", "sjd-coupled-lantern": "maximal",
                         "sjd-coupled-lantern++": "maximal", "gsd": "independent", "sjd-pac": "maximal",
                         "sjd-sv": "independent", "sjd-coupled-sv": "maximal", "sjd-lantern-sv": "independent",
                         "sjd-coupled-lantern-sv": "maximal", "gsd-sv": "independent"}
    assert MethodConfig.resolve("pjd").pjd.init == "row_above"  # type: ignore[union-attr]


def test_coupling_refusals_read_the_record() -> None:
    takers = ("sjd-coupled or sjd-coupled-lantern or sjd-coupled-lantern++ or gsd or sjd-pac or sjd-coupled-sv or "
              "sjd-coupled-lantern-sv or gsd-sv")
    with pytest.raises(LanternError, match=f"--sjd-coupling needs --method {re.escape(takers)}; sjd redraws"):
        MethodConfig.resolve("sjd", sjd_coupling="maximal")
    with pytest.raises(LanternError, match="--sjd-coupling must be one of maximal, gumbel, got 'independent'"):
        MethodConfig.resolve("sjd-coupled", sjd_coupling="independent")
    assert MethodConfig.resolve("gsd", sjd_coupling="gumbel").jacobi.coupling == "gumbel"  # type: ignore[union-attr]
    with pytest.raises(LanternError, match="needs coupling independent, got 'maximal'"):
        MethodConfig(method="sjd", tree=TreeConfig(kind="chain", depth=16),
                     jacobi=MethodConfig.resolve("sjd-coupled").jacobi)


@pytest.fixture(scope="module")
def digits() -> lantern.Pipeline:
    return lantern.load("digits")


@pytest.mark.parametrize("name", ALL)
def test_movable_rows_is_what_the_prepared_parts_say(digits: lantern.Pipeline, name: str) -> None:
    """The server decides from the objects (``lantern.decoding.rows.movable``); the record states
    the same answer for a LlamaGen target."""
    method_cfg, sampling = resolve_settings(digits.stack, name)
    prepared = prepare_method(digits.stack, method_cfg, sampling)
    assert movable(*prepared.parts()) is METHOD_TABLE[name].movable_rows


def _choices(parser: argparse.ArgumentParser, command: str, flag: str) -> list[str]:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    action = next(a for a in sub.choices[command]._actions if flag in a.option_strings)
    return list(action.choices or ())


def test_the_cli_offers_exactly_the_table() -> None:
    parser = build_parser()
    assert _choices(parser, "generate", "--method") == [*ALL, "auto"]  # auto: lantern.calibration
    assert _choices(parser, "serve", "--method") == [*ALL, "auto"]  # the server's default when calibrated


def _table_rows(page: Path, header: str) -> dict[str, list[str]]:
    """The rows of the markdown table whose header line starts with ``header``: method -> cells."""
    lines = page.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows: dict[str, list[str]] = {}
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        rows[cells[0].strip("`")] = cells[1:]
    return rows


def test_docs_methods_table_lists_exactly_the_table() -> None:
    """docs/methods.md: every method in the table's order; a drafter's tree in the drafts column
    exactly for the drafter methods, and "lossy" in the acceptance column exactly for the lossy ones."""
    rows = _table_rows(ROOT / "docs" / "methods.md", "| `--method` |")
    assert tuple(rows) == ALL
    for name, (drafts, acceptance, _paper) in rows.items():
        record = METHOD_TABLE[name]
        assert drafts.startswith(("`dynamic`", "`static:")) is record.needs_drafter, name
        assert ("lossy" in acceptance) is not record.lossless, name


def test_readme_methods_table_agrees_with_the_table() -> None:
    """README's results table (a selection of methods): its lossless and drafter columns."""
    rows = _table_rows(ROOT / "README.md", "| method | lossless | drafter |")
    assert len(rows) >= 8 and set(rows) <= set(ALL)
    for name, (lossless, drafter, *_rest) in rows.items():
        record = METHOD_TABLE[name]
        assert lossless.startswith("yes") is record.lossless, name
        assert drafter == ("yes" if record.needs_drafter else "no"), name


def test_records_are_typed_values() -> None:
    record = METHOD_TABLE["sjd-pac"]
    assert isinstance(record, MethodRecord) and record.window_setting == "sjd_window"
    assert METHOD_TABLE["pjd"].window_setting == "pjd_window" and METHOD_TABLE["lantern"].window_setting is None
    assert METHOD_TABLE["lantern"].drafts_a_tree and not METHOD_TABLE["sjd"].drafts_a_tree
