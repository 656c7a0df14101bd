"""Speculative decoding through the one loop: losslessness, tree attention, cache, batching, stats.

Two drafters bracket the loop: an *oracle* (the target itself, ``lantern.drafters.oracle``), which gets
almost every draft accepted and so exercises multi-token paths, cache compaction and bonus tokens;
and a *random EAGLE* drafter, which gets almost nothing accepted and so exercises rejections at
the root. Greedy decoding must reproduce AR token for token with both (the transformers
``assisted_decoding_matches_greedy_search`` test with "same" and "random" drafters); sampling must
reproduce the target's distribution (a chi-square test against an exact enumeration).
All models are tiny and random, on CPU.
"""

from __future__ import annotations

from functools import cache

import pytest
import torch
from conftest import DIST_LABEL, DIST_ROWS, DIST_SAMPLING, chi_square, dist_model, exact_joint
from torch import Tensor

from lantern.decoding.cache import KVCache
from lantern.decoding.config import SamplingConfig, TreeConfig
from lantern.decoding.drafting import TreeDrafter
from lantern.decoding.loop import GenerationOutput, generate
from lantern.decoding.sampling import make_generators
from lantern.decoding.trees import static_tree, tree_from_parents
from lantern.drafters.checks import check_drafter_matches_target, check_tree_fits
from lantern.drafters.eagle import make_eagle_drafter
from lantern.drafters.oracle import OracleBackend, make_oracle_drafter
from lantern.errors import LanternError
from lantern.models.drafter import DrafterConfig, EagleDrafterModel
from lantern.models.llamagen import LlamaGen
from lantern.targets.llamagen import LlamaGenTarget
from lantern.testing import chi_square_threshold, tiny_llamagen

TREES = {
    "chain4": TreeConfig.parse("chain:4"),
    "naive57": TreeConfig.parse("static:naive_extend_57"),
    "mcsim": TreeConfig.parse("static:mc_sim_7b_63"),
    "dyn_small": TreeConfig(kind="dynamic", depth=3, top_k=4, total_tokens=20),
    "dyn_default": TreeConfig.parse("dynamic"),  # 58 nodes, depth 4, top_k 10 ([LANTERN code])
    # top_k 1: a dynamic chain, whose commit (a chain's: in order, nothing moves) trusts that the
    # selection keeps node j at depth j
    "dyn_chain": TreeConfig(kind="dynamic", depth=4, top_k=1, total_tokens=5),
}
# Greedy oracle: the target's argmax path is always drafted, so each step yields depth + 1 tokens
# but near the image's end. Measured on the 64-token test model: 4.57 (chain:4), 5.33 (static
# depth 5), 4.4 (dynamic depth 3), 5.1 (dynamic default); bounds keep a margin.
ORACLE_MIN_MEAN_ACCEPTED = {"chain4": 3.5, "naive57": 3.5, "mcsim": 3.5, "dyn_small": 3.0, "dyn_default": 3.5,
                            "dyn_chain": 3.5}
LABELS = {1: [5], 3: [0, 3, 7]}
# greedy == AR: every tree and batch in the full suite; the fast tier (-m "not slow") runs a chain, a
# dynamic tree and a dynamic chain on a batch of 3
FAST_TREES = [t if t in ("chain4", "dyn_small", "dyn_chain") else pytest.param(t, marks=pytest.mark.slow)
              for t in TREES]


@cache
def _model() -> LlamaGen:
    return tiny_llamagen(seed=7)


@cache
def _drafter_model() -> EagleDrafterModel:
    torch.manual_seed(11)
    return EagleDrafterModel(DrafterConfig.for_target(_model().config)).eval()


@cache
def _greedy_ar(batch: int, cfg_scale: float) -> Tensor:
    s = SamplingConfig(temperature=0, cfg_scale=cfg_scale)
    return generate(LlamaGenTarget(_model(), s), torch.tensor(LABELS[batch])).codes


