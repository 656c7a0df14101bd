"""AR generation through the one loop: seeds, greedy, batching, CFG."""

from __future__ import annotations

import pytest
import torch

from lantern.decoding.config import SamplingConfig
from lantern.decoding.loop import generate
from lantern.decoding.sampling import apply_cfg, make_generators
from lantern.errors import LanternError
from lantern.models.llamagen import LlamaGen
from lantern.targets.llamagen import LlamaGenTarget
from lantern.testing import tiny_llamagen


@pytest.fixture(scope="module")
def model() -> LlamaGen:
    return tiny_llamagen(seed=7)


def _run(model: LlamaGen, labels: list[int], seeds: list[int], **sampling: float) -> torch.Tensor:
    target = LlamaGenTarget(model, SamplingConfig(**sampling))  # type: ignore[arg-type]
    return generate(target, torch.tensor(labels), generators=make_generators(seeds)).codes


def _greedy_reference(model: LlamaGen, labels: torch.Tensor, cfg_scale: float) -> torch.Tensor:
    """Slow oracle: uncached full forward per token, argmax of the guided logits."""
    b = labels.shape[0]
    codes = torch.zeros(b, 0, dtype=torch.long)
    for _ in range(model.config.block_size):
        lc = model(labels, codes)[0][:, -1]
        if cfg_scale > 1:
            lu = model(model.null_condition(b), codes)[0][:, -1]
            lc = apply_cfg(torch.cat([lc, lu]), cfg_scale, 2)
        codes = torch.cat([codes, lc.argmax(-1, keepdim=True)], 1)
    return codes


@pytest.mark.parametrize("cfg_scale", [1.0, 4.0])
def test_greedy_matches_uncached_oracle(model: LlamaGen, cfg_scale: float) -> None:
    labels = torch.tensor([0, 3, 7])
    target = LlamaGenTarget(model, SamplingConfig(temperature=0, cfg_scale=cfg_scale))
    out = generate(target, labels)
    assert torch.equal(out.codes, _greedy_reference(model, labels, cfg_scale))
    assert out.stats.mean_accepted == 1.0
    assert out.stats.target_forwards.tolist() == [64, 64, 64]


def test_tiny_temperature_is_argmax(model: LlamaGen) -> None:
    greedy = _run(model, [1, 2], [0, 0], temperature=0)
    cold = _run(model, [1, 2], [5, 6], temperature=1e-4)
    assert torch.equal(greedy, cold)
    # and greedy ignores the seed
    assert torch.equal(greedy, _run(model, [1, 2], [9, 9], temperature=0))


def test_same_seed_same_codes(model: LlamaGen) -> None:
    a = _run(model, [1, 2, 3], [10, 11, 12], top_k=50, cfg_scale=2.0)
    b = _run(model, [1, 2, 3], [10, 11, 12], top_k=50, cfg_scale=2.0)
    c = _run(model, [1, 2, 3], [13, 14, 15], top_k=50, cfg_scale=2.0)
    assert torch.equal(a, b)
    assert (a != c).float().mean() > 0.5  # different seeds: mostly different tokens


def test_rows_independent_of_batch(model: LlamaGen) -> None:
    """Each row has its own generator: a row's codes do not depend on its batch-mates."""
    batch = _run(model, [4, 5, 6], [1, 2, 3], top_k=20)
    for i, (lab, seed) in enumerate([(4, 1), (5, 2), (6, 3)]):
        assert torch.equal(batch[i], _run(model, [lab], [seed], top_k=20)[0])


def test_top_k_one_is_greedy(model: LlamaGen) -> None:
    assert torch.equal(_run(model, [8], [3], top_k=1), _run(model, [8], [3], temperature=0))


def test_sampling_needs_generators(model: LlamaGen) -> None:
    target = LlamaGenTarget(model, SamplingConfig())
    with pytest.raises(LanternError, match="one torch.Generator per row"):
        generate(target, torch.tensor([0, 1]))


def test_first_token_distribution_matches_model() -> None:
    """The first sampled token follows softmax of the prefill logits (chi-square over the 8 most
    likely tokens + rest, 8 dof, threshold 26.12 = p 0.001 false-positive rate, fixed seeds)."""
    label = torch.tensor([2])
    n = 3000
    # Many rows in one batch, one generator each; only token 0 is looked at.
    small = tiny_llamagen(seed=7, block_size=4)
    target = LlamaGenTarget(small, SamplingConfig())
    codes = generate(target, label.expand(n), generators=make_generators(list(range(n)))).codes
    logits = small(label, torch.zeros(1, 0, dtype=torch.long))[0][0, -1]
    p = logits.softmax(-1)
    top = p.argsort(descending=True)[:8]
    counts = torch.stack([(codes[:, 0] == t).sum() for t in top]).float()
    rest = n - counts.sum()
    expected = torch.cat([p[top], (1 - p[top].sum()).reshape(1)]) * n
    observed = torch.cat([counts, rest.reshape(1)])
    chi2 = ((observed - expected) ** 2 / expected).sum().item()
    assert chi2 < 26.12


def test_codes_are_ordinary_tensors(model: LlamaGen) -> None:
    """The loop runs under inference_mode for speed; its codes must still work as autograd inputs
    (e.g. as training data), which inference tensors do not."""
    codes = _run(model, [0, 1], [0, 1])
    assert not codes.is_inference()
    emb = torch.nn.Embedding(model.config.vocab_size, 3)
    emb(codes).sum().backward()
    assert emb.weight.grad is not None and float(emb.weight.grad.abs().sum()) > 0
