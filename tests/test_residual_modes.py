"""``--lantern-residual``: the paper's residual and the released codes' (official, official-lumina)
through MethodConfig, load_acceptance and ``lantern generate`` on the embedded digits preset."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from lantern.cli.main import main
from lantern.errors import LanternError
from lantern.methods import MethodConfig
from lantern.parts import ModelParts
from lantern.run import load_acceptance
from lantern.targets.llamagen_stack import load_stack
from lantern.targets.proximity import ProximityTable

RESIDUALS = ("paper", "official", "official-lumina")


def test_official_residuals_take_k_plus_one_columns() -> None:
    stack = load_stack("digits")
    table = ProximityTable.load(stack.proximity_file)
    parts = ModelParts(stack)  # the table, read once and checked against the codebook
    for residual, extra in (("paper", 0), ("official", 1), ("official-lumina", 1)):
        method = MethodConfig.resolve("lantern", tree="chain:2", lantern_k=8, lantern_residual=residual)
        acceptance, resolved = load_acceptance(method, parts)
        assert resolved.relaxation is not None and resolved.relaxation.residual == residual
        assert acceptance.neighbours is not None and acceptance.neighbours.shape == (table.vocab_size, 8 + extra)
        assert torch.equal(acceptance.neighbours, table.neighbours[:, : 8 + extra].long())
    # the default k (1000) is capped so that k+1 columns still fit
    _, capped = load_acceptance(MethodConfig.resolve("lantern", lantern_residual="official"), parts)
    assert capped.relaxation is not None and capped.relaxation.k == table.k_max - 1
    explicit = MethodConfig.resolve("lantern", lantern_k=table.k_max, lantern_residual="official")
    with pytest.raises(LanternError, match=rf"removes k\+1 = {table.k_max + 1} neighbours.*K_max = {table.k_max}"):
        load_acceptance(explicit, parts)


def test_residual_needs_a_relaxed_method() -> None:
    with pytest.raises(LanternError, match="--lantern-residual needs a relaxed method .*, got --method sd$"):
        MethodConfig.resolve("sd", lantern_residual="official")
    with pytest.raises(LanternError, match="--lantern-residual must be one of paper, official, official-lumina"):
        MethodConfig.resolve("lantern", lantern_residual="released")


def _generate(tmp_path: Path, residual: str, *extra: str) -> tuple[np.ndarray, dict]:
    out = tmp_path / f"{residual}{'-'.join(extra)}"
    assert main(["generate", "--model", "digits", "--labels", "3,7", "--method", "lantern", "--lantern-k", "8",
                 "--lantern-residual", residual, "--seed", "1", "--out", str(out), "--no-progress", *extra]) == 0
    return np.load(out / "codes.npy"), json.loads((out / "run.json").read_text())


@pytest.mark.slow
def test_each_residual_runs_end_to_end_and_differs_only_when_relaxed(tmp_path: Path) -> None:
    stack = load_stack("digits")
    size, vocab = stack.target.config.block_size, stack.target.config.vocab_size
    codes = {}
    for residual in RESIDUALS:
        codes[residual], run = _generate(tmp_path, residual)
        assert run["method"]["relaxation"]["residual"] == residual and run["method"]["relaxation"]["k"] == 8
        assert codes[residual].shape == (2, size) and codes[residual].min() >= 0 and codes[residual].max() < vocab
    # After a rejection each mode samples from another residual, so the images differ ...
    assert (codes["paper"] != codes["official"]).any() and (codes["official"] != codes["official-lumina"]).any()
    # ... but with delta = 0 nothing is relaxed, the rule is exact and the mode is never consulted.
    exact = [_generate(tmp_path, residual, "--lantern-delta", "0")[0] for residual in ("paper", "official")]
    assert np.array_equal(exact[0], exact[1])
