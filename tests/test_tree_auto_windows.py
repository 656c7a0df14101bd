"""``tree="auto"`` / ``--tree auto`` on a Jacobi method chooses its window (SJD's, PJD's) by measurement."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import lantern
from lantern.cli.main import main
from lantern.testing import make_random_stack


@pytest.fixture(scope="module")
def random_stack(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_random_stack(tmp_path_factory.mktemp("treeauto") / "random", seed=3)


@pytest.mark.slow  # times four windows
def test_python_tree_auto_picks_and_records_the_sjd_window(random_stack: Path) -> None:
    pipe = lantern.load(str(random_stack))
    out = pipe(labels=[1, 2], method="sjd-coupled", tree="auto", seed=4, top_k=20)
    window = out.config["auto_window"]["window"]
    assert window in (4, 8, 16, 32) and out.config["method"]["jacobi"]["window"] == window
    assert [t["window"] for t in out.config["auto_window"]["trials"]] == [4, 8, 16, 32]
    same = pipe(labels=[1, 2], method="sjd-coupled", sjd_window=window, seed=4, top_k=20)
    assert torch.equal(out.codes, same.codes)  # the chosen window, run as if given by hand


@pytest.mark.slow  # times three windows
def test_cli_tree_auto_on_pjd_is_its_window(random_stack: Path, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "o"
    rc = main(["generate", "--model", str(random_stack), "--labels", "1", "--method", "pjd", "--tree", "auto",
               "--pjd-context", "4", "--out", str(out), "--no-progress"])
    assert rc == 0
    assert "--pjd-window auto [pjd]: window " in capsys.readouterr().out
    run = json.loads((out / "run.json").read_text())
    assert run["method"]["pjd"]["window"] == run["auto_window"]["window"] in (2, 4, 8)


def test_cli_tree_auto_with_a_fixed_window_is_refused(random_stack: Path, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["generate", "--model", str(random_stack), "--labels", "1", "--method", "sjd", "--tree", "auto",
               "--sjd-window", "4", "--out", str(tmp_path / "o"), "--no-progress"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "--tree auto chooses sjd's window; it cannot be combined with --sjd-window 4" in err
    assert not (tmp_path / "o").exists()