def _run(
    drafter_kind: str,
    tree: TreeConfig,
    labels: Tensor,
    sampling: SamplingConfig,
    seeds: list[int] | None = None,
    model: LlamaGen | None = None,
    logit_scale: float = 1.0,
) -> GenerationOutput:
    """One speculative ``generate`` with a fresh drafter (``oracle`` or random ``eagle``)."""
    model = model or _model()
    if drafter_kind == "oracle":
        drafter = make_oracle_drafter(model, labels, sampling, tree, logit_scale)
        nodes = drafter.num_nodes
    else:
        drafter, nodes = make_eagle_drafter(model, _drafter_model(), sampling, tree)
    target = LlamaGenTarget(model, sampling, max_tree_nodes=nodes)
    gens = None if seeds is None else make_generators(seeds)
    return generate(target, labels, generators=gens, drafter=drafter)


# ---- greedy SD == greedy AR -----------------------------------------------------------------


@pytest.mark.parametrize("cfg_scale", [1.0, 3.0])
@pytest.mark.parametrize("batch", [pytest.param(1, marks=pytest.mark.slow), 3])
@pytest.mark.parametrize("tree", FAST_TREES)
def test_greedy_oracle_reproduces_ar(tree: str, batch: int, cfg_scale: float) -> None:
    s = SamplingConfig(temperature=0, cfg_scale=cfg_scale)
    out = _run("oracle", TREES[tree], torch.tensor(LABELS[batch]), s)
    assert torch.equal(out.codes, _greedy_ar(batch, cfg_scale))
    assert out.stats.mean_accepted >= ORACLE_MIN_MEAN_ACCEPTED[tree]


@pytest.mark.parametrize("cfg_scale", [1.0, 3.0])
@pytest.mark.parametrize("batch", [pytest.param(1, marks=pytest.mark.slow), 3])
@pytest.mark.parametrize("tree", FAST_TREES)
def test_greedy_random_eagle_reproduces_ar(tree: str, batch: int, cfg_scale: float) -> None:
    s = SamplingConfig(temperature=0, cfg_scale=cfg_scale)
    out = _run("eagle", TREES[tree], torch.tensor(LABELS[batch]), s)
    assert torch.equal(out.codes, _greedy_ar(batch, cfg_scale))
    assert 1.0 <= out.stats.mean_accepted < 1.3  # a random drafter is (almost) never right


# ---- exact speculative sampling reproduces p ------------------------------------------------

DIST_TOKENS = 4  # the joint law of the first 4 image tokens is compared (of a 3x3 image)


# name -> (tree, oracle logit_scale). 0.6: q is a flatter copy of p, so drafts get rejected and
# residuals sampled. 2.0: q is sharper than p, so after a rejected first sibling the next draw's
# conditional q_j(x) = q(x) / (1 - q(x_1)) differs a lot from q(x) (a run that used q(x) instead
# fails with chi2 ~ 900 against a threshold of ~109; at 0.6 that bug is invisible).
DIST_RUNS = {
    "ar": (TreeConfig(kind="none"), 1.0),
    "chain": (TreeConfig.parse("chain:4"), 0.6),
    "static-flat-q": (TreeConfig.parse("static:mc_sim_7b_63"), 0.6),
    "static-sharp-q": (TreeConfig.parse("static:mc_sim_7b_63"), 2.0),
    "dynamic": (TreeConfig(kind="dynamic", depth=3, top_k=3, total_tokens=10), 0.6),
}


# The same runs with the round compiled by inductor as one region (``--compile``). The drafter is
# a random EAGLE model: the oracle cannot be compiled (its inputs grow every round). The static
# tree is cpu_9 (siblings at three depths), not the 63-node one the eager runs walk: the compiled
# walk runs the same functions at any tree size (unrolled per level and sibling), and this test
# takes 68 s cold instead of 108.
COMPILED_DIST_RUNS = {
    "ar-compiled": TreeConfig(kind="none"),
    "eagle-chain-compiled": TreeConfig.parse("chain:4"),
    "eagle-static-compiled": TreeConfig.parse("static:cpu_9"),
}


