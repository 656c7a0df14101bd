"""``lantern generate``, ``demo``, ``bench``, ``serve`` and ``build-proximity`` on a tiny Emu3 folder
(transformers' classes and ``save_pretrained``, laid out like a converted download): they run, give
the codes of ``lantern.load(folder)(prompts=...)``, and refuse what Emu3 models do not take in one line."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

pytest.importorskip("transformers")

from conftest import (  # noqa: E402
    CLI_PROMPTS,
    assert_bench_runs,
    assert_build_proximity_from_the_model_folder,
    assert_demo_runs,
    assert_generate_greedy_methods_agree_with_the_api,
    assert_generate_refuses_in_one_line,
    assert_generate_refuses_labels_and_remote_code,
    assert_generate_sampled_relaxed_row_with_the_folders_table,
    assert_serve_gives_the_apis_codes,
    cli_refusals,
    generate_prompts,
)

import lantern  # noqa: E402
from lantern.testing import make_tiny_emu3_folder  # noqa: E402


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_emu3_folder(tmp_path_factory.mktemp("emu3") / "model")


def test_generate_greedy_methods_agree_with_the_api(folder: Path, tmp_path: Path) -> None:
    assert_generate_greedy_methods_agree_with_the_api(
        folder, tmp_path, sjd_window=6, layout={"name": "emu3", "height": 4, "width": 4, "pixel_size": [32, 32]})


def test_generate_image_size(folder: Path, tmp_path: Path) -> None:
    """``--image-size 48``: 6 x 6 codes, 48-pixel images, the API's codes at the same size."""
    out = tmp_path / "big"
    assert generate_prompts(folder, out, "--image-size", "48", "--method", "pjd", "--pjd-window", "2",
                            "--pjd-context", "6", "--temperature", "0") == 0
    codes = np.load(out / "codes.npy")
    assert codes.shape == (2, 36) and Image.open(out / "0000_prompt0.png").size == (48, 48)
    api = lantern.load(folder, image_size=48)(prompts=list(CLI_PROMPTS), method="ar", temperature=0.0)
    assert (api.codes.numpy() == codes).all()


def test_generate_sampled_relaxed_row_with_the_folders_table(folder: Path, tmp_path: Path) -> None:
    assert_generate_sampled_relaxed_row_with_the_folders_table(folder, tmp_path)


@pytest.mark.parametrize(
    "extra,message",
    [*cli_refusals("Emu3"), (["--image-size", "36"], "--image-size must be a positive multiple of 8 for Emu3 models")],
)
def test_generate_refuses_in_one_line(folder: Path, tmp_path: Path, extra: list[str], message: str,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    assert_generate_refuses_in_one_line(folder, tmp_path, extra, message, capsys)


def test_generate_refuses_labels_and_remote_code(folder: Path, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert_generate_refuses_labels_and_remote_code(folder, tmp_path, capsys, "Emu3", {"AutoModelForCausalLM": "x.Y"})


def test_demo(folder: Path, tmp_path: Path) -> None:
    assert_demo_runs(folder, tmp_path)


def test_bench(folder: Path, tmp_path: Path) -> None:
    assert_bench_runs(folder, tmp_path, image_size=32)


def test_serve_gives_the_apis_codes(folder: Path) -> None:
    assert_serve_gives_the_apis_codes(folder, {"method": "pjd", "pjd_window": 2, "pjd_context": 2})


def test_build_proximity_from_the_model_folder(folder: Path, tmp_path: Path) -> None:
    """A table of the raw codes, run by a relaxed PJD row."""
    assert_build_proximity_from_the_model_folder(folder, tmp_path, normalize=False,
                                                 generate=["--method", "pjd-lantern", "--pjd-window", "2",
                                                           "--pjd-context", "2"])
