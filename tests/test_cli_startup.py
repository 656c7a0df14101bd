"""``lantern --help``, ``--version`` and argument errors answer without importing torch.

``import torch`` takes most of the start-up (about 2 s of 2.5-3 s on a 2-core machine), so building
the parser, and whatever fails before a command runs, must not reach it: each case runs in a fresh
interpreter (this one has torch loaded long ago) whose tripwire records where torch was first
imported, so a failure names the import chain to cut.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

# Run in the child: a meta-path finder that sees every import before the real finders do and keeps
# the lantern frames of the first ``import torch``; then the command line, and a JSON report.
CHILD = r"""
import argparse, contextlib, io, json, sys, traceback

first_torch_import = []


class Tripwire:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" and not first_torch_import:
            first_torch_import.extend(f"{f.filename}:{f.lineno} ({f.line})" for f in traceback.extract_stack()
                                      if "/lantern/" in f.filename.replace("\\", "/"))
        return None  # never finds anything itself: the import goes on as usual


sys.meta_path.insert(0, Tripwire())
from lantern.cli.main import build_parser, main

commands = [c for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction) for c in a.choices]
# EVERY-HELP: each command's --help in turn (one interpreter: the tripwire names the culprit anyway)
argvs = [[c, "--help"] for c in commands] if sys.argv[1:] == ["EVERY-HELP"] else [sys.argv[1:]]
codes, err = [], io.StringIO()
for argv in argvs:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            codes.append(main(argv))
        except SystemExit as e:
            codes.append(e.code)
print(json.dumps({"codes": codes, "commands": commands, "stderr": err.getvalue(),
                  "torch": "torch" in sys.modules, "chain": first_torch_import,
                  "lantern": [m for m in sys.modules if m.split(".")[0] == "lantern"]}))
"""

BAD_FLAGS = {
    "missing arguments": (["generate", "--bogus"], "the following arguments are required: --model, --out"),
    "unknown flag": (["generate", "--model", "m", "--out", "o", "--bogus"], "unrecognized arguments: --bogus"),
    "unknown method": (["generate", "--model", "m", "--out", "o", "--method", "nope"],
                       "argument --method: invalid choice: 'nope'"),
    "not an integer": (["generate", "--model", "m", "--out", "o", "--num-per-label", "three"],
                       "invalid int value: 'three'"),
    "bad sampling flag": (["generate", "--model", "m", "--out", "o", "--temperature", "-1"],
                          "--temperature: temperature must be >= 0"),
    "bad seed": (["bench", "--seed", "-1"], "--seed must be in [0, 2^63)"),
    "unknown command": (["genrate"], "invalid choice: 'genrate'"),
    # an empty item was dropped, so "0,,3" ran 2 labels (a probe, 2026-11-29)
    "empty label": (["generate", "--model", "m", "--out", "o", "--labels", "0,,3"],
                    "argument --labels: expected comma-separated integers, got '0,,3' (an empty item)"),
    "not a label": (["generate", "--model", "m", "--out", "o", "--labels", "0-9,x"],
                    "argument --labels: expected comma-separated integers or ranges (0-999), got 'x'"),
    "downward range": (["generate", "--model", "m", "--out", "o", "--labels", "9-3"],
                       "argument --labels: the range '9-3' runs downward; write 3-9"),
    "too many labels": (["generate", "--model", "m", "--out", "o", "--labels", "0-999999,0-5"],
                        "argument --labels: '0-5' makes more than 1000000 labels"),
}


def run_child(*argv: str) -> dict[str, Any]:
    """Run the command line in a fresh interpreter; its report (exit codes, stderr, torch's import chain)."""
    res = subprocess.run([sys.executable, "-c", CHILD, *argv], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    return json.loads(res.stdout.splitlines()[-1])


def assert_no_torch(report: dict[str, Any]) -> None:
    assert not report["torch"], (
        "torch was imported; first by:\n  " + "\n  ".join(report["chain"])
        + "\nlantern modules loaded, in order: " + ", ".join(report["lantern"])
    )


@pytest.mark.parametrize("argv", [["--version"], ["--help"], ["EVERY-HELP"]], ids=" ".join)
def test_help_and_version_import_no_torch(argv: list[str]) -> None:
    report = run_child(*argv)
    assert report["codes"] and set(report["codes"]) == {0}, report
    assert "generate" in report["commands"] and "train-target" in report["commands"]
    assert_no_torch(report)


@pytest.mark.parametrize(("argv", "message"), BAD_FLAGS.values(), ids=BAD_FLAGS.keys())
def test_argument_errors_exit_2_without_torch(argv: list[str], message: str) -> None:
    report = run_child(*argv)
    assert report["codes"] == [2], report
    assert message in report["stderr"], report["stderr"]
    # one line naming the argument, as every lantern error (not argparse's usage block first)
    assert len(report["stderr"].splitlines()) == 1 and report["stderr"].startswith("lantern"), report["stderr"]
    assert_no_torch(report)


@pytest.mark.parametrize("module", ["lantern", "lantern.cli"])
def test_python_dash_m_runs_the_command_line(module: str) -> None:
    """``python -m lantern`` was "No module named lantern.__main__" (a probe, 2026-11-30)."""
    from lantern.version import __version__

    done = subprocess.run([sys.executable, "-m", module, "--version"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and __version__ in done.stdout, done.stderr
