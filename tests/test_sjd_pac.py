"""SJD-PAC (``--method sjd-pac``, ``lantern.decoding.pac``): coupled SJD plus proactive drafting's
K-ary subtree, through the one loop.

Evidence:

* the sibling sampler draws candidates 1..K-1 with exactly the law the loop's sequential sibling
  test assumes (without replacement from the guess's q), computed on a grid of uniforms;
* greedy SJD-PAC reproduces greedy AR token for token (random tiny stack, batch 1 and 3, CFG on
  and off, three tree shapes; the digits preset; both Chameleon layouts);
* sampled SJD-PAC reproduces the target's joint law of the first 4 tokens (chi-square against an
  exact enumeration, significance 0.001), with accepted paths through siblings; the same test
  rejects a deliberately wrong sibling law (power);
* rows are independent of their batch-mates; a round compiles to one graph, never recompiles
  and gives the eager codes;
* more tokens per forward than sjd-coupled; settings, CLI, bench grammar, bad options.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import pytest
import torch
from conftest import (
    CHAMELEON_LAYOUTS,
    CHAMELEON_PROMPTS,
    DIST_LABEL,
    DIST_ROWS,
    DIST_SAMPLING,
    assert_cli_error,
    cached_stack,
    chameleon_greedy_ar,
    chameleon_lm,
    chi_square,
    dist_model,
    exact_joint,
)
from torch import Tensor
from torch._dynamo.utils import counters

from lantern.cli.main import main
from lantern.decoding import compiling, loop
from lantern.decoding.config import JacobiConfig, PACConfig, SamplingConfig
from lantern.decoding.loop import GenerationOutput, generate
from lantern.decoding.pac import PACDrafter, draw_siblings
from lantern.decoding.rng import RowRandom
from lantern.decoding.sampling import make_generators
from lantern.errors import LanternError
from lantern.eval.methods_grammar import parse_methods
from lantern.eval.report import tree_label
from lantern.methods import MethodConfig
from lantern.models.llamagen import LlamaGen
from lantern.run import prepare_method, run_generation
from lantern.targets.chameleon import encode_prompts
from lantern.targets.llamagen import LlamaGenTarget
from lantern.targets.llamagen_stack import ModelStack, load_stack
from lantern.testing import chameleon_parts, chi_square_threshold, make_random_stack, tiny_llamagen

F64 = torch.float64


@pytest.fixture(scope="module")
def random_stack(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_random_stack(tmp_path_factory.mktemp("pac") / "random", seed=4)


def _generate(
    model: LlamaGen,
    labels: Tensor,
    sampling: SamplingConfig,
    config: JacobiConfig,
    pac: PACConfig,
    seeds: list[int] | None,
    drafter_cls: type[PACDrafter] = PACDrafter,
) -> GenerationOutput:
    cfg = model.config
    drafter = drafter_cls(config, pac, sampling, cfg.vocab_size, cfg.block_size)
    target = LlamaGenTarget(model, sampling, max_tree_nodes=drafter.num_nodes)
    gens = None if seeds is None else make_generators(seeds)
    return generate(target, labels, generators=gens, drafter=drafter)


# ---- the tree -------------------------------------------------------------------------------


def test_tree_shape() -> None:
    """The chain of the window plus the full K-ary subtree of D - 1 levels: window + K + ... +
    K^(D-1) - (D - 1) drafts; the README's defaults K = 4, D = 3 add 18 nodes to the chain."""
    for window, width, depth in [(4, 3, 3), (16, 4, 3), (5, 2, 4), (3, 1, 3), (3, 3, 1)]:
        pac = PACConfig(width, depth)
        extra = sum(width**d for d in range(1, depth)) - (depth - 1)
        assert len(pac.choices(window)) == window + extra
        assert pac.tree(window).num_nodes == window + extra + 1
    assert MethodConfig.resolve("sjd-pac").tree.num_nodes == 16 + 18 + 1
    drafter = PACDrafter(JacobiConfig(4), PACConfig(3, 3), SamplingConfig(), 6, 9)
    assert drafter.num_nodes == PACConfig(3, 3).tree(4).num_nodes == 15


