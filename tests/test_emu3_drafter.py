"""EAGLE drafters for Emu3 models, trained by ``lantern train-chameleon-drafter`` on a tiny Emu3 folder.

As tests/test_janus_drafter.py, over Emu3's own adapter: negative-prompt guidance rows, guidance on
full-vocabulary log-softmaxes, the size header as the drafter's prefix, and end-of-line tokens after
every row (the adapter's shadows: the drafter reads the state at a row's end-of-line token).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from conftest import (  # noqa: E402
    GREEDY_DRAFTING,
    assert_drafted_rows_do_not_depend_on_the_batch,
    assert_drafters_refused_in_one_line,
    assert_generate_with_drafter_gives_ar_codes,
    assert_greedy_drafting_reproduces_greedy_ar,
    train_chameleon_drafter,
)

import lantern  # noqa: E402
from lantern.errors import LanternError  # noqa: E402
from lantern.testing import make_tiny_emu3_folder, make_tiny_janus_folder  # noqa: E402

PROMPTS = ["a red car", "a cat on the grass", "a photo of a mountain lake at dawn"]  # three lengths


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_emu3_folder(tmp_path_factory.mktemp("emu3") / "model")


@pytest.fixture(scope="module")
def drafter(folder: Path) -> Path:
    out = folder.parent / "drafter"
    assert train_chameleon_drafter(folder, out) == 0
    return out


@pytest.fixture(scope="module")
def pipe(folder: Path, drafter: Path) -> lantern.Pipeline:
    return lantern.load(folder, drafter=drafter)


def test_training_saves_a_safetensors_drafter_for_emu3(drafter: Path, pipe: lantern.Pipeline) -> None:
    assert (drafter / "model.safetensors").is_file() and not list(drafter.glob("*.bin"))
    assert json.loads((drafter / "drafter_training.json").read_text())["layout"] == "emu3"
    config = json.loads((drafter / "config.json").read_text())
    assert config["rope"] == "1d" and config["vocab_size"] == 32
    assert config["target_cls_token_num"] == len(pipe.stack.layout.prefix)  # the size header
    assert config["block_size"] == 16


@pytest.mark.parametrize("method,settings", GREEDY_DRAFTING)
def test_greedy_drafting_reproduces_greedy_ar(pipe: lantern.Pipeline, method: str, settings: dict[str, object]) -> None:
    assert_greedy_drafting_reproduces_greedy_ar(pipe, PROMPTS, method, settings)


@pytest.mark.parametrize("method", ["sd", "lantern", "lantern++"])
def test_sampled_rows_do_not_depend_on_the_batch(pipe: lantern.Pipeline, method: str) -> None:
    assert_drafted_rows_do_not_depend_on_the_batch(pipe, PROMPTS, method)


def test_generate_with_drafter_gives_ar_codes(folder: Path, drafter: Path, tmp_path: Path) -> None:
    assert_generate_with_drafter_gives_ar_codes(folder, drafter, tmp_path, PROMPTS[:2])


def test_drafter_methods_without_a_drafter_ask_for_one(folder: Path) -> None:
    with pytest.raises(LanternError, match="^method sd needs a drafter: pass drafter=DIR"):
        lantern.load(folder)(prompts=PROMPTS[:1], method="sd")


def test_a_drafter_for_another_model_is_refused_in_one_line(folder: Path, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    others = {
        "janus": (tmp_path / "d-janus", "was trained for a Janus model, not this Emu3 model"),
        "smaller image": (tmp_path / "d-small", "does not fit this Emu3 target and layout: block_size 4"),
    }
    assert train_chameleon_drafter(make_tiny_janus_folder(tmp_path / "janus"), others["janus"][0]) == 0
    assert train_chameleon_drafter(folder, others["smaller image"][0], "--image-size", "16") == 0  # 2 x 2 codes
    assert_drafters_refused_in_one_line(folder, others, PROMPTS[0], tmp_path, capsys)
