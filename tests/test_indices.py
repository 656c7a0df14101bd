"""One image of a run, alone: ``indices=[37]`` / ``--indices 37`` generates image 37 of the call as the
whole call makes it (its own place's random stream, its file name), without the other images.

Before, image ``i`` of a run drew from ``image_seed(seed, i)`` with no way to ask for ``i`` alone:
a call of its label alone with the same seed draws from stream 0, another image."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import assert_cli_error
from PIL import Image

import lantern
from lantern.cli.main import main
from lantern.errors import LanternError

LABELS, PER_LABEL, SEED = [1, 2, 5], 3, 11  # 9 images: image i is label LABELS[i // 3]


@pytest.fixture(scope="module")
def digits() -> lantern.Pipeline:
    return lantern.load("digits", deterministic=True)  # a row's codes never depend on its batch, on any CPU


# not marked invariance: deterministic mode's batch invariance, which this leans on, is rerun under
# forced AVX2 by its own tests (test_capabilities); these check which stream each image draws from
@pytest.mark.parametrize("method", ["sjd-coupled", "lantern++"])
def test_the_chosen_images_are_the_whole_calls_images(digits: lantern.Pipeline, method: str) -> None:
    whole = digits(labels=LABELS, num_per_label=PER_LABEL, seed=SEED, batch_size=4, method=method)
    chosen = [7, 0, 4]
    some = digits(labels=LABELS, num_per_label=PER_LABEL, seed=SEED, batch_size=4, method=method, indices=chosen)
    assert torch.equal(some.codes, whole.codes[chosen])
    assert [im.tobytes() for im in some.images] == [whole.images[i].tobytes() for i in chosen]
    assert some.settings["indices"] == chosen and some.config["indices"] == chosen and "indices" not in whole.config
    assert torch.equal(digits(labels=LABELS, **some.settings).codes, some.codes)  # settings passed back
    # power: the images differ from each other, and image 7's label alone at this seed is another image
    # (stream 0, not 7), so neither the order nor the streams could pass by chance
    assert len({tuple(row.tolist()) for row in whole.codes[chosen]}) == 3
    alone = digits(labels=[LABELS[7 // PER_LABEL]], seed=SEED, method=method)
    assert not torch.equal(alone.codes[0], whole.codes[7])
    # as arrays and tensors too (what a data loader or np.where hands over)
    for given in (np.array([7, 0, 4]), torch.tensor([7, 0, 4]), (7, 0, 4)):
        again = digits(labels=LABELS, num_per_label=PER_LABEL, seed=SEED, batch_size=4, method=method, indices=given)
        assert torch.equal(again.codes, some.codes)


def test_bad_indices_are_one_line_errors_naming_the_argument(digits: lantern.Pipeline) -> None:
    for given, message in (([], "indices is empty; name at least one image of the run (0..5)"),
                           ([6], "indices: image 6 is not in this run, whose 6 images are 0..5"),
                           ([-1], "indices: image -1 is not in this run"),
                           ([2, 2], "indices names image 2 twice"),
                           ([1.0], "indices must hold integers (image indices), got 1.0 (float)"),
                           ([True], "indices must hold integers (image indices), got True (bool)"),
                           (3, "indices must be a list of image indices (integers), got int"),
                           ("3", "indices must be a list of image indices (integers), got str"),
                           (np.zeros((1, 2), np.int64), "indices must be a list of image indices, got a 2-D array")):
        with pytest.raises(LanternError) as e:
            digits(labels=[1, 2], num_per_label=3, indices=given)
        assert str(e.value).startswith(message) and "\n" not in str(e.value), (given, str(e.value))


def test_prompts_are_chosen_as_labels_are(t2i_stack: Path) -> None:
    pipe = lantern.load(t2i_stack, deterministic=True)
    prompts = ["a red car", "dog", "a small green house"]
    whole = pipe(prompts=prompts, num_per_label=2, seed=2, batch_size=3)
    some = pipe(prompts=prompts, num_per_label=2, seed=2, batch_size=3, indices=[5, 2])
    assert torch.equal(some.codes, whole.codes[[5, 2]])
    assert not torch.equal(whole.codes[5], whole.codes[2])


def _generate(out: Path, *extra: str) -> tuple[np.ndarray, dict]:
    assert main(["generate", "--model", "digits", "--labels", "1,2,5", "--num-per-label", "3", "--seed", "11",
                 "--method", "sjd-coupled", "--batch-size", "4", "--deterministic", "--no-progress",
                 "--out", str(out), *extra]) == 0
    return np.load(out / "codes.npy"), json.loads((out / "run.json").read_text())


def test_the_command_line_writes_the_chosen_images_under_the_runs_names(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    codes, run = _generate(tmp_path / "whole")
    some_codes, some = _generate(tmp_path / "some", "--indices", "8,3-4")
    assert np.array_equal(some_codes, codes[[8, 3, 4]])
    names = ["0008_label5.png", "0003_label2.png", "0004_label2.png"]
    assert sorted(p.name for p in (tmp_path / "some").glob("*_label*.png")) == sorted(names)
    for name in names:  # the same PNG bytes as the whole run's file of that name
        assert (tmp_path / "some" / name).read_bytes() == (tmp_path / "whole" / name).read_bytes()
    assert some["indices"] == [8, 3, 4] and some["labels"] == [5, 2, 2]
    assert some["seeds"] == [run["seeds"][i] for i in (8, 3, 4)]
    with Image.open(tmp_path / "some" / "grid.png") as grid:  # three images: a 2 x 2 square, not a row
        assert grid.size[0] < 3 * 32
    # --resume checks the selection as part of the job: another one is named, not mixed in
    assert main(["generate", "--model", "digits", "--labels", "1,2,5", "--num-per-label", "3", "--seed", "11",
                 "--method", "sjd-coupled", "--batch-size", "4", "--deterministic", "--no-progress",
                 "--out", str(tmp_path / "some"), "--indices", "8,3-4", "--resume"]) == 0
    capsys.readouterr()
    assert main(["generate", "--model", "digits", "--labels", "1,2,5", "--num-per-label", "3", "--seed", "11",
                 "--method", "sjd-coupled", "--batch-size", "4", "--deterministic", "--no-progress",
                 "--out", str(tmp_path / "some"), "--indices", "3,4,8", "--resume"]) == 2
    assert "was started with a different labels ([5, 2, 2], now [2, 2, 5])" in capsys.readouterr().err


@pytest.mark.parametrize("given, message", [
    ("1", r"--indices: image 1 is not in this run, whose 1 images are 0\.\.0"),
    ("0,0", r"--indices names image 0 twice"),
])
def test_bad_indices_on_the_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], given: str,
                                         message: str) -> None:
    assert_cli_error("digits", tmp_path, capsys, ["--indices", given], message)


@pytest.mark.parametrize("given, message", [
    ("", "argument --indices: expected at least one image index"),
    ("0-2000000", "argument --indices: '0-2000000' makes more than 1000000 images"),
    ("a", "argument --indices: expected comma-separated integers or ranges (0-999), got 'a'"),
])
def test_unreadable_indices_are_refused_by_the_parser(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                      given: str, message: str) -> None:
    with pytest.raises(SystemExit) as e:
        main(["generate", "--model", "digits", "--labels", "0", "--out", str(tmp_path / "o"), "--indices", given])
    assert e.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
