"""``--sjd-window auto`` (``lantern.autotree.window``): the window is chosen by timing, explained, recorded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lantern.autotree.window import AutoWindowChoice, WindowTrial, choose_window, with_window
from lantern.cli.main import main
from lantern.decoding.config import SamplingConfig, TreeConfig
from lantern.errors import LanternError
from lantern.methods import MethodConfig
from lantern.targets.llamagen_stack import load_stack
from lantern.testing import make_random_stack


@pytest.fixture(scope="module")
def random_stack(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_random_stack(tmp_path_factory.mktemp("autowindow") / "random", seed=3)


def test_the_fastest_window_wins_and_is_explained() -> None:
    trials = (WindowTrial(4, 1.8, 3.0), WindowTrial(8, 2.4, 2.5), WindowTrial(16, 2.9, 2.5), WindowTrial(32, 3.1, 4.0))
    choice = AutoWindowChoice("sjd-coupled", trials, 12.0)
    assert choice.window == 8  # 2.5 ms per token, tied with 16: the smaller window
    assert choice.explanation.startswith("window 8: 2.40 tokens per forward, 2.50 ms per token")
    assert "runner-ups: 16 (2.50 ms, 2.90/fwd), 4 (3.00 ms, 1.80/fwd), 32 (4.00 ms, 3.10/fwd)" in choice.explanation
    assert choice.to_dict()["window"] == 8 and len(choice.to_dict()["trials"]) == 4


def test_choose_window_measures_every_candidate(random_stack: Path) -> None:
    stack = load_stack(random_stack)
    method = MethodConfig.resolve("sjd-coupled")
    choice = choose_window(stack, method, SamplingConfig(top_k=20), images=1, windows=(2, 4, 64, 100), passes=1)
    assert [t.window for t in choice.trials] == [2, 4]  # windows as long as the 64-token image are skipped
    assert all(t.tokens_per_forward >= 1.0 and t.ms_per_token > 0 for t in choice.trials)
    assert choice.window in (2, 4) and choice.seconds > 0
    chosen = with_window(method, choice.window)
    assert chosen.jacobi is not None and chosen.jacobi.window == choice.window
    assert chosen.tree == TreeConfig(kind="chain", depth=choice.window) and chosen.jacobi.coupling == "maximal"
    with pytest.raises(LanternError, match=r"--sjd-window / --pjd-window auto needs a Jacobi --method"):
        choose_window(stack, MethodConfig.resolve("ar"), SamplingConfig())


@pytest.mark.slow
def test_cli_auto_window_is_recorded(random_stack: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "o"
    rc = main(["generate", "--model", str(random_stack), "--labels", "1", "--method", "gsd", "--sjd-window", "auto",
               "--out", str(out), "--no-progress"])
    assert rc == 0
    assert "--sjd-window auto [gsd]: window " in capsys.readouterr().out
    run = json.loads((out / "run.json").read_text())
    assert run["method"]["jacobi"]["window"] == run["auto_window"]["window"] in (4, 8, 16, 32)


def test_the_calibration_shows_its_progress(random_stack: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A bar over the calibration's decodes (a 7B model's take minutes): one eager warm-up, then
    each window once per pass; none without ``progress``."""
    stack = load_stack(random_stack)
    method = MethodConfig.resolve("sjd-coupled")
    choose_window(stack, method, SamplingConfig(top_k=20), images=1, windows=(2, 4), passes=2, progress=True)
    err = capsys.readouterr().err
    assert "timing sjd-coupled's windows" in err and "| 0/5 " in err  # 1 + 2 x 2 decodes
    choose_window(stack, method, SamplingConfig(top_k=20), images=1, windows=(2, 4), passes=1)
    assert "timing" not in capsys.readouterr().err


def test_a_decodes_progress_step_is_not_timed() -> None:
    """``time_rotated``'s ``done`` runs after the clock stops: a slow step (a bar's redraw) adds
    nothing to a decode's time."""
    from types import SimpleNamespace

    from lantern.autotree.timing import time_rotated

    now = [0.0]

    def decode() -> SimpleNamespace:
        now[0] += 1.0  # one second per decode
        return SimpleNamespace(codes=torch.zeros(1, 1000))

    def slow_step() -> None:
        now[0] += 5.0

    best, _ = time_rotated([decode, decode], 2, clock=lambda: now[0], done=slow_step)
    assert best == [1.0, 1.0]  # ms per token: 1 s over 1000 tokens