@cache
def _dist_run(name: str) -> GenerationOutput:
    model, labels = dist_model(), torch.full((DIST_ROWS,), DIST_LABEL)
    seeds = list(range(DIST_ROWS))
    if name in COMPILED_DIST_RUNS:
        tree = COMPILED_DIST_RUNS[name]
        drafter, nodes = None, 1
        if tree.kind != "none":
            torch.manual_seed(5)
            eagle = EagleDrafterModel(DrafterConfig.for_target(model.config)).eval()
            drafter, nodes = make_eagle_drafter(model, eagle, DIST_SAMPLING, tree)
        target = LlamaGenTarget(model, DIST_SAMPLING, max_tree_nodes=nodes, compile="default")
        return generate(target, labels, generators=make_generators(seeds), drafter=drafter, compile="default")
    tree, logit_scale = DIST_RUNS[name]
    if tree.kind == "none":
        return generate(LlamaGenTarget(model, DIST_SAMPLING), labels, generators=make_generators(seeds))
    return _run("oracle", tree, labels, DIST_SAMPLING, seeds, model=model, logit_scale=logit_scale)


@pytest.mark.parametrize("run", [run if run == "ar" else pytest.param(run, marks=pytest.mark.slow)
                                 for run in [*DIST_RUNS, *COMPILED_DIST_RUNS]])
def test_speculative_sampling_matches_target_distribution(run: str) -> None:
    """Chi-square goodness of fit of the first 4 tokens' joint law, at significance 0.001.

    False-positive rate: 0.1 % per test for a correct implementation (the seeds are fixed, so the
    outcome is deterministic: a failure after a change means the distribution moved, or, once in
    a thousand seed choices, bad luck). The power test below shows the same data rejects a
    slightly wrong target.
    """
    p = exact_joint(dist_model(), DIST_SAMPLING, DIST_TOKENS)
    out = _dist_run(run)
    codes = out.codes[:, :DIST_TOKENS]
    cell = (codes * 6 ** torch.arange(DIST_TOKENS - 1, -1, -1)).sum(1)
    assert bool((p[cell] > 0).all()), "a sample fell outside the top-k support"
    stat, df = chi_square(codes, p)
    assert df >= 30  # enough cells for a meaningful test
    assert stat < chi_square_threshold(df), f"chi2 = {stat:.1f} with {df} dof"
    if not run.startswith("ar"):
        assert out.stats.mean_accepted > 1.3  # drafts were accepted: the speculative path ran


@pytest.mark.slow
@pytest.mark.parametrize(
    "wrong",
    [
        SamplingConfig(temperature=1.0, top_k=4, cfg_scale=1.0),  # no guidance
        SamplingConfig(temperature=1.0, top_k=0, cfg_scale=2.0),  # no top-k
        SamplingConfig(temperature=1.0, top_k=4, cfg_scale=2.4),  # a 20 % stronger guidance
        SamplingConfig(temperature=1 / 0.6, top_k=4, cfg_scale=2.0),  # the drafter's q (unverified)
    ],
    ids=["no-cfg", "no-top-k", "cfg-2.4", "draft-q"],
)
def test_chi_square_has_power(wrong: SamplingConfig) -> None:
    """The speculative samples are rejected when compared with a wrong target distribution
    (measured statistics are 2.4-170x the threshold), so the test above can fail meaningfully."""
    codes = _dist_run("static-flat-q").codes[:, :DIST_TOKENS]
    stat, df = chi_square(codes, exact_joint(dist_model(), wrong, DIST_TOKENS))
    assert stat > chi_square_threshold(df)


# ---- tree attention == causal attention along each path -------------------------------------


def _commit_chain(target: LlamaGenTarget, tokens: Tensor, keep: Tensor) -> None:
    """Put ``tokens[b, :keep[b]]`` into row b's cache with one chain-shaped verify + commit."""
    b, n = tokens.shape
    chain = tree_from_parents(torch.arange(-1, n - 1).expand(b, -1).contiguous())
    target.verify(tokens, chain.mask, chain.depth)
    target.commit(torch.arange(n).expand(b, -1), keep)


@torch.no_grad()
def _reference_logits(model: LlamaGen, label: int, seq: Tensor, cfg_scale: float) -> Tensor:
    """Guided logits [V] after image tokens ``seq`` from an uncached full forward."""
    cond = model(torch.tensor([label]), seq[None])[0][0, -1]
    if cfg_scale == 1:
        return cond
    uncond = model(model.null_condition(1), seq[None])[0][0, -1]
    return uncond + cfg_scale * (cond - uncond)