# ---- the sibling sampler --------------------------------------------------------------------

GRID = 300  # uniforms (i + 0.5) / GRID per sibling: the sampler's law up to ~2 / GRID per cell


def _sibling_law(q: Tensor, first: int) -> Tensor:
    """[V, V]: law of (candidate 1, candidate 2) after ``first``, over a GRID x GRID of uniforms."""
    v = q.shape[0]
    grid = (torch.arange(GRID, dtype=F64) + 0.5) / GRID
    u = torch.stack(torch.meshgrid(grid, grid, indexing="ij"), dim=-1).reshape(-1, 2)  # [G^2, 2]
    out = draw_siblings(q.expand(u.shape[0], v), torch.full((u.shape[0],), first), u)
    law = torch.zeros(v * v, dtype=F64).index_add_(0, out[:, 0] * v + out[:, 1], torch.ones(u.shape[0], dtype=F64))
    return (law / u.shape[0]).view(v, v)


@pytest.mark.parametrize("case", ["dense", "sparse"])
def test_siblings_follow_the_law_the_verifier_assumes(case: str) -> None:
    """Candidate k after candidates 0..k-1 follows norm(q without them), the conditional law of
    ``acceptance.verify_tree_sampled``'s sequential sibling test. Where q runs out (support of 2
    here: the guess and one more token) the candidates repeat the guess, which the verifier skips."""
    g = torch.Generator().manual_seed(1)
    q = torch.rand(6, generator=g, dtype=F64) ** 2
    if case == "sparse":
        q[2:] = 0.0
    q = q / q.sum()
    first = 1
    law = _sibling_law(q, first)
    rest = q.clone()
    rest[first] = 0.0
    rest = rest / rest.sum()
    exact = torch.zeros(6, 6, dtype=F64)
    for a in range(6):
        for b in range(6):
            if case == "sparse":  # the one token left, then nothing: a repeat of the guess
                exact[a, b] = float(rest[a]) * (1.0 if b == first else 0.0)
            elif a != b and a != first and b != first:
                exact[a, b] = float(rest[a]) * float(rest[b]) / (1.0 - float(rest[a]))
    assert torch.allclose(law, exact, atol=3 / GRID), (law, exact)


# ---- greedy SJD-PAC == greedy AR ------------------------------------------------------------

LABELS = {1: [5], 3: [0, 3, 7]}


@cache
def _greedy_ar(path: str, batch: int, cfg_scale: float) -> Tensor:
    s = SamplingConfig(temperature=0.0, cfg_scale=cfg_scale)
    return run_generation(cached_stack(path), LABELS[batch], 0, s, MethodConfig.resolve("ar"), batch).codes


@pytest.mark.parametrize("shape", [(4, 4, 3), (6, 3, 4), (2, 2, 3)], ids=["w4-K4-D3", "w6-K3-D4", "w2-K2-D3"])
@pytest.mark.parametrize("cfg_scale", [1.0, 3.0])
@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_sjd_pac_reproduces_ar(random_stack: Path, batch: int, cfg_scale: float,
                                      shape: tuple[int, int, int]) -> None:
    window, width, depth = shape
    stack = cached_stack(str(random_stack))
    s = SamplingConfig(temperature=0.0, cfg_scale=cfg_scale)
    method = MethodConfig.resolve("sjd-pac", sjd_window=window, pac_width=width, pac_depth=depth)
    result = run_generation(stack, LABELS[batch], 0, s, method, batch)
    assert torch.equal(result.codes, _greedy_ar(str(random_stack), batch, cfg_scale))
    assert result.stats_dict()["target_forwards"] <= batch * stack.target.config.block_size


