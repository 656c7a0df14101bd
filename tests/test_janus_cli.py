"""``lantern generate``, ``demo``, ``bench`` and ``serve`` on a tiny Janus folder (transformers'
classes and ``save_pretrained``, laid out like a converted download): they run, give the codes of
``lantern.load(folder)(prompts=...)``, and refuse what Janus models do not take in one line."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers")

from conftest import (  # noqa: E402
    assert_bench_runs,
    assert_build_proximity_from_the_model_folder,
    assert_demo_runs,
    assert_generate_greedy_methods_agree_with_the_api,
    assert_generate_refuses_in_one_line,
    assert_generate_refuses_labels_and_remote_code,
    assert_generate_sampled_relaxed_row_with_the_folders_table,
    assert_serve_gives_the_apis_codes,
    cli_refusals,
)

from lantern.testing import make_tiny_janus_folder  # noqa: E402


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_janus_folder(tmp_path_factory.mktemp("janus") / "model")


def test_generate_greedy_methods_agree_with_the_api(folder: Path, tmp_path: Path) -> None:
    assert_generate_greedy_methods_agree_with_the_api(
        folder, tmp_path, sjd_window=4, layout={"name": "janus", "height": 4, "width": 4, "pixel_size": [8, 8]})


def test_generate_sampled_relaxed_row_with_the_folders_table(folder: Path, tmp_path: Path) -> None:
    assert_generate_sampled_relaxed_row_with_the_folders_table(folder, tmp_path)


@pytest.mark.parametrize("extra,message", cli_refusals("Janus"))
def test_generate_refuses_in_one_line(folder: Path, tmp_path: Path, extra: list[str], message: str,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    assert_generate_refuses_in_one_line(folder, tmp_path, extra, message, capsys)


def test_generate_refuses_labels_and_remote_code(folder: Path, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert_generate_refuses_labels_and_remote_code(folder, tmp_path, capsys, "Janus", {"AutoModel": "x.Y"})


def test_demo(folder: Path, tmp_path: Path) -> None:
    assert_demo_runs(folder, tmp_path)


def test_bench(folder: Path, tmp_path: Path) -> None:
    assert_bench_runs(folder, tmp_path, image_size=8)


def test_serve_gives_the_apis_codes(folder: Path) -> None:
    assert_serve_gives_the_apis_codes(folder, {"method": "sjd-coupled", "sjd_window": 4})


def test_build_proximity_from_the_model_folder(folder: Path, tmp_path: Path) -> None:
    """A table of normalized codes, run by relaxed SJD."""
    assert_build_proximity_from_the_model_folder(folder, tmp_path, normalize=True,
                                                 generate=["--method", "sjd-lantern", "--sjd-window", "4"])
