"""SJD-SV: subsequence verification (``lantern.decoding.subsequence``, arXiv 2609.13245).

The rule does not reduce to greedy acceptance at temperature 0 (a run's untested head is kept
whatever it holds: shown below), so the acceptance is checked against a direct, loop-based
implementation of the paper's formula on random inputs, value for value: the partition into runs
of non-decreasing confidence, the high-confidence tail (the largest g with
sum_{g..e} p >= alpha * sum_{b..e} p), one uniform per run tested against min(1, prod of the
tail's ratios), and the fallback to shorter tails. Then the chain verifier and the greedy one
around it, the loop, batch independence and the settings.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from conftest import assert_rows_independent, cached_stack
from torch import Tensor

from lantern.calibration import MethodCalibration
from lantern.decoding.acceptance import verify_chain_sampled
from lantern.decoding.config import DEFAULT_SV_ALPHA, JacobiConfig, RelaxationConfig, SamplingConfig, SubsequenceConfig
from lantern.decoding.greedy import verify_chain_greedy_subsequence, verify_tree_greedy
from lantern.decoding.loop import Acceptance
from lantern.decoding.sampling import sample_from_probs
from lantern.decoding.subsequence import subsequence_accepted
from lantern.decoding.trees import tree_from_parents
from lantern.errors import LanternError
from lantern.methods import METHOD_TABLE, MethodConfig, method_names, resolve_method
from lantern.run import run_generation
from lantern.testing import make_random_stack, tiny_llamagen

SV = ("sjd-sv", "sjd-coupled-sv", "sjd-lantern-sv", "sjd-coupled-lantern-sv", "gsd-sv")


# ---- the paper's rule, one draft at a time ------------------------------------------------------


def _runs(conf: list[float], joinable: list[bool]) -> list[tuple[int, int]]:
    """Maximal runs (first, last) of non-decreasing confidence; a draft that may not join is alone."""
    runs, first = [], 0
    for i in range(1, len(conf) + 1):
        if i == len(conf) or not (joinable[i] and joinable[i - 1]) or conf[i] < conf[i - 1]:
            runs.append((first, i - 1))
            first = i
    return runs


def reference_accepted(conf: list[float], ratio: list[float], member: list[bool], usable: list[bool],
                       u: list[float], alpha: float) -> int:
    """How many drafts SJD-SV accepts, written as the paper states it, loop by loop."""
    joinable = [m and ok and c > 0 for m, ok, c in zip(member, usable, conf, strict=True)]
    accepted = 0
    for b, e in _runs(conf, joinable):
        total = sum(conf[b:e + 1])
        g = max(j for j in range(b, e + 1) if sum(conf[j:e + 1]) >= alpha * total)  # the tail's start
        end = g - 1  # the head is never tested
        for last in range(e, g - 1, -1):  # the whole tail, then shorter ones (fallback), one uniform
            if u[b] < min(1.0, math.prod(ratio[g:last + 1])):
                end = last
                break
        for j in range(b, end + 1):
            if not usable[j]:
                return accepted
            accepted += 1
        if end < e:
            return accepted
    return accepted


def _random_case(gen: torch.Generator, b: int, d: int) -> tuple[Tensor, ...]:
    """Confidences on a grid of 1/16 (ties, zeros, exact sums), ratios around 1, drawn flags and depth caps."""
    conf = torch.randint(0, 17, (b, d), generator=gen).double() / 16
    ratio = torch.exp(torch.randn(b, d, generator=gen, dtype=torch.float64)) * (conf > 0)
    member = torch.rand(b, d, generator=gen) < 0.8
    usable = torch.arange(d)[None, :] < torch.randint(0, d + 1, (b, 1), generator=gen)
    u = torch.rand(b, d, generator=gen, dtype=torch.float64)
    return conf, ratio, member, usable, u


@pytest.mark.parametrize("alpha", [0.5, DEFAULT_SV_ALPHA, 1.0])
def test_the_rule_equals_the_papers_formula_loop_by_loop(alpha: float) -> None:
    """2,000 random windows of 1..12 drafts: the accepted count is the loop's, draft for draft."""
    gen = torch.Generator().manual_seed(int(alpha * 10))
    for d in range(1, 13):
        conf, ratio, member, usable, u = _random_case(gen, 170, d)
        got = subsequence_accepted(conf, ratio, member, usable, u, alpha)
        assert torch.equal(got, got.long().cumprod(1).bool())  # a prefix
        want = [reference_accepted(*(t[i].tolist() for t in (conf, ratio, member, usable, u)), alpha)
                for i in range(conf.shape[0])]
        assert got.sum(1).tolist() == want, d