@pytest.mark.slow
def test_greedy_sjd_pac_on_digits() -> None:
    """A trained model: greedy SJD-PAC is greedy AR and decides more tokens per forward than greedy
    sjd-coupled (measured 3.12 vs 2.65 on 3 images)."""
    stack = load_stack("digits")
    s = SamplingConfig(**{**stack.default_sampling(), "temperature": 0.0})
    ar = run_generation(stack, [0, 3, 7], 0, s, MethodConfig.resolve("ar"), 3)
    pac = run_generation(stack, [0, 3, 7], 0, s, MethodConfig.resolve("sjd-pac"), 3)
    coupled = run_generation(stack, [0, 3, 7], 0, s, MethodConfig.resolve("sjd-coupled"), 3)
    assert torch.equal(pac.codes, ar.codes)
    assert pac.stats_dict()["mean_accepted"] > coupled.stats_dict()["mean_accepted"] + 0.2


@pytest.mark.parametrize("layout", ["lumina", "anole"])
def test_greedy_sjd_pac_on_chameleon_reproduces_ar(layout: str) -> None:
    """The Chameleon family (Lumina's row ends are shadow nodes): greedy SJD-PAC is greedy AR."""
    lay = CHAMELEON_LAYOUTS[layout]
    ids, mask = encode_prompts(CHAMELEON_PROMPTS[:3], lay)
    s = SamplingConfig(temperature=0.0, top_k=0, cfg_scale=3.0)
    method = MethodConfig.resolve("sjd-pac", sjd_window=4, pac_width=3, pac_depth=3)
    target, draft = chameleon_parts(chameleon_lm(), lay, s, method, None, chameleon_lm().image_head)
    out = generate(target, ids, drafter=draft, cond_mask=mask)
    assert torch.equal(out.codes, chameleon_greedy_ar(lay, 3.0, CHAMELEON_PROMPTS[:3]))


# ---- sampled SJD-PAC follows the target's distribution --------------------------------------


class _Recorder(PACDrafter):
    """Counts rounds whose accepted path ended at a sibling (a node off the chain)."""

    off_chain = 0

    def commit(self, hidden: Tensor, next_tokens: Tensor, num_new: Tensor) -> None:
        super().commit(hidden, next_tokens, num_new)
        assert self._last is not None
        _Recorder.off_chain += int(((self._last > self.window) & (num_new > 0)).sum())


class _TopSiblings(_Recorder):
    """A deliberately wrong sibling law: the most likely remaining tokens of q, deterministically,
    while the verifier still tests them as draws without replacement from q."""

    def _draw_candidates(self, guesses: Tensor, gens: RowRandom) -> Tensor:
        super()._draw_candidates(guesses, gens)  # the same random draws
        assert self.q is not None
        ranked = self.q[:, : guesses.shape[1]].scatter(-1, guesses[..., None], -1.0)
        top = ranked.topk(self.pac.width - 1, dim=-1)  # a fresh one-hot guess has none: repeats it
        return torch.cat([guesses[..., None], torch.where(top.values > 0, top.indices, guesses[..., None])], dim=-1)


DIST_RUNS: dict[str, tuple[JacobiConfig, PACConfig, type[PACDrafter]]] = {
    "K3-D3": (JacobiConfig(4, "random", "maximal"), PACConfig(3, 3), _Recorder),
    "K4-D3-repeat": (JacobiConfig(4, "repeat_horizon", "maximal"), PACConfig(4, 3), _Recorder),
    "K2-D4-independent": (JacobiConfig(4, "random", "independent"), PACConfig(2, 4), _Recorder),
    "top-siblings": (JacobiConfig(4, "random", "maximal"), PACConfig(3, 3), _TopSiblings),
}
DIST_TOKENS = 4


@cache
def _dist_run(name: str) -> tuple[GenerationOutput, float]:
    """The run and the share of its rounds whose accepted path ended at a sibling."""
    config, pac, drafter_cls = DIST_RUNS[name]
    _Recorder.off_chain = 0
    labels = torch.full((DIST_ROWS,), DIST_LABEL)
    out = _generate(dist_model(), labels, DIST_SAMPLING, config, pac, list(range(DIST_ROWS)), drafter_cls)
    rounds = int(sum(int((step > 0).sum()) for step in out.stats.tokens_per_step))
    return out, _Recorder.off_chain / rounds