def _path(parents: Tensor, node: int) -> list[int]:
    path = [node]
    while parents[path[0]] >= 0:
        path.insert(0, int(parents[path[0]]))
    return path


def _random_parents(b: int, t: int, seed: int) -> Tensor:
    gen = torch.Generator().manual_seed(seed)
    rows = [[-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, t)] for _ in range(b)]
    return torch.tensor(rows)


@pytest.mark.parametrize("shape", ["mc_sim_7b_63", "random"])
def test_tree_attention_equals_causal_paths(shape: str) -> None:
    model, s = _model(), SamplingConfig(temperature=0, cfg_scale=3.0)
    labels = [2, 6]
    gen = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, 256, (2, 7), generator=gen)
    keep = torch.tensor([7, 3])  # rows at different prefix lengths
    parents = static_tree(shape).parents.expand(2, -1) if shape != "random" else _random_parents(2, 20, 1)
    buffers = tree_from_parents(parents.contiguous())
    tokens = torch.randint(0, 256, parents.shape, generator=gen)
    target = LlamaGenTarget(model, s, max_tree_nodes=30)
    target.start(torch.tensor(labels))
    _commit_chain(target, prefix, keep)
    logits, _ = target.verify(tokens, buffers.mask, buffers.depth)  # [B, T, V]
    for b in range(2):
        for node in range(parents.shape[1]):
            seq = torch.cat([prefix[b, : keep[b]], tokens[b, _path(parents[b], node)]])
            ref = _reference_logits(model, labels[b], seq, s.cfg_scale)
            assert (logits[b, node] - ref).abs().max() <= 1e-4, (b, node)


def test_oracle_scores_match_target() -> None:
    """The oracle's root and node logits are the target's (what 'oracle' promises)."""
    model, s = _model(), SamplingConfig(temperature=0, cfg_scale=3.0)
    labels = torch.tensor([2, 6])
    oracle = OracleBackend(model, labels, s)
    oracle.start(torch.zeros(0), torch.tensor([4, 9]))
    oracle.commit(torch.zeros(0), torch.tensor([[1, 2, 3], [5, 0, 0]]), torch.tensor([3, 1]))
    known = [[4, 1, 2, 3], [9, 5]]
    root = oracle.begin()
    fed = oracle.feed(
        torch.full((2, 2), -1), torch.tensor([[10, 11], [12, 13]]), 1, torch.zeros(2, 2, 0, dtype=torch.bool)
    )
    deeper = oracle.feed(torch.tensor([[1], [0]]), torch.tensor([[20], [21]]), 2, torch.ones(2, 1, 2, dtype=torch.bool))
    for b in range(2):
        seq = torch.tensor(known[b])
        assert torch.allclose(root[b], _reference_logits(model, int(labels[b]), seq, 3.0), atol=1e-4)
        for e, tok in enumerate([[10, 11], [12, 13]][b]):
            ref = _reference_logits(model, int(labels[b]), torch.cat([seq, torch.tensor([tok])]), 3.0)
            assert torch.allclose(fed[b, e], ref, atol=1e-4)
        path = [[11, 20], [12, 21]][b]
        ref = _reference_logits(model, int(labels[b]), torch.cat([seq, torch.tensor(path)]), 3.0)
        assert torch.allclose(deeper[b, 0], ref, atol=1e-4)


# ---- commit == sequential decoding ----------------------------------------------------------