def test_worked_example_head_tail_and_fallback() -> None:
    """Confidences 0.1 0.2 0.7 | 0.3 | ...: the first run's tail (alpha 0.8: 0.7 < 0.8, 0.9 >= 0.8)
    starts at draft 1, so draft 0 (ratio 0.01) is never tested. Its tail fails in full (0.5 * 0.4)
    with u = 0.3 but passes shortened to draft 1 (0.5): drafts 0 and 1 are accepted, draft 2 is
    where the walk stops. With u = 0.6 even the one-draft tail fails: the head stands."""
    conf = torch.tensor([[0.1, 0.2, 0.7, 0.3]], dtype=torch.float64)
    ratio = torch.tensor([[0.01, 0.5, 0.4, 1.0]], dtype=torch.float64)
    every = torch.ones(1, 4, dtype=torch.bool)
    for u0, accepted in ((0.1, 4), (0.3, 2), (0.6, 1)):
        u = torch.tensor([[u0, 0.99, 0.99, 0.0]], dtype=torch.float64)
        assert int(subsequence_accepted(conf, ratio, every, every, u, 0.8).sum()) == accepted, u0
    # Draft by draft (SJD), draft 0 alone is accepted with probability 0.01.


def test_a_draft_no_model_drew_is_a_run_of_its_own() -> None:
    """Drawn drafts only share runs: an initial guess (member False) gets its own test, so a low
    ratio there rejects it even at the head of what would otherwise be one run."""
    conf = torch.tensor([[0.1, 0.5, 0.9]], dtype=torch.float64)
    ratio = torch.tensor([[0.01, 1.0, 1.0]], dtype=torch.float64)
    u = torch.full((1, 3), 0.5, dtype=torch.float64)
    every = torch.ones(1, 3, dtype=torch.bool)
    assert int(subsequence_accepted(conf, ratio, every, every, u, 0.8).sum()) == 3
    undrawn = torch.tensor([[False, True, True]])
    assert int(subsequence_accepted(conf, ratio, undrawn, every, u, 0.8).sum()) == 0
    impossible = torch.tensor([[0.0, 0.5, 0.9]], dtype=torch.float64)  # outside top-k: never carried
    assert int(subsequence_accepted(impossible, ratio * 0, every, every, u, 0.8).sum()) == 0


# ---- the chain verifiers -----------------------------------------------------------------------


