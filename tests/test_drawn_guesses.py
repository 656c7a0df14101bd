"""Only drafts drawn from a model distribution get a relaxed rule's credit.

A Jacobi initial guess (SJD / PJD ``random`` or ``repeat_horizon`` fill) was never drawn from any
model: its q is a point mass. LANTERN's relaxed test would accept it with up to p(x) + δ (or λ·p(x)),
so uniform noise would enter the image at more than its probability (pjd-lantern's FID 5.5 against
AR's 1.2). The rule: such a guess (``relaxable`` False) is tested exactly, so it is accepted with
exactly p(x), and the token emitted at its position follows p exactly.

The laws here are computed by exact enumeration, not sampling: the test and the residual draw each
use one uniform, and a grid of G midpoints per uniform reproduces every probability to within 1/G.
"""

from __future__ import annotations

import pytest
import torch

from lantern.decoding.acceptance import verify_chain_sampled, verify_tree_sampled
from lantern.decoding.config import RelaxationConfig
from lantern.decoding.greedy import verify_tree_greedy
from lantern.decoding.trees import tree_from_parents

P = torch.tensor([0.10, 0.30, 0.20, 0.15, 0.25], dtype=torch.float64)  # target at the guess's position
X = 0  # the guess: p(x) = 0.1; its nearest neighbour (token 2, mass 0.2) fits every bound below
NEIGHBOURS = torch.tensor([[2, 3, 1, 4], [0, 2, 3, 4], [0, 1, 3, 4], [0, 1, 2, 4], [0, 1, 2, 3]])
RULES = {
    "lantern": RelaxationConfig(k=4, delta=0.25, mode="absolute"),
    "lantern++": RelaxationConfig(k=4, lam=4.0, mode="relative"),
    "lantern/token": RelaxationConfig(k=4, delta=0.25, mode="absolute", budget="token"),
    "lantern++/token": RelaxationConfig(k=4, lam=4.0, mode="relative", budget="token"),
    "lantern/official": RelaxationConfig(k=3, delta=0.25, mode="absolute", residual="official"),
}
G = 400  # grid points per uniform: frequencies are exact to within 1 / G
# The tree verifier equals the chain one on chains (tests/test_acceptance.py): its runs are the slow tier.
VERIFIES = ["chain", pytest.param("tree", marks=pytest.mark.slow)]


