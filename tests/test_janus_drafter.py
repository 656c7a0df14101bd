"""EAGLE drafters for Janus models, trained by ``lantern train-chameleon-drafter`` on a tiny Janus folder.

* the real CLI path self-distils images, trains, and saves a safetensors drafter folder that
  ``lantern.load(folder, drafter=...)`` and ``generate --drafter`` load;
* greedy ``sd`` and greedy ``lantern`` at delta 0 reproduce greedy AR token for token with
  classifier-free guidance on (the folder's scale 3: two streams, Janus's pad-token guidance rows);
* sampled, a row's codes do not depend on its batch (other prompts, other lengths);
* a drafter trained for another model is refused in one specific line.
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
from lantern.testing import make_tiny_chameleon_folder, make_tiny_janus_folder  # noqa: E402

PROMPTS = ["a red car", "a cat on the grass", "a photo of a mountain lake at dawn"]  # three lengths


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_janus_folder(tmp_path_factory.mktemp("janus") / "model")


@pytest.fixture(scope="module")
def drafter(folder: Path) -> Path:
    out = folder.parent / "drafter"
    assert train_chameleon_drafter(folder, out) == 0
    return out


@pytest.fixture(scope="module")
def pipe(folder: Path, drafter: Path) -> lantern.Pipeline:
    return lantern.load(folder, drafter=drafter)


def test_training_saves_a_safetensors_drafter_for_janus(drafter: Path, pipe: lantern.Pipeline) -> None:
    assert (drafter / "model.safetensors").is_file() and not list(drafter.glob("*.bin"))
    info = json.loads((drafter / "drafter_training.json").read_text())
    assert info["layout"] == "janus"
    config = json.loads((drafter / "config.json").read_text())
    # one decoder layer of the model's width, over its 32 codes, after the image-start token's feature
    assert (config["hidden_size"], config["vocab_size"], config["target_cls_token_num"], config["rope"]) == (
        32, 32, 1, "1d")
    assert pipe.parts.drafter().config.block_size == 16


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


def _other_drafters(tmp: Path) -> dict[str, tuple[Path, str]]:
    """Drafter folders made for other models, each with the line that must refuse it."""
    from lantern.models.chameleon import layout_by_name
    from lantern.targets.chameleon_stack import load_chameleon_stack
    from lantern.testing import tiny_released_drafter

    chameleon = make_tiny_chameleon_folder(tmp / "chameleon")
    released = tiny_released_drafter(load_chameleon_stack(chameleon, layout_by_name("lumina-mgpt", 64)).model)
    from lantern.models.chameleon_drafter import save_released_drafter

    small = make_tiny_janus_folder(tmp / "small", grid=2)
    out = {
        "chameleon": (tmp / "d-chameleon",
                      "was trained for a Chameleon-family model (layout 'lumina-mgpt'), not this Janus model"),
        "smaller janus": (tmp / "d-small", "does not fit this Janus target and layout: block_size 4"),
        "released": (save_released_drafter(released, tmp / "d-released"),
                     "LANTERN's released Anole / Lumina-mGPT drafters, not a drafter for this Janus model"),
    }
    assert train_chameleon_drafter(chameleon, out["chameleon"][0], "--image-size", "64") == 0
    assert train_chameleon_drafter(small, out["smaller janus"][0]) == 0
    return out


def test_a_drafter_for_another_model_is_refused_in_one_line(folder: Path, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    assert_drafters_refused_in_one_line(folder, _other_drafters(tmp_path), PROMPTS[0], tmp_path, capsys)
