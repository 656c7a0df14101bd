"""Grouped speculative decoding (GSD, ``--method gsd``): a relaxation mode of the acceptance rules.

Evidence: the dynamic group by hand (rank window, probability gap, support); one GSD test
computed exactly on a grid of uniforms (accept with min(1, p(G)/q(G)), else the exact residual);
the chain verifier equals the general tree walk under the group rule (test_acceptance.py);
greedy GSD; GSD accepts more than exact SJD on the same model; no proximity table is needed;
batch independence; CLI and bad options.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import assert_rows_independent
from torch import Tensor

from lantern.cli.main import main
from lantern.decoding.acceptance import GSD_PROB_GAP, group_mask, relaxed_mass, verify_chain_sampled
from lantern.decoding.config import JacobiConfig, RelaxationConfig, SamplingConfig
from lantern.decoding.loop import Acceptance
from lantern.errors import LanternError
from lantern.methods import MethodConfig
from lantern.run import run_generation
from lantern.targets.llamagen_stack import load_stack
from lantern.testing import make_random_stack, tiny_llamagen

F64 = torch.float64
P = torch.tensor([0.30, 0.05, 0.12, 0.20, 0.25, 0.08], dtype=F64)  # ranks: 0, 4, 3, 2, 5, 1 (no ties)
Q = torch.tensor([0.05, 0.30, 0.30, 0.05, 0.25, 0.05], dtype=F64)


def group(x: int, width: int, p: Tensor = P) -> set[int]:
    mask = group_mask(p[None], torch.tensor([x]), width)[0]
    return set(mask.nonzero().flatten().tolist())


def test_group_by_hand() -> None:
    """G(x): the tokens ranked within ``width`` places of x whose probability differs from p(x)
    by less than 0.15; x itself always; nothing a zero-probability x could borrow."""
    assert GSD_PROB_GAP == 0.15
    assert group(3, 0) == {3}
    assert group(3, 1) == {4, 3, 2}  # ranks 1..3
    assert group(3, 2) == {0, 4, 3, 2, 5}  # ranks 0..4, all within 0.15 of 0.20
    assert group(1, 2) == {2, 5, 1}  # ranks 3..5
    assert group(0, 3) == {0, 4, 3}  # rank 3 (token 2, 0.12) is 0.18 away from 0.30: left out
    sparse = torch.tensor([0.35, 0.3, 0.25, 0.0, 0.0, 0.0], dtype=F64)  # top-k 3
    assert group(2, 3, sparse) == {0, 1, 2}  # zero-probability tokens never join
    assert group(4, 3, sparse) == {4}  # and a draft p cannot produce borrows nothing
    p_tilde, members = relaxed_mass(P[None], torch.tensor([3]), None, RelaxationConfig(k=2, mode="group"))
    assert float(p_tilde) == pytest.approx(0.95) and int(members) == 4


GRID = 4000


def _one_test(x: int, q: Tensor | None, cfg: RelaxationConfig) -> tuple[float, Tensor]:
    """(acceptance probability, law of the token emitted after a rejection) of one chain test of
    draft x against P, over a grid of uniforms (exact up to 1 / GRID)."""
    u_test = (torch.arange(GRID, dtype=F64) + 0.5) / GRID
    p = P.expand(GRID, 2, 6)
    tokens = torch.tensor([[0, x]]).expand(GRID, 2)
    q_draft = None if q is None else q.expand(GRID, 2, 6)
    u_next = (u_test * 997) % 1  # the next token's uniform: ~uniform on any interval of u_test
    u = torch.stack([torch.zeros(GRID, dtype=F64), u_test, u_next], dim=1)
    res = verify_chain_sampled(p, tokens, torch.full((GRID,), 1), u, q_draft, None, cfg)
    accepted = res.num_accepted.bool()
    after = torch.bincount(res.next_token[~accepted], minlength=6).double()
    return float(accepted.double().mean()), after / after.sum()


@pytest.mark.parametrize(
    ("x", "width", "q"), [(1, 2, "sampled"), (2, 1, "sampled"), (1, 2, "one-hot"), (5, 1, "one-hot")]
)
def test_one_gsd_test_exactly(x: int, width: int, q: str) -> None:
    """Accept with min(1, p(G)/q(G)); after a rejection the next token follows the exact residual
    norm(max(p - q, 0)) (GSD's released code), here on a grid of uniforms."""
    q_draft = Q if q == "sampled" else torch.nn.functional.one_hot(torch.tensor(x), 6).double()
    members = sorted(group(x, width))
    expected = min(1.0, float(P[members].sum() / q_draft[members].sum()))
    rate, after = _one_test(x, q_draft, RelaxationConfig(k=width, mode="group"))
    assert rate == pytest.approx(expected, abs=2 / GRID)
    exact_rate, _ = _one_test(x, q_draft, RelaxationConfig(k=0, mode="group"))  # width 0: the exact rule
    assert exact_rate == pytest.approx(min(1.0, float(P[x] / q_draft[x])), abs=2 / GRID)
    assert rate > exact_rate
    if expected < 1:
        residual = (P - q_draft).clamp(min=0)
        assert torch.allclose(after, residual / residual.sum(), atol=0.02)


# ---- through the loop -------------------------------------------------------------------------


@pytest.mark.slow
def test_gsd_accepts_more_than_sjd() -> None:
    """Same model, seeds and window: grouped acceptance decides more tokens per forward (measured
    on the digits preset: 2.22 exact SJD, 2.70 with G = 3, 2.92 with G = 7)."""
    stack = load_stack("digits")
    s = SamplingConfig(**stack.default_sampling())
    taus = {m: run_generation(stack, [0, 1], 0, s, MethodConfig.resolve(m, gsd_group=g),
                              2).stats_dict()["mean_accepted"]
            for m, g in (("sjd", None), ("gsd", 3), ("gsd", 7))}
    assert taus["gsd"] > taus["sjd"] + 0.3


@pytest.mark.slow
def test_greedy_gsd_is_lossy_but_decodes() -> None:
    """Greedy GSD accepts a draft whose group outweighs the argmax, so its codes leave AR's
    (measured: 26 % of the codes agree on digits); every code is a real token."""
    stack = load_stack("digits")
    s = SamplingConfig(**{**stack.default_sampling(), "temperature": 0.0})
    ar = run_generation(stack, [0, 1], 0, s, MethodConfig.resolve("ar"), 2)
    gsd = run_generation(stack, [0, 1], 0, s, MethodConfig.resolve("gsd"), 2)
    assert bool((gsd.codes >= 0).all()) and bool((gsd.codes < stack.target.config.vocab_size).all())
    assert not torch.equal(gsd.codes, ar.codes)
    assert gsd.stats_dict()["mean_accepted"] > 2.0


def test_gsd_rows_independent_of_batch() -> None:
    model = tiny_llamagen(seed=7)
    s = SamplingConfig(temperature=1.0, top_k=20, cfg_scale=2.0)
    batch = assert_rows_independent(model, s, JacobiConfig(8), Acceptance(RelaxationConfig(k=4, mode="group")))
    assert batch.stats.relaxed_accepts > 0  # the group rule did accept what the exact rule would not


def test_gsd_needs_no_proximity_table(tmp_path: Path) -> None:
    root = make_random_stack(tmp_path / "random", seed=2)
    bare = tmp_path / "bare"
    bare.mkdir()
    for part in ("target", "tokenizer"):
        (bare / part).symlink_to(root / part)
    out = run_generation(load_stack(bare), [0], 0, SamplingConfig(), MethodConfig.resolve("gsd", sjd_window=4))
    assert out.codes.shape == (1, 64) and out.method.relaxation == RelaxationConfig(k=7, mode="group")


def test_cli_generate_gsd(tmp_path: Path) -> None:
    out = tmp_path / "out"
    rc = main(["generate", "--model", "digits", "--labels", "3", "--method", "gsd", "--gsd-group", "4",
               "--out", str(out), "--no-progress"])
    assert rc == 0
    run = json.loads((out / "run.json").read_text())
    assert run["method"]["relaxation"]["mode"] == "group" and run["method"]["relaxation"]["k"] == 4
    assert run["method"]["jacobi"]["coupling"] == "independent"


def test_gsd_takes_a_coupling() -> None:
    """GSD's own SJD redraws independently; coupled redraws (SCD) combine with its grouped rule."""
    assert MethodConfig.resolve("gsd").jacobi == JacobiConfig(coupling="independent")
    gumbel = MethodConfig.resolve("gsd", sjd_coupling="gumbel", gsd_group=3)
    assert gumbel.jacobi == JacobiConfig(coupling="gumbel") and gumbel.relaxation == RelaxationConfig(k=3, mode="group")
    with pytest.raises(LanternError, match=r"--sjd-coupling must be one of independent, maximal, gumbel, got 'max'"):
        MethodConfig.resolve("gsd", sjd_coupling="max")


def test_bad_group_configs() -> None:
    with pytest.raises(LanternError, match=r"lantern delta is only used with mode='absolute'"):
        RelaxationConfig(k=3, delta=0.1, mode="group")
    with pytest.raises(LanternError, match=r"lantern lambda is only used with mode='relative'"):
        RelaxationConfig(k=3, lam=2.0, mode="group")
    with pytest.raises(LanternError, match=r"the group rule \(GSD\) has no 'official' residual"):
        RelaxationConfig(k=3, mode="group", residual="official")
    with pytest.raises(LanternError, match=r"relaxation mode must be 'absolute', 'relative' or 'group'"):
        RelaxationConfig(mode="grouped")  # type: ignore[arg-type]
    assert RelaxationConfig(k=0, mode="group").is_exact and not RelaxationConfig(k=1, mode="group").uses_table
