"""Regression tests for the bad-input probe of issue 30 (findings 2, 3, 6, 9, 10, 11): each bad
argument, file or folder ends in one specific :class:`LanternError` line (or a note and a correct
run), never a traceback, partial output or silent wrong result."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import lantern
from lantern.errors import LanternError
from lantern.testing import make_tiny_chameleon_folder

# --------------------------------------------------------------------------------------------------
# 9. The Python API: every wrong type or value names the argument
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def digits() -> lantern.Pipeline:
    return lantern.load("digits")


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"labels": 3}, r"^labels: expected a list of class ids \(integers\), got int 3$"),
    ({"labels": "0"}, r"^labels: expected a list of class ids \(integers\), got str '0'$"),
    ({"labels": []}, r"^labels: the list is empty"),
    ({"labels": [1.5]}, r"^labels\[0\]: expected a class id \(an integer\), got float 1.5$"),
    ({"labels": [2, True]}, r"^labels\[1\]: expected a class id \(an integer\), got bool True$"),
    ({"labels": np.array([[1, 2]])}, r"^labels: expected a 1-D integer array of class ids, got a 2-D int64"),
    ({"labels": np.array([1.0])}, r"^labels: expected a 1-D integer array of class ids, got a 1-D float64"),
    ({"labels": [0], "temperature": "1.0"}, r"^temperature must be a number, got '1.0' \(str\)$"),
    ({"labels": [0], "cfg_scale": [2]}, r"^cfg_scale must be a number, got \[2\] \(list\)$"),
    ({"labels": [0], "top_k": True}, r"^top_k must be an integer >= 0"),
    ({"labels": [0], "seed": "abc"}, r"^seed must be an integer, got 'abc' \(str\)$"),
    ({"labels": [0], "seed": 1.5}, r"^seed must be an integer, got 1.5 \(float\)$"),
    ({"labels": [0], "progress": "yes"}, r"^progress must be True or False"),
])
def test_api_bad_arguments_name_the_argument(digits: lantern.Pipeline, kwargs: dict, message: str) -> None:
    with pytest.raises(LanternError, match=message):
        digits(**kwargs)


def test_api_takes_integer_arrays_as_labels(digits: lantern.Pipeline) -> None:
    """A 1-D integer numpy array or tensor is a list of labels (documented on Pipeline.__call__)."""
    expected = digits(labels=[1, 2], seed=3, temperature=0.0).codes
    for labels in (np.array([1, 2]), np.array([1, 2], dtype=np.int32), torch.tensor([1, 2]), (np.int64(1), 2)):
        assert torch.equal(digits(labels=labels, seed=3, temperature=0.0).codes, expected)
    assert isinstance(LanternError("x"), ValueError)  # one class to catch, wrong types included


def test_api_prompts_must_be_a_list_of_strings(tmp_path: Path) -> None:
    folder = make_tiny_chameleon_folder(tmp_path / "cham")
    pipe = lantern.load(folder)
    with pytest.raises(LanternError, match=r"^prompts: expected a list of strings, got one string 'a cat'"):
        pipe(prompts="a cat")
    with pytest.raises(LanternError, match=r"^prompts\[1\]: expected a string, got int 3$"):
        pipe(prompts=["a cat", 3])


@pytest.mark.parametrize(("auto_map", "why"), [
    ({"AutoTokenizer": ["custom.Tokenizer", None]}, "asks to run the folder's own Python code"),
    ("custom.Tokenizer", "AttributeError: 'str' object has no attribute 'get'"),
])
def test_load_refuses_a_folder_whose_tokenizer_config_asks_for_its_own_code(
        tmp_path: Path, auto_map: object, why: str) -> None:
    folder = Path(make_tiny_chameleon_folder(tmp_path / "cham"))
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config.pop("tokenizer_class", None)  # else transformers uses the named class and ignores auto_map
    config["auto_map"] = auto_map
    config_file.write_text(json.dumps(config))
    with pytest.raises(LanternError) as e:
        lantern.load(folder)
    assert str(e.value).startswith(f"--model {folder}: no usable tokenizer")
    assert why in str(e.value) and "\n" not in str(e.value)
