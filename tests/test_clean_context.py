"""Clean-context credit (``RelaxationConfig.credit = "clean"``, ``--lantern-credit clean``).

A Jacobi redraw was conditioned on the old window: the guesses accepted that round, the one
rejected guess, and the old guesses at the open positions before it. The relaxed test credits it
only when those old open guesses are the tokens its test will see (every redraw before it in the
new window kept the guess it replaced) and the rejected guess was itself drawn by a model; any
other draft is tested exactly. The laws are computed by exact enumeration, as in
tests/test_drawn_guesses.py: the test of one draft uses one uniform, and a grid of G midpoints
reproduces its acceptance probability to within 1/G (the drafts before it get u = 0: accepted).

The scenario (window 3, 5 tokens, a 4 x 4 image; every forward's p a point mass, so the redraws
are known):
  round 1  window [1, 1, 1] (fills); slot 0 rejected.
  round 2  window [3, 0, 4] (redraws, conditioned on the rejected fill): none clean; slot 0 rejected.
  round 3  window [0, 0, 0]: slot 0 clean (the rejected guess was drawn), slot 1 clean (the redraw
           at position 3 kept the old guess 0, which slot 1's draft saw), slot 2 not clean (its
           draft saw the old guess 4 at position 4, which the redraw replaced by 0).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import assert_rows_independent, cached_stack, generate_jacobi
from torch import Tensor

from lantern.decoding.acceptance import clean_context
from lantern.decoding.config import JacobiConfig, PJDConfig, RelaxationConfig, SamplingConfig
from lantern.decoding.jacobi import JacobiDrafter
from lantern.decoding.loop import Acceptance, DraftTree, _accept
from lantern.decoding.pjd import GridJacobiDrafter
from lantern.decoding.rng import RowRandom
from lantern.errors import LanternError
from lantern.methods import MethodConfig
from lantern.run import run_generation
from lantern.testing import make_random_stack, tiny_llamagen

V = 5
P = torch.tensor([0.10, 0.30, 0.20, 0.15, 0.25])  # the target at every position of round 3
NEIGHBOURS = torch.tensor([[2, 3, 1, 4], [0, 2, 3, 4], [0, 1, 3, 4], [0, 1, 2, 4], [0, 1, 2, 3]])
# Token 0: p = 0.1; its nearest neighbour (token 2, 0.2) fits both bounds, the next (3, +0.15) neither,
# so the relaxed credit is p~(0) = 0.3 under both rules (drafts are point masses: acceptance = p~).
RULES = {"lantern": RelaxationConfig(k=4, delta=0.25, mode="absolute"),
         "lantern++": RelaxationConfig(k=4, lam=4.0, mode="relative")}
EXACT, RELAXED = 0.1, 0.3
G = 1000  # grid points for the tested draft's uniform: probabilities exact to within 1 / G
SAMPLED = SamplingConfig(temperature=1.0)


def _point_logits(argmax: list[int]) -> Tensor:
    """[1, len, V] logits whose p is a point mass at each node's ``argmax`` (redraws are then known)."""
    logits = torch.full((1, len(argmax), V), -1e4)
    logits[0, torch.arange(len(argmax)), torch.tensor(argmax)] = 0.0
    return logits


def _round(drafter: JacobiDrafter, rng: RowRandom, argmax: list[int], follow: list[int]) -> DraftTree:
    """Propose, then verify with point-mass predictions ``argmax`` (node j) and commit ``follow``."""
    tree = drafter.propose(rng, torch.tensor([True]), torch.tensor([3]))
    drafter.observe_verify(_point_logits(argmax))
    drafter.commit(torch.zeros(1, 4, 1), torch.tensor([follow + [0] * (4 - len(follow))]), torch.tensor([len(follow)]))
    return tree


def _scenario() -> list[DraftTree]:
    """The module docstring's rounds 1-4 (round 4: slot 0 accepted, slot 1 rejected)."""
    drafter = JacobiDrafter(JacobiConfig(window=3, init="repeat_horizon"), SAMPLED, V, 16)
    rng = RowRandom.from_seeds([0], torch.device("cpu"))
    drafter.start(torch.zeros(1, 1, 1), torch.tensor([1]))
    trees = [_round(drafter, rng, [0, 3, 0, 4], [2])]  # positions 2, 3, 4 redrawn as 3, 0, 4
    trees.append(_round(drafter, rng, [0, 0, 0, 0], [1]))  # positions 3, 4, 5 redrawn as 0, 0, 0
    trees.append(_round(drafter, rng, [0, 0, 0, 1], [0, 2]))  # accept 0 at 3, recover 2 at 4; 5 -> 0, 6 -> 1
    trees.append(drafter.propose(rng, torch.tensor([True]), torch.tensor([3])))
    return trees