@pytest.mark.parametrize("run", [pytest.param("K3-D3", marks=pytest.mark.slow), "K4-D3-repeat",
                                 pytest.param("K2-D4-independent", marks=pytest.mark.slow)])
def test_sjd_pac_matches_target_distribution(run: str) -> None:
    """Chi-square goodness of fit of the first 4 tokens' joint law (V = 6, top-k 4, CFG 2: 256
    cells in the support, 6000 rows) at significance 0.001: a correct implementation fails with
    probability 0.1 % per test (fixed seeds: the outcome is deterministic). Tokens 1..3 are decided
    by the subtree's sibling tests (levels 1 and 2, or 1..3) and by carried, coupled guesses; a
    good share of the rounds end on a sibling's path, so the sibling tests and the carry-over from
    a sibling's descendants are exercised. Measured chi2 58.7, 68.9, 73.2 (threshold 108.6, 67 dof);
    rounds ending on a sibling 24 %, 24 %, 16 %."""
    p = exact_joint(dist_model(), DIST_SAMPLING, DIST_TOKENS)
    out, off_chain = _dist_run(run)
    codes = out.codes[:, :DIST_TOKENS]
    cell = (codes * 6 ** torch.arange(DIST_TOKENS - 1, -1, -1)).sum(1)
    assert bool((p[cell] > 0).all()), "a sample fell outside the top-k support"
    stat, df = chi_square(codes, p)
    assert df >= 30
    assert stat < chi_square_threshold(df), f"chi2 = {stat:.1f} with {df} dof"
    assert out.stats.mean_accepted > 1.5  # guesses were accepted: the speculative path ran
    assert off_chain > 0.1, off_chain  # and accepted paths went through siblings


def test_chi_square_detects_a_wrong_sibling_law() -> None:
    """Power: the same test rejects SJD-PAC whose siblings are q's most likely remaining tokens
    (deterministic) while tested as random draws from q (measured chi2 183 against 108.6).

    For the record (not a test): siblings drawn as the reference code draws them, without
    replacement from norm(max(p - q_old, 0)), and tested as draws from p, measured chi2 119 on the
    same runs: the reference's sibling law is not the one its test assumes (lantern.decoding.pac)."""
    p = exact_joint(dist_model(), DIST_SAMPLING, DIST_TOKENS)
    out, off_chain = _dist_run("top-siblings")
    stat, df = chi_square(out.codes[:, :DIST_TOKENS], p)
    assert off_chain > 0.1
    assert stat > chi_square_threshold(df), f"chi2 = {stat:.1f} with {df} dof"


# ---- batching -------------------------------------------------------------------------------


@pytest.mark.parametrize("init", ["random", "repeat_horizon"])
def test_rows_independent_of_batch(init: str) -> None:
    """A row gives the same codes, in the same number of forwards, alone and in a batch of 3."""
    model = tiny_llamagen(seed=7)
    s = SamplingConfig(temperature=1.0, top_k=20, cfg_scale=2.0)
    config, pac = JacobiConfig(8, init, "maximal"), PACConfig(3, 3)
    labels, seeds = [4, 5, 6], [1, 2, 3]
    batch = _generate(model, torch.tensor(labels), s, config, pac, seeds)
    for i in range(3):
        alone = _generate(model, torch.tensor(labels[i : i + 1]), s, config, pac, seeds[i : i + 1])
        assert torch.equal(batch.codes[i], alone.codes[0]), i
        assert int(batch.stats.target_forwards[i]) == int(alone.stats.target_forwards[0])
    assert any(len(set(step.tolist())) > 1 for step in batch.stats.tokens_per_step)  # rows drifted apart