def _grid_chain(relaxable: bool, relaxation: RelaxationConfig, verify: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(accepted [G*G] bool, first emitted token [G*G]) of the chain [root, x] over a G x G grid of
    (test uniform, residual uniform)."""
    mid = (torch.arange(G, dtype=torch.float64) + 0.5) / G
    u_test, u_last = (t.reshape(-1) for t in torch.meshgrid(mid, mid, indexing="ij"))
    b = u_test.shape[0]
    p_target = P.expand(b, 2, -1).contiguous()
    tokens = torch.tensor([[1, X]]).expand(b, -1)
    q = torch.zeros(b, 2, P.shape[0], dtype=torch.float64)
    q[:, 0, X] = 1.0  # the guess's law: a point mass (it was written, not drawn)
    uniforms = torch.stack([torch.zeros(b, dtype=torch.float64), u_test, u_last], dim=1)
    drawn = torch.tensor([[True, relaxable]]).expand(b, -1)
    max_depth = torch.ones(b, dtype=torch.long)
    if verify == "chain":
        res = verify_chain_sampled(p_target, tokens, max_depth, uniforms, q, NEIGHBOURS, relaxation, relaxable=drawn)
    else:
        buffers = tree_from_parents(torch.tensor([[-1, 0]]).expand(b, -1).contiguous())
        res = verify_tree_sampled(p_target, tokens, buffers.children, buffers.depth, max_depth, uniforms, q_draft=q,
                                  neighbours=NEIGHBOURS, relaxation=relaxation, relaxable=drawn)
    accepted = res.num_accepted == 1
    return accepted, torch.where(accepted, X, res.next_token)


@pytest.mark.parametrize("verify", VERIFIES)
@pytest.mark.parametrize("rule", sorted(RULES))
def test_an_undrawn_guess_is_accepted_with_exactly_p(rule: str, verify: str) -> None:
    accepted, emitted = _grid_chain(relaxable=False, relaxation=RULES[rule], verify=verify)
    assert abs(accepted.double().mean().item() - P[X].item()) <= 1.0 / G
    law = torch.bincount(emitted, minlength=P.shape[0]).double() / emitted.shape[0]
    assert torch.allclose(law, P, atol=2.0 / G), (rule, law)


@pytest.mark.parametrize("verify", VERIFIES)
@pytest.mark.parametrize("rule", sorted(RULES))
def test_power_the_same_guess_drawn_is_credited(rule: str, verify: str) -> None:
    """Power check: had the guess been drawn (relaxable), the relaxed rule accepts it measurably
    more often than p(x), and the emitted law leaves p: the exact test above is what changed it."""
    accepted, emitted = _grid_chain(relaxable=True, relaxation=RULES[rule], verify=verify)
    assert accepted.double().mean().item() > P[X].item() + 0.05
    law = torch.bincount(emitted, minlength=P.shape[0]).double() / emitted.shape[0]
    assert (law - P).abs().max().item() > 0.05


def test_greedy_an_undrawn_guess_must_be_the_argmax() -> None:
    """Greedy relaxed verification accepts a non-argmax token whose neighbours lift it above the
    argmax; an undrawn guess is held to the exact argmax instead."""
    logits = torch.log(torch.tensor([0.28, 0.30, 0.20, 0.07, 0.15]))[None, None].expand(1, 2, -1)
    retrieve = tree_from_parents(torch.tensor([[-1, 0]])).retrieve  # [1, P, D+1]: the chain [root, x]
    tokens = torch.tensor([[1, X]])
    relax = RelaxationConfig(k=4, delta=0.25, mode="absolute")
    common = dict(max_depth=torch.tensor([1]), neighbours=NEIGHBOURS, relaxation=relax)
    drawn = verify_tree_greedy(logits, tokens, retrieve, relaxable=torch.tensor([[True, True]]), **common)
    undrawn = verify_tree_greedy(logits, tokens, retrieve, relaxable=torch.tensor([[True, False]]), **common)
    assert drawn.num_accepted.item() == 1 and drawn.num_relaxed.item() == 1  # credited: 0.28 + 0.20 > 0.30
    assert undrawn.num_accepted.item() == 0 and undrawn.next_token.item() == 1  # the exact argmax follows


def test_sjd_marks_its_initial_guesses_undrawn() -> None:
    """SJD's window: carried guesses (redrawn from the target's last prediction) are drawn, the
    slots initialised this round are not: the first round's whole window, then the new tail."""
    from lantern.decoding.config import JacobiConfig, SamplingConfig
    from lantern.decoding.jacobi import JacobiDrafter
    from lantern.decoding.rng import RowRandom

    drafter = JacobiDrafter(JacobiConfig(window=4, init="random"), SamplingConfig(temperature=1.0), 8, 16)
    rng = RowRandom.from_seeds([3, 4], torch.device("cpu"))
    drafter.start(torch.zeros(2, 1, 1), torch.tensor([1, 2]))
    first = drafter.propose(rng, torch.tensor([True, True]), torch.tensor([4, 4]))
    assert first.relaxable is not None and first.relaxable.tolist() == [[True, False, False, False, False]] * 2
    drafter.observe_verify(torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(0)))
    drafter.commit(torch.zeros(2, 5, 1), torch.tensor([[5, 6, 0, 0, 0], [5, 0, 0, 0, 0]]), torch.tensor([2, 1]))
    second = drafter.propose(rng, torch.tensor([True, True]), torch.tensor([4, 4]))
    # row 0 kept 2 tokens: slots 0-2 carried over, slot 3 new; row 1 kept 1: slots 0-3 carried over
    assert second.relaxable is not None
    assert second.relaxable.tolist() == [[True, True, True, True, False], [True, True, True, True, True]]