def test_clean_context_table() -> None:
    """The pure rule. Fails if the rejected guess's law, the kept redraws or the first open
    position were read wrongly (each row below changes one of them)."""
    same = torch.tensor([[True, True, False, True]] * 4)
    first_open = torch.tensor([0, 1, 0, 3])
    rejected_drawn = torch.tensor([True, True, False, True])
    assert clean_context(same, first_open, rejected_drawn).tolist() == [
        [True, True, True, False],  # kept at 0 and 1, changed at 2: predictions up to 2 are clean
        [False, True, True, False],  # prediction 0's position is decided
        [False, False, False, False],  # the rejected guess was a fill
        [False, False, False, True],  # only prediction 3 is open; what came before is accepted
    ]


def test_sjd_marks_clean_drafts() -> None:
    """SJD's window flags through the scenario. Fails if a redraw after a rejected fill, or one
    whose context guess was replaced, were marked clean, or a kept context were not."""
    trees = _scenario()
    assert [t.relaxable.tolist() for t in trees] == [[[True, False, False, False]], [[True] * 4], [[True] * 4],
                                                     [[True, True, True, False]]]
    assert [t.clean.tolist() for t in trees] == [[[True, False, False, False]], [[True, False, False, False]],
                                                 [[True, True, True, False]], [[True, True, True, False]]]
    assert trees[2].tokens.tolist() == [[1, 0, 0, 0]] and trees[3].tokens.tolist() == [[2, 0, 1, 1]]


def _acceptance_of(tree: DraftTree, slot: int, relax: RelaxationConfig) -> float:
    """P(the draft at window ``slot`` is accepted | the drafts before it were), by the loop's own
    acceptance (``loop._accept``, which picks the credited nodes) over a grid of uniforms."""
    u = torch.zeros(G, 5)
    u[:, slot + 1] = (torch.arange(G) + 0.5) / G  # column n tests node n; earlier drafts get u = 0
    u[:, slot + 2 :] = 1.0 - 0.5 / G  # later drafts fail: only this draft's outcome is counted

    class Fixed:  # the rows' random streams, replaced by the grid
        def uniform(self, n: int) -> Tensor:
            assert n == 5
            return u

    from lantern.decoding.trees import tree_from_parents

    grid = DraftTree(tokens=tree.tokens.expand(G, -1), q_draft=tree.q_draft.expand(G, -1, -1),
                     buffers=tree_from_parents(torch.arange(-1, 3)[None].expand(G, -1).contiguous()),
                     relaxable=tree.relaxable.expand(G, -1), clean=tree.clean.expand(G, -1))
    logits = P.log().expand(G, 4, V)
    num_acc = _accept(logits, grid, torch.full((G,), 3), torch.ones(G, dtype=torch.bool), SAMPLED,
                      Fixed(), Acceptance(relax, NEIGHBOURS)).num_accepted  # type: ignore[arg-type]
    assert bool((num_acc >= slot).all())  # every earlier draft passed
    return (num_acc > slot).double().mean().item()


@pytest.mark.parametrize("rule", sorted(RULES))
def test_a_draft_conditioned_on_an_unseen_guess_is_tested_exactly(rule: str) -> None:
    """(a) Round 3's slot 2 was drawn from a prediction that saw the old guess 4 at position 4; its
    test sees 0 there. Under clean credit it is accepted with exactly p(x) = 0.1. Fails if the
    loop credited drawn drafts whatever their context."""
    tree = _scenario()[2]
    clean = RelaxationConfig(**{**RULES[rule].to_dict(), "credit": "clean"})
    assert abs(_acceptance_of(tree, 2, clean) - EXACT) <= 1.0 / G


@pytest.mark.parametrize("rule", sorted(RULES))
def test_a_clean_draft_gets_the_relaxed_credit(rule: str) -> None:
    """(b) Round 3's slots 0 and 1 have clean contexts: accepted with min(1, p~(x) / q(x)) = 0.3.
    Fails if clean credit withheld the relaxation from them too (e.g. a flag that is never set)."""
    tree = _scenario()[2]
    clean = RelaxationConfig(**{**RULES[rule].to_dict(), "credit": "clean"})
    for slot in (0, 1):
        assert abs(_acceptance_of(tree, slot, clean) - RELAXED) <= 1.0 / G, slot


@pytest.mark.parametrize("rule", sorted(RULES))
def test_power_the_rule_changes_the_acceptance(rule: str) -> None:
    """(c) The same draft (round 3, slot 2) under drawn-only credit is accepted with 0.3, under
    clean credit with 0.1: the enumeration tells them apart by 0.2 (20 times its 1/G resolution).
    Fails if the credit setting did not reach the test."""
    tree = _scenario()[2]
    drawn = _acceptance_of(tree, 2, RULES[rule])
    clean = _acceptance_of(tree, 2, RelaxationConfig(**{**RULES[rule].to_dict(), "credit": "clean"}))
    assert drawn - clean >= RELAXED - EXACT - 2.0 / G