# ---- one compiled region per round ----------------------------------------------------------

SAMPLED = SamplingConfig(temperature=1.0, top_k=8, cfg_scale=2.0)
GREEDY = SamplingConfig(temperature=0.0, cfg_scale=2.0)


@pytest.fixture(scope="module")
def small_stack(tmp_path_factory: pytest.TempPathFactory) -> ModelStack:
    return load_stack(make_random_stack(tmp_path_factory.mktemp("stack") / "random", seed=3, grid=4, vocab=64))


def _pac_method() -> MethodConfig:
    return MethodConfig.resolve("sjd-pac", sjd_window=4, pac_width=3, pac_depth=3)


@pytest.mark.slow
@pytest.mark.parametrize("sampling", [SAMPLED, GREEDY], ids=["sampled", "greedy"])
def test_round_is_one_graph(small_stack: ModelStack, sampling: SamplingConfig) -> None:
    """``torch._dynamo.explain`` of a round (as tests/test_round_graph.py): one graph, no break."""
    prepared = prepare_method(small_stack, _pac_method(), sampling)
    with torch.inference_mode():
        target, drafter = prepared.parts()
        rng = None if sampling.greedy else RowRandom.from_seeds([1, 2, 3], "cpu")
        decode = loop.start_decode(target, torch.tensor([0, 1, 2]), rng, drafter, prepared.acceptance)
        explained = torch._dynamo.explain(loop._raster_round)(*decode.step_args(decode.n < small_stack.num_tokens))
    assert explained.graph_break_count == 0, [str(b.reason) for b in explained.break_reasons]
    assert explained.graph_count == 1


@pytest.mark.slow
def test_compiled_round_never_recompiles(small_stack: ModelStack, eager_backend: list[int]) -> None:
    """``compile="default"``: one graph for the decode, one region call per round, no recompilation
    for a second batch, and the eager codes."""
    method = _pac_method()
    eager = prepare_method(small_stack, method, SAMPLED)
    compiled = prepare_method(small_stack, method, SAMPLED, compile="default")
    before, calls = counters["stats"]["unique_graphs"], compiling.region_calls
    first = compiled.generate(torch.tensor([0, 1, 2]), make_generators([1, 2, 3]))
    assert counters["stats"]["unique_graphs"] == before + 1
    assert compiling.region_calls - calls == first.stats.steps
    second = compiled.generate(torch.tensor([3, 4, 5]), make_generators([7, 8, 9]))
    assert counters["stats"]["unique_graphs"] == before + 1
    assert torch.equal(first.codes, eager.generate(torch.tensor([0, 1, 2]), make_generators([1, 2, 3])).codes)
    assert torch.equal(second.codes, eager.generate(torch.tensor([3, 4, 5]), make_generators([7, 8, 9])).codes)


# ---- speed, settings, CLI -------------------------------------------------------------------


@pytest.mark.slow
def test_more_tokens_per_forward_than_coupled_sjd() -> None:
    """digits, preset sampling, same seeds (measured 2.63 sjd-pac vs 2.45 sjd-coupled, 1.83 sjd)."""
    stack = load_stack("digits")
    s = SamplingConfig(**stack.default_sampling())
    tau = {m: run_generation(stack, [0, 1, 2, 3], 0, s, MethodConfig.resolve(m), 2).stats_dict()["mean_accepted"]
           for m in ("sjd-coupled", "sjd-pac")}
    assert tau["sjd-pac"] > tau["sjd-coupled"] + 0.1, tau


def test_settings_resolve() -> None:
    m = MethodConfig.resolve("sjd-pac")
    assert m.jacobi == JacobiConfig(16, "repeat_horizon", "maximal") and m.pac == PACConfig(4, 3)
    assert m.relaxation is None
    m = MethodConfig.resolve("sjd-pac", sjd_window=8, sjd_init="random", sjd_coupling="gumbel", pac_width=2,
                             pac_depth=5)
    assert m.jacobi == JacobiConfig(8, "random", "gumbel") and m.pac == PACConfig(2, 5)
    assert m.tree == PACConfig(2, 5).tree(8)
    ablation = MethodConfig.resolve("sjd-pac", sjd_coupling="independent").jacobi  # proactive drafting alone
    assert ablation is not None and ablation.coupling == "independent"
    assert m.to_dict()["pac"] == {"width": 2, "depth": 5}
    assert MethodConfig.resolve("sjd-coupled").pac is None