def _chain(gen: torch.Generator, b: int, t: int, v: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Random target p and draft q per node, drafts drawn from q, uniforms."""
    p = torch.softmax(torch.randn(b, t, v, generator=gen, dtype=torch.float64) * 2, -1)
    q = torch.softmax(torch.randn(b, t, v, generator=gen, dtype=torch.float64) * 2, -1)
    tokens = torch.multinomial(q.reshape(b * t, v), 1, generator=gen).view(b, t)
    uniforms = torch.rand(b, t + 1, generator=gen, dtype=torch.float64)
    return p, q, tokens, uniforms


def test_chain_verifier_equals_the_reference_with_its_residual() -> None:
    """verify_chain_sampled with SJD-SV: accepted count from the loop above (ratio p(x)/q(x), the
    run's uniform its first draft's), then the recovered token from norm(max(p - q, 0)) at the
    first failed draft, or the bonus from p after a full window."""
    gen = torch.Generator().manual_seed(5)
    b, t, v = 400, 7, 6
    p, q, tokens, uniforms = _chain(gen, b, t, v)
    max_depth = torch.randint(0, t, (b,), generator=gen)
    drawn = torch.rand(b, t, generator=gen) < 0.7
    res = verify_chain_sampled(p, tokens, max_depth, uniforms, q, relaxable=drawn, subsequence=SubsequenceConfig())
    for i in range(b):
        x = tokens[i, 1:]
        conf = p[i, :-1].gather(1, x[:, None])[:, 0]
        ratio = conf / q[i, :-1].gather(1, x[:, None])[:, 0]
        usable = torch.arange(1, t) <= max_depth[i]
        a = reference_accepted(conf.tolist(), ratio.tolist(), drawn[i, 1:].tolist(), usable.tolist(),
                               uniforms[i, 1:t].tolist(), DEFAULT_SV_ALPHA)
        assert int(res.num_accepted[i]) == a
        assert res.path[i].tolist() == [0, *range(1, a + 1), *[-1] * (t - 1 - a)]
        rejected = a < t - 1 and bool(usable[a])
        law = (p[i, a] - q[i, a]).clamp(min=0) if rejected else p[i, a]
        assert int(res.next_token[i]) == int(sample_from_probs(law[None], uniforms[i, -1:])[0]), i
        assert bool(res.is_bonus[i]) is not rejected


def _falling(p: Tensor, tokens: Tensor) -> Tensor:
    """p with each draft's probability set to 0.9, 0.8, ... along the chain (the rest rescaled)."""
    b, t, v = p.shape
    x = tokens[:, 1:, None]
    target = (0.9 - 0.1 * torch.arange(t - 1, dtype=p.dtype))[None, :, None].expand(b, -1, 1)
    rest = p[:, :-1].scatter(-1, x, 0.0)
    head = rest / rest.sum(-1, keepdim=True) * (1 - target)
    return torch.cat([head.scatter(-1, x, target), p[:, -1:]], dim=1)


@pytest.mark.parametrize("relax", [None, RelaxationConfig(k=3, delta=0.2), RelaxationConfig(k=2, mode="group")],
                         ids=["exact", "lantern", "gsd"])
def test_runs_of_one_draft_are_the_base_rule_itself(relax: RelaxationConfig | None) -> None:
    """Confidence falling at every draft makes every run one draft long (and so does a window of
    drafts no model drew): then SJD-SV is its base rule, uniform for uniform, LANTERN's and GSD's
    relaxations included."""
    gen = torch.Generator().manual_seed(6)
    b, t, v = 300, 6, 8
    p, q, tokens, uniforms = _chain(gen, b, t, v)
    max_depth = torch.full((b,), t - 1)
    nbr = torch.stack([torch.roll(torch.arange(v), -i)[1:] for i in range(v)])
    undrawn = torch.zeros(b, t, dtype=torch.bool)
    for target, drawn in ((_falling(p, tokens), None), (p, undrawn)):
        one = verify_chain_sampled(target, tokens, max_depth, uniforms, q, nbr, relax, drawn)
        runs = verify_chain_sampled(target, tokens, max_depth, uniforms, q, nbr, relax, drawn, SubsequenceConfig())
        for field in ("path", "num_accepted", "next_token", "num_relaxed", "is_bonus"):
            assert torch.equal(getattr(one, field), getattr(runs, field)), field
        assert 0 < int(one.num_accepted.sum()) < b * (t - 1)  # a mix of acceptances and rejections


def test_power_runs_accept_more_and_count_as_relaxed() -> None:
    """On the same random chains SJD-SV accepts more drafts than SJD, never fewer per row at the
    first run, and reports the drafts SJD's own test would have refused as relaxed."""
    gen = torch.Generator().manual_seed(7)
    p, q, tokens, uniforms = _chain(gen, 500, 9, 6)
    max_depth = torch.full((500,), 8)
    exact = verify_chain_sampled(p, tokens, max_depth, uniforms, q)
    runs = verify_chain_sampled(p, tokens, max_depth, uniforms, q, subsequence=SubsequenceConfig())
    assert int(runs.num_accepted.sum()) > int(exact.num_accepted.sum())
    assert int(exact.num_relaxed.sum()) == 0 < int(runs.num_relaxed.sum())


def _greedy_reference(logits: Tensor, tokens: Tensor, alpha: float) -> list[int]:
    b, t, _ = logits.shape
    out = []
    for i in range(b):
        ok = [float(int(logits[i, d - 1].argmax()) == int(tokens[i, d])) for d in range(1, t)]
        conf = [float(torch.softmax(logits[i, d - 1], -1)[tokens[i, d]]) for d in range(1, t)]
        out.append(reference_accepted(conf, ok, [True] * (t - 1), [True] * (t - 1), [0.0] * (t - 1), alpha))
    return out


def test_greedy_is_the_rule_on_point_masses_and_not_greedy_acceptance() -> None:
    """At temperature 0 a draft's ratio is 1 when it is its parent's argmax, else 0, and runs follow
    softmax(logits): the loop's count on random chains. It does not reduce to greedy acceptance:
    a non-argmax draft at a run's head is kept when its tail holds argmax drafts."""
    gen = torch.Generator().manual_seed(8)
    b, t, v = 300, 6, 3
    logits = torch.randn(b, t, v, generator=gen, dtype=torch.float64) * 2
    tokens = torch.randint(0, v, (b, t), generator=gen)
    res = verify_chain_greedy_subsequence(logits, tokens, torch.full((b,), t - 1), SubsequenceConfig())
    assert res.num_accepted.tolist() == _greedy_reference(logits, tokens, DEFAULT_SV_ALPHA)
    rows = torch.arange(b)
    assert torch.equal(res.next_token, logits[rows, res.num_accepted].argmax(-1))
    # Draft 1 is token 2 (p 0.1, not the argmax), draft 2 the argmax (p 0.9): one run whose tail is
    # draft 2 alone (0.9 >= 0.8 * 1.0).
    logits = torch.log(torch.tensor([[[0.6, 0.3, 0.1], [0.05, 0.05, 0.9], [1 / 3] * 3]], dtype=torch.float64))
    chain = torch.tensor([[0, 2, 2]])
    retrieve = tree_from_parents(torch.tensor([[-1, 0, 1]])).retrieve
    assert int(verify_tree_greedy(logits, chain, retrieve, torch.tensor([2])).num_accepted[0]) == 0
    sv = verify_chain_greedy_subsequence(logits, chain, torch.tensor([2]), SubsequenceConfig())
    assert int(sv.num_accepted[0]) == 2 and int(sv.num_relaxed[0]) == 1


# ---- the loop, the methods and their settings ---------------------------------------------------


@pytest.mark.parametrize("relax", [None, "lantern", "gsd"])
def test_rows_independent_of_batch(relax: str | None) -> None:
    """Sampled coupled SJD with SJD-SV (and LANTERN's delta, or GSD's groups): a row gives the same
    codes, in the same number of forwards, alone and in a batch of 3."""
    nbr = torch.stack([torch.roll(torch.arange(256), -i)[1:65] for i in range(256)]) if relax == "lantern" else None
    rule = {None: None, "lantern": RelaxationConfig(k=8, delta=0.2), "gsd": RelaxationConfig(k=7, mode="group")}[relax]
    acceptance = Acceptance(rule, nbr, SubsequenceConfig())
    s = SamplingConfig(temperature=1.0, top_k=20, cfg_scale=2.0)
    assert_rows_independent(tiny_llamagen(seed=7), s, JacobiConfig(8, "repeat_horizon", "maximal"), acceptance)


@pytest.fixture(scope="module")
def random_stack(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_random_stack(tmp_path_factory.mktemp("sv") / "random", seed=4)


@pytest.mark.parametrize("method", SV)
def test_every_sv_method_runs_through_the_run_path(random_stack: Path, method: str) -> None:
    """Resolved with the paper's alpha, prepared with its acceptance (the run test is taken: some
    draft is accepted that its own test refused), sampled and greedy."""
    stack = cached_stack(str(random_stack))
    config = resolve_method(method, sjd_window=6)
    assert config.subsequence == SubsequenceConfig(DEFAULT_SV_ALPHA) and not config.record.lossless
    relaxed = 0
    for s in (SamplingConfig(temperature=1.0, top_k=50, cfg_scale=2.0), SamplingConfig(temperature=0.0)):
        out = run_generation(stack, [0, 3, 7], 0, s, config, 3)
        assert out.codes.shape[0] == 3 and int(out.codes.min()) >= 0
        relaxed += sum(o.stats.relaxed_accepts for o in out.output_stats)
    assert relaxed > 0


def test_the_sv_methods_are_relaxed_in_the_table_and_auto_never_calls_them_lossless() -> None:
    assert method_names(lambda r: r.subsequence) == SV
    for name in SV:
        record = METHOD_TABLE[name]
        assert record.relaxed and not record.lossless and record.family == "sjd"
        assert MethodCalibration(name, 3.0, {1: 0.1}).why_not("lossless") == "not lossless at its defaults"
    base = {"sjd-sv": "sjd", "sjd-coupled-sv": "sjd-coupled", "sjd-lantern-sv": "sjd-lantern",
            "sjd-coupled-lantern-sv": "sjd-coupled-lantern", "gsd-sv": "gsd"}
    for sv, plain in base.items():  # the base method's drafts: redraws, first guesses, rule
        a, b = MethodConfig.resolve(sv), MethodConfig.resolve(plain)
        assert (a.jacobi, a.relaxation, a.tree) == (b.jacobi, b.relaxation, b.tree) and b.subsequence is None
    assert MethodConfig.resolve("sjd-sv", sv_alpha=0.5).subsequence == SubsequenceConfig(0.5)


@pytest.mark.parametrize("call,message,field", [
    (lambda: SubsequenceConfig(alpha=0.0), r"--sv-alpha must be a number in \(0, 1\] \(the paper's 0.8\), got 0.0",
     "sv_alpha"),
    (lambda: SubsequenceConfig(alpha=1.5), r"--sv-alpha must be a number in \(0, 1\].*got 1.5", "sv_alpha"),
    (lambda: SubsequenceConfig(alpha=float("nan")), r"--sv-alpha must be a number.*got nan", "sv_alpha"),
    (lambda: SubsequenceConfig(alpha="0.8"), r"--sv-alpha must be a number.*got '0.8'", "sv_alpha"),  # type: ignore[arg-type]
    (lambda: SubsequenceConfig(alpha=True), r"--sv-alpha must be a number.*got True", "sv_alpha"),
    (lambda: MethodConfig.resolve("sjd-sv", sv_alpha=-1), r"--sv-alpha must be a number.*got -1", "sv_alpha"),
    (lambda: MethodConfig.resolve("sjd", sv_alpha=0.5),
     "--sv-alpha needs --method sjd-sv or sjd-coupled-sv or sjd-lantern-sv or sjd-coupled-lantern-sv or gsd-sv, "
     "got --method sjd", "sv_alpha"),
    (lambda: MethodConfig.resolve("pjd", sv_alpha=0.5), "--sv-alpha needs --method sjd-sv or", "sv_alpha"),
    (lambda: MethodConfig.resolve("sjd-sv", lantern_delta=0.1), "--lantern-delta needs a relaxed method",
     "lantern_delta"),
    (lambda: MethodConfig.resolve("sjd-sv", gsd_group=3), "--gsd-group needs --method gsd", "gsd_group"),
    (lambda: MethodConfig.resolve("sjd-sv", sjd_coupling="maximal"), "--sjd-coupling needs --method", "sjd_coupling"),
])
def test_bad_settings_are_one_line_errors(call, message: str, field: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(LanternError, match=message) as err:
        call()
    assert "\n" not in str(err.value) and err.value.field == field


def test_a_config_without_its_alpha_or_with_one_it_does_not_take_is_refused() -> None:
    sv = MethodConfig.resolve("sjd-sv")
    with pytest.raises(LanternError, match="method 'sjd-sv' needs subsequence verification settings"):
        MethodConfig(method="sjd-sv", tree=sv.tree, jacobi=sv.jacobi)
    with pytest.raises(LanternError, match="method 'sjd' takes no subsequence verification settings"):
        MethodConfig(method="sjd", tree=sv.tree, jacobi=sv.jacobi, subsequence=SubsequenceConfig())


def test_alpha_reaches_the_method_from_every_entrance() -> None:
    """The bench grammar (``sjd-sv/alpha=0.5``), ``lantern generate --sv-alpha`` and the server's
    ``sv_alpha`` field resolve to the same config; the answer's settings report it."""
    import argparse

    from lantern.cli.common import method_from_args
    from lantern.cli.main import build_parser
    from lantern.eval.methods_grammar import parse_methods
    from lantern.methods import method_settings
    from lantern.serve.schema import GenerationRequest

    want = MethodConfig.resolve("sjd-sv", sv_alpha=0.5)
    (row,) = parse_methods("sjd-sv/alpha=0.5")
    assert resolve_method(row.method, **row.settings) == want
    args = build_parser().parse_args(["generate", "--model", "digits", "--out", "unused", "--method", "sjd-sv",
                                       "--sv-alpha", "0.5"])
    assert isinstance(args, argparse.Namespace) and method_from_args(args, None) == want
    request = GenerationRequest(label=1, method="sjd-sv", sv_alpha=0.5)
    assert request.sv_alpha == 0.5 and method_settings(want)["sv_alpha"] == 0.5
    with pytest.raises(LanternError, match="--sv-alpha needs --method sjd-sv"):
        resolve_method("gsd", **parse_methods("gsd/alpha=0.5")[0].settings)


def test_a_grid_drafter_with_runs_is_refused_in_one_line() -> None:
    """SV over PJD's grid is not implemented: refused at the start, not silently ignored."""
    from lantern.decoding.config import PJDConfig
    from lantern.decoding.loop import generate
    from lantern.decoding.pjd import GridJacobiDrafter
    from lantern.targets.llamagen import LlamaGenTarget

    model = tiny_llamagen(seed=1, block_size=16)
    s = SamplingConfig(temperature=0.0)
    drafter = GridJacobiDrafter(PJDConfig(window=2, context=2), s, model.config.vocab_size, 16)
    target = LlamaGenTarget(model, s, max_tree_nodes=64)
    with pytest.raises(LanternError, match="^subsequence verification \\(SJD-SV\\) is not implemented for PJD"):
        generate(target, torch.tensor([1]), drafter=drafter, acceptance=Acceptance(subsequence=SubsequenceConfig()))