def test_pjd_marks_clean_drafts() -> None:
    """PJD (one chain: context = the row) through the same rounds: the flags match SJD's. Fails if
    ``clean_root`` were not set from the rejected guess's cell, or not matched to the chain's root."""
    drafter = GridJacobiDrafter(PJDConfig(window=3, context=4, init="row_above"), SAMPLED, V, 16, width=4)
    rng = RowRandom.from_seeds([0], torch.device("cpu"))
    drafter.start(torch.zeros(1, 1, 1), torch.tensor([1]))
    cleans = []
    for argmax, follow in (([0, 3, 0, 4], 2), ([0, 0, 0, 0], 1)):
        block = drafter.propose_grid(rng)
        cleans.append(block.clean.tolist())
        drafter.commit_grid(block, torch.tensor([[0]]), torch.tensor([[follow]]), _point_logits(argmax), rng)
    block = drafter.propose_grid(rng)
    assert block.tokens.tolist() == [[1, 0, 0, 0]] and block.relaxable.tolist() == [[True] * 4]
    assert [*cleans, block.clean.tolist()] == [[[True, False, False, False]], [[True, False, False, False]],
                                               [[True, True, True, False]]]


def test_the_setting_resolves_and_is_refused_where_it_means_nothing() -> None:
    """``lantern_credit`` reaches the rule; exact methods, GSD and unknown values refuse it."""
    assert MethodConfig.resolve("sjd-coupled-lantern", lantern_credit="clean").relaxation.credit == "clean"
    assert MethodConfig.resolve("pjd-lantern++").relaxation.credit == "drawn"  # the default is unchanged
    for method, value in (("sjd-coupled", "clean"), ("gsd", "clean"), ("sjd-lantern", "all")):
        with pytest.raises(LanternError) as e:
            MethodConfig.resolve(method, lantern_credit=value)
        assert e.value.field == "lantern_credit", method


# ---- the real loop ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def random_stack(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_random_stack(tmp_path_factory.mktemp("clean") / "random", seed=4)


@pytest.mark.parametrize("method,settings", [
    ("sjd-coupled-lantern", {"lantern_delta": 0.0, "sjd_window": 4}),
    ("pjd-lantern++", {"lantern_lambda": 1.0, "pjd_window": 3, "pjd_context": 8}),
])
def test_greedy_with_clean_credit_reproduces_ar(random_stack: Path, method: str, settings: dict) -> None:
    """Greedy decoding with clean credit on and a bound that moves no mass (delta 0, lambda 1; a
    moving bound is lossy by design) gives greedy AR token for token, in a batch of 3 with CFG.
    Fails if computing the flags disturbed the window (tokens, random streams) or a shape."""
    stack = cached_stack(str(random_stack))
    s = SamplingConfig(temperature=0.0, cfg_scale=3.0)
    ar = run_generation(stack, [0, 3, 7], 0, s, MethodConfig.resolve("ar"), 3).codes
    config = MethodConfig.resolve(method, lantern_credit="clean", **settings)
    assert torch.equal(run_generation(stack, [0, 3, 7], 0, s, config, 3).codes, ar)


class _Recording(JacobiDrafter):
    """SJD, keeping every proposal's (drawn, clean) node flags."""

    seen: list[tuple[Tensor, Tensor]] = []

    def propose(self, rng: RowRandom | None, active: Tensor, max_depth: Tensor) -> DraftTree:
        tree = super().propose(rng, active, max_depth)
        assert tree.relaxable is not None and tree.clean is not None
        _Recording.seen.append((tree.relaxable.clone(), tree.clean.clone()))
        return tree


def test_rows_independent_of_batch_and_the_credit_is_taken() -> None:
    """Sampled coupled SJD with LANTERN's delta and clean credit: a row gives the same codes alone
    and in a batch of 3, and the relaxed test did credit drafts (``relaxed_accepts``). A real run
    marks clean drafts beyond each window's first slot (kept redraws) and drawn ones that are not
    clean, never a clean one that was not drawn. Fails if the flags read a batch-mate's state, or
    were never (or always) set."""
    model = tiny_llamagen(seed=7)
    s = SamplingConfig(temperature=1.0, top_k=20, cfg_scale=2.0)
    nbr = torch.stack([torch.roll(torch.arange(256), -i)[1:65] for i in range(256)])
    acceptance = Acceptance(RelaxationConfig(k=8, delta=0.2, credit="clean"), nbr)
    config = JacobiConfig(8, "repeat_horizon", "maximal")
    batch = assert_rows_independent(model, s, config, acceptance)
    assert batch.stats.relaxed_accepts > 0
    _Recording.seen = []
    generate_jacobi(model, torch.tensor([4]), s, config, [1], drafter_cls=_Recording, acceptance=acceptance)
    drawn, clean = (torch.cat(flags) for flags in zip(*_Recording.seen, strict=True))  # [rounds, L + 1]
    assert not bool((clean & ~drawn).any())
    assert bool(clean[:, 2:].any())  # a kept redraw made a later slot clean
    assert bool((drawn & ~clean)[:, 1:].any())  # a drawn draft that saw a replaced guess