def test_bench_rows() -> None:
    specs = parse_methods("ar,sjd-pac,sjd-pac/width=2/depth=4/window=8")
    stack = cached_stack("digits")
    assert [tree_label(s.resolve(stack)) for s in specs] == [
        "-", "jacobi:16/repeat_horizon/maximal/pd4x3", "jacobi:8/repeat_horizon/maximal/pd2x4"]


def test_cli_generate_sjd_pac(tmp_path: Path) -> None:
    out = tmp_path / "out"
    rc = main(["generate", "--model", "digits", "--labels", "3", "--method", "sjd-pac", "--sjd-window", "8",
               "--pac-width", "3", "--pac-depth", "2", "--out", str(out), "--no-progress"])
    assert rc == 0
    run = json.loads((out / "run.json").read_text())
    assert run["method"]["jacobi"] == {"window": 8, "init": "repeat_horizon", "coupling": "maximal"}
    assert run["method"]["pac"] == {"width": 3, "depth": 2}
    assert run["method"]["relaxation"] is None
    assert run["stats"]["mean_accepted"] > 1.0


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--method", "sjd-pac", "--pac-width", "0"], r"--pac-width must be an integer >= 1, got 0"),
        (["--method", "sjd-pac", "--pac-depth", "0"], r"--pac-depth must be an integer >= 1, got 0"),
        (["--method", "sjd-pac", "--sjd-window", "2", "--pac-depth", "4"],
         r"--pac-depth 4 needs a window of at least 3 guesses, got --sjd-window 2"),
        (["--method", "sjd-coupled", "--pac-width", "3"], r"--pac-width / --pac-depth need --method sjd-pac"),
        (["--method", "sd", "--pac-depth", "2"], r"--pac-width / --pac-depth need --method sjd-pac"),
        (["--method", "sjd-pac", "--lantern-delta", "0.1"], r"--lantern-delta needs a relaxed method"),
        (["--method", "sjd-pac", "--tree", "chain:3"], r"--tree is not used by sjd-pac"),
        (["--method", "sjd", "--sjd-coupling", "maximal"], r"--sjd-coupling needs --method sjd-coupled or .* sjd-pac"),
    ],
)
def test_cli_bad_options(
    random_stack: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    assert_cli_error(str(random_stack), tmp_path, capsys, extra, message)


def test_bad_configs() -> None:
    with pytest.raises(LanternError, match=r"--pac-width must be an integer >= 1, got True"):
        PACConfig(width=True)
    with pytest.raises(LanternError, match=r"method 'sjd-pac' needs proactive drafting settings"):
        MethodConfig(method="sjd-pac", tree=MethodConfig.resolve("sjd").tree, jacobi=JacobiConfig())
    with pytest.raises(LanternError, match=r"method 'sjd-coupled' takes no proactive drafting settings"):
        MethodConfig(method="sjd-coupled", tree=MethodConfig.resolve("sjd-coupled").tree,
                     jacobi=JacobiConfig(coupling="maximal"), pac=PACConfig())
    with pytest.raises(LanternError, match=r"needs the SJD-PAC tree of its window"):
        MethodConfig(method="sjd-pac", tree=MethodConfig.resolve("sjd").tree, jacobi=JacobiConfig(), pac=PACConfig())
    with pytest.raises(LanternError, match=r"--pac-width \(7\) exceeds the 6 image tokens"):
        PACDrafter(JacobiConfig(4), PACConfig(7, 2), SamplingConfig(), 6, 9)
