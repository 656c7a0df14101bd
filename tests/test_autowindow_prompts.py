"""The auto windows (``sjd_window="auto"``, ``--pjd-window auto``, ``tree="auto"`` on a Jacobi method)
on every prompted model family: LlamaGen t2i, Lumina-mGPT (row-end tokens), Janus, Emu3.

SJD was made for Lumina-mGPT, so its window is calibrated on the model's own measurement prompts
(not refused, as it was while calibration drew class labels). What is checked: the candidates timed
(an SJD window shorter than the image, a PJD window no longer than an image row), the prompts timed on
(the measurement set, ``bench --prompts``' where given), the record, and that the chosen window's
codes are those of the same call with that window given by hand.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import lantern
from lantern.autotree import window as window_mod
from lantern.autotree.window import CANDIDATE_WINDOWS, PJD_CANDIDATE_WINDOWS, calibration_conditions
from lantern.cli.main import main
from lantern.targets.base import MEASURE_PROMPTS
from lantern.testing import make_tiny_chameleon_folder, make_tiny_emu3_folder, make_tiny_janus_folder

PROMPTS = ["a red car", "a dog"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory, t2i_stack: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("autowindow-prompts")
    return {"t2i": t2i_stack, "lumina": make_tiny_chameleon_folder(root / "lumina"),
            "janus": make_tiny_janus_folder(root / "janus"), "emu3": make_tiny_emu3_folder(root / "emu3")}


@pytest.fixture(scope="module")
def pipes(folders: dict[str, Path]) -> dict[str, lantern.Pipeline]:
    return {name: lantern.load(folder) for name, folder in folders.items()}


def timed_conditions(monkeypatch: pytest.MonkeyPatch) -> list[list[Any]]:
    """Every condition list the window calibration encodes, as it runs."""
    seen: list[list[Any]] = []
    real: Callable[..., list[Any]] = window_mod.calibration_conditions

    def spy(stack: Any, images: int) -> list[Any]:
        seen.append(real(stack, images))
        return seen[-1]

    monkeypatch.setattr(window_mod, "calibration_conditions", spy)
    return seen


@pytest.mark.parametrize("family", ["t2i", "lumina", "janus", "emu3"])
def test_sjd_window_auto_on_a_prompted_model_is_timed_on_prompts_and_runs_as_chosen(
        family: str, pipes: dict[str, lantern.Pipeline], monkeypatch: pytest.MonkeyPatch) -> None:
    pipe = pipes[family]
    seen = timed_conditions(monkeypatch)
    out = pipe(prompts=PROMPTS, method="sjd-coupled", sjd_window="auto", seed=3)
    chosen = out.config["auto_window"]
    n_tokens = pipe.stack.num_tokens
    assert [t["window"] for t in chosen["trials"]] == [w for w in CANDIDATE_WINDOWS if w < n_tokens]
    assert out.config["method"]["jacobi"]["window"] == chosen["window"]
    # timed on the model's measurement prompts, at least the call's two rows
    assert seen == [list(MEASURE_PROMPTS[:2])]
    same = pipe(prompts=PROMPTS, method="sjd-coupled", sjd_window=chosen["window"], seed=3)
    assert torch.equal(out.codes, same.codes)


def test_pjd_windows_fit_a_row_with_its_end_token(pipes: dict[str, lantern.Pipeline]) -> None:
    """Lumina-mGPT's image rows end with a new-line token: a PJD window is timed among those no
    longer than the row's codes, and the choice runs as given by hand."""
    pipe = pipes["lumina"]
    row = pipe.stack.grid_width
    out = pipe(prompts=PROMPTS[:1], method="pjd", tree="auto", pjd_context=row, seed=5)
    chosen = out.config["auto_window"]
    assert row == 4 and [t["window"] for t in chosen["trials"]] == [2, 4]  # 8 is longer than the row
    assert max(PJD_CANDIDATE_WINDOWS) > row
    assert all(t["tokens_per_forward"] >= 1.0 for t in chosen["trials"])
    same = pipe(prompts=PROMPTS[:1], method="pjd", pjd_window=chosen["window"], pjd_context=row, seed=5)
    assert torch.equal(out.codes, same.codes)


def test_the_calibration_uses_the_benchs_prompts_where_given(pipes: dict[str, lantern.Pipeline]) -> None:
    stack = pipes["janus"].stack
    assert calibration_conditions(stack, 3) == list(MEASURE_PROMPTS[:3])
    stack.measure_with(["a blue boat", "snow"])
    try:
        assert calibration_conditions(stack, 3) == ["a blue boat", "snow", "a blue boat"]
    finally:
        stack.__dict__.pop("_measure_prompts")
    # a class-conditional stack: labels spread over its classes, 0 first
    digits = lantern.load("digits").stack
    assert calibration_conditions(digits, 4) == [0, 2, 5, 7]


def test_cli_auto_window_on_a_chameleon_folder_is_recorded_and_reproducible(
        folders: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    common = ["generate", "--model", str(folders["lumina"]), "--prompt", "a red car", "--seed", "2", "--no-progress",
              "--method", "pjd", "--pjd-context", "4"]
    assert main([*common, "--pjd-window", "auto", "--out", str(tmp_path / "auto")]) == 0
    assert "--pjd-window auto [pjd]: window " in capsys.readouterr().out
    run = json.loads((tmp_path / "auto" / "run.json").read_text())
    window = run["auto_window"]["window"]
    assert run["method"]["pjd"]["window"] == window
    assert main([*common, "--pjd-window", str(window), "--out", str(tmp_path / "fixed")]) == 0
    assert (tmp_path / "auto" / "codes.npy").read_bytes() == (tmp_path / "fixed" / "codes.npy").read_bytes()


def test_bench_times_a_window_on_a_prompted_model(folders: dict[str, Path], tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """``bench --methods pjd/window=auto`` on Lumina-mGPT (was an AttributeError: the calibration read
    LlamaGen's config): the row runs with the window timed on the bench's prompts, and says so."""
    out = tmp_path / "bench"
    assert main(["bench", "--model", str(folders["lumina"]), "--methods", "ar,pjd/window=auto/context=4",
                 "--no-quality", "--num-images", "2", "--speed-images", "2", "--repeats", "1", "--curve-images", "0",
                 "--out", str(out), "--no-progress"]) == 0
    assert "window auto for pjd/window=auto/context=4: window " in capsys.readouterr().out
    run = json.loads((out / "run.json").read_text())
    chosen = run["auto_windows"]["pjd/window=auto/context=4"]
    assert [t["window"] for t in chosen["trials"]] == [2, 4]
    assert run["methods"]["pjd/window=auto/context=4"]["pjd"]["window"] == chosen["window"]