def test_commit_equals_sequential_decoding() -> None:
    """Keeping a path that skips siblings leaves the cache as one-by-one decoding would."""
    model, s = _model(), SamplingConfig(temperature=0, cfg_scale=3.0)
    labels = torch.tensor([1, 8])
    gen = torch.Generator().manual_seed(2)
    prefix, prefix_keep = torch.randint(0, 256, (2, 4), generator=gen), torch.tensor([4, 2])
    parents = torch.tensor([-1, 0, 0, 1, 2, 2])  # path 0 -> 2 -> 5 skips nodes 1, 3, 4
    buffers = tree_from_parents(parents.expand(2, -1).contiguous())
    tokens = torch.randint(0, 256, (2, 6), generator=gen)
    path, keep = torch.tensor([[0, 2, 5], [0, 1, 3]]), torch.tensor([3, 2])

    tree_target = LlamaGenTarget(model, s, max_tree_nodes=8)
    tree_target.start(labels)
    _commit_chain(tree_target, prefix, prefix_keep)
    tree_target.verify(tokens, buffers.mask, buffers.depth)
    tree_target.commit(path, keep)

    seq_target = LlamaGenTarget(model, s, max_tree_nodes=8)
    seq_target.start(labels)
    accepted = [torch.cat([prefix[b, : prefix_keep[b]], tokens[b, path[b, : keep[b]]]]).tolist() for b in range(2)]
    root = tree_from_parents(torch.full((2, 1), -1))
    for j in range(max(len(a) for a in accepted)):
        step = torch.tensor([[a[j] if j < len(a) else 0] for a in accepted])
        seq_target.verify(step, root.mask, root.depth)
        seq_target.commit(torch.zeros(2, 1, dtype=torch.long), torch.tensor([int(j < len(a)) for a in accepted]))

    a, b = tree_target.cache, seq_target.cache
    assert a is not None and b is not None
    assert torch.equal(a.lengths, b.lengths)
    for row, length in enumerate(a.lengths.tolist()):
        assert (a.k[:, row, :, :length] - b.k[:, row, :, :length]).abs().max() <= 1e-5
        assert (a.v[:, row, :, :length] - b.v[:, row, :, :length]).abs().max() <= 1e-5


def _committed(parents: Tensor, path: Tensor, keep: Tensor, in_order: bool) -> KVCache:
    """The cache after a prefix, one verify of the tree ``parents`` and the commit of ``path``."""
    model, s = _model(), SamplingConfig(temperature=0, cfg_scale=3.0)
    gen = torch.Generator().manual_seed(5)
    prefix = torch.randint(0, 256, (2, 4), generator=gen)
    buffers = tree_from_parents(parents.expand(2, -1).contiguous())
    target = LlamaGenTarget(model, s, max_tree_nodes=8)
    target.start(torch.tensor([3, 7]))
    _commit_chain(target, prefix, torch.tensor([4, 2]))
    target.verify(torch.randint(0, 256, (2, parents.shape[0]), generator=gen), buffers.mask, buffers.depth)
    target.commit(path, keep, in_order=in_order)
    assert target.cache is not None
    return target.cache


def _same_cache(a: KVCache, b: KVCache) -> bool:
    return torch.equal(a.lengths, b.lengths) and all(
        torch.equal(a.k[:, row, :, :n], b.k[:, row, :, :n]) and torch.equal(a.v[:, row, :, :n], b.v[:, row, :, :n])
        for row, n in enumerate(a.lengths.tolist()))


def test_a_chain_commits_in_place_as_the_moving_commit_would() -> None:
    """A chain's accepted path is its first nodes, so ``in_order`` (the loop's flag for chains and
    AR) only advances the lengths: the cache equals the one the gather-and-scatter commit leaves,
    bit for bit, for every accepted length. Power: on a tree path that skips nodes the flag would
    leave other keys in place (so the equality above is not a no-op)."""
    chain = torch.arange(-1, 5)
    for keep in ([1, 1], [2, 5], [6, 3], [4, 6]):
        j = torch.arange(6)[None, :]
        path = torch.where(j < torch.tensor(keep)[:, None], j, -1)
        assert _same_cache(_committed(chain, path, torch.tensor(keep), True),
                           _committed(chain, path, torch.tensor(keep), False)), keep
    tree, path = torch.tensor([-1, 0, 0, 1, 2, 2]), torch.tensor([[0, 2, 5], [0, 1, 3]])
    assert not _same_cache(_committed(tree, path, torch.tensor([3, 2]), True),
                           _committed(tree, path, torch.tensor([3, 2]), False))


# ---- rows of a batch are independent --------------------------------------------------------


@pytest.mark.parametrize("tree", ["mcsim", pytest.param("dyn_small", marks=pytest.mark.slow)])
@pytest.mark.parametrize("drafter", [pytest.param("eagle", marks=pytest.mark.slow), "oracle"])
def test_rows_independent_of_batch(drafter: str, tree: str) -> None:
    """Each row gives the same codes (and takes the same steps) alone as in a batch."""
    s = SamplingConfig(temperature=1.0, top_k=20, cfg_scale=2.0)
    labels, seeds = [4, 5, 6], [1, 2, 3]
    scale = 0.8 if drafter == "oracle" else 1.0
    batch = _run(drafter, TREES[tree], torch.tensor(labels), s, seeds, logit_scale=scale)
    for i in range(3):
        alone = _run(drafter, TREES[tree], torch.tensor(labels[i : i + 1]), s, seeds[i : i + 1], logit_scale=scale)
        assert torch.equal(batch.codes[i], alone.codes[0]), i
        assert int(batch.stats.target_forwards[i]) == int(alone.stats.target_forwards[0])
    if drafter == "oracle":  # rows really did drift apart (different prefix lengths in a step)
        assert any(len(set(step.tolist())) > 1 for step in batch.stats.tokens_per_step)


# ---- stats -----------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_spec_stats(temperature: float) -> None:
    s = SamplingConfig(temperature=temperature, top_k=20, cfg_scale=3.0)
    labels = torch.tensor(LABELS[3])
    out = _run("oracle", TREES["mcsim"], labels, s, [0, 1, 2], logit_scale=0.8)
    stats, n = out.stats, _model().config.block_size
    assert bool((stats.target_forwards < n).all())
    hist = stats.accept_histogram()
    verify_steps = int((stats.target_forwards - 1).sum())  # the prefill is not a verify step
    assert sum(hist.values()) == verify_steps
    assert sum(k * c for k, c in hist.items()) == 3 * (n - 1)  # every token after the prefill's
    assert torch.allclose(stats.mean_accepted_per_row, n / stats.target_forwards.float())
    assert stats.mean_accepted == pytest.approx(float((n / stats.target_forwards.float()).mean()))
    assert stats.drafter_forwards > 0


# ---- bad input -------------------------------------------------------------------------------


def test_drafter_target_mismatch() -> None:
    cfg = _model().config
    with pytest.raises(LanternError, match=r"drafter hidden_size \(32\) does not match .* \(dim 64\)"):
        check_drafter_matches_target(DrafterConfig.for_target(cfg, hidden_size=32, num_attention_heads=4), cfg)
    with pytest.raises(LanternError, match=r"drafter vocab_size \(512\) does not match .* \(256 image tokens\)"):
        check_drafter_matches_target(DrafterConfig.for_target(cfg, vocab_size=512), cfg)
    check_drafter_matches_target(DrafterConfig.for_target(cfg), cfg)  # a matching pair passes


def test_unknown_tree_name() -> None:
    with pytest.raises(LanternError, match="unknown static tree 'nope'; known: .*mc_sim_7b_63"):
        TreeConfig.parse("static:nope")


def test_tree_deeper_than_image() -> None:
    with pytest.raises(LanternError, match=r"tree 'chain:4' has depth 4, not less than the image's 4 tokens"):
        check_tree_fits(TreeConfig.parse("chain:4"), 4)
    with pytest.raises(LanternError, match=r"'static:mc_sim_7b_63' has depth 5"):
        check_tree_fits(TreeConfig.parse("static:mc_sim_7b_63"), 4)
    with pytest.raises(LanternError, match=r"'dynamic' \(depth 4.*has depth 5"):
        check_tree_fits(TreeConfig.parse("dynamic"), 5)
    check_tree_fits(TreeConfig.parse("chain:3"), 4)
    check_tree_fits(TreeConfig.parse("static:naive_extend_57"), 256)


def test_dynamic_top_k_larger_than_vocabulary() -> None:
    s = SamplingConfig(temperature=0)
    oracle = OracleBackend(_model(), torch.tensor([0]), s)
    with pytest.raises(LanternError, match=r"tree top_k \(300\) is larger than the vocabulary \(256\)"):
        TreeDrafter(oracle, TreeConfig(kind="dynamic", top_k=300), s, 256)
