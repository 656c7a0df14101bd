"""Logits processing (CFG, temperature, top-k, top-p) against hand-computed examples."""

from __future__ import annotations

import math

import pytest
import torch

from lantern.decoding.config import SamplingConfig
from lantern.decoding.sampling import (
    SCAN_BLOCK,
    apply_cfg,
    cumsum_last,
    probs_from_logits,
    process_logits,
    sample_from_probs,
    top_k_filter,
    top_p_filter,
    validate_sampling_for_vocab,
)
from lantern.errors import LanternError

NEG = float("-inf")


def test_cfg_formula() -> None:
    cond = torch.tensor([[1.0, 2.0, 0.0]])
    uncond = torch.tensor([[0.5, 0.0, 1.0]])
    out = apply_cfg(torch.cat([cond, uncond]), 4.0, 2)
    # u + s (c - u) = [0.5 + 4*0.5, 0 + 4*2, 1 + 4*(-1)]
    assert torch.equal(out, torch.tensor([[2.5, 8.0, -3.0]]))
    assert torch.equal(apply_cfg(cond, 4.0, 1), cond)  # one stream: no guidance


def test_top_k_keeps_ties() -> None:
    logits = torch.tensor([[3.0, 1.0, 2.0, 2.0, 0.0]])
    assert torch.equal(top_k_filter(logits, 2), torch.tensor([[3.0, NEG, 2.0, 2.0, NEG]]))
    assert torch.equal(top_k_filter(logits, 1), torch.tensor([[3.0, NEG, NEG, NEG, NEG]]))
    assert torch.equal(top_k_filter(logits, 0), logits)


def test_top_p_hand_example() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    # cumulative 0.5, 0.8, 0.95, 1.0: with p = 0.7 keep the first two (the crossing token stays).
    kept = top_p_filter(logits, 0.7)
    assert torch.isfinite(kept).tolist() == [[True, True, False, False]]
    # p smaller than the top token's mass keeps the top token only.
    assert torch.isfinite(top_p_filter(logits, 0.1)).tolist() == [[True, False, False, False]]
    # Unsorted input: the filter works on sorted order and maps back.
    perm = torch.tensor([2, 0, 3, 1])
    kept_perm = top_p_filter(logits[:, perm], 0.7)
    assert torch.isfinite(kept_perm).tolist() == [[False, True, False, True]]


def test_process_order_temperature_then_topk_then_topp() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    cfg = SamplingConfig(temperature=0.5, top_k=3, top_p=0.9)
    out = process_logits(logits, cfg)
    scaled = torch.tensor([4.0, 2.0, 0.0])
    p = scaled.softmax(-1)  # [0.867, 0.117, 0.016]: cumulative crosses 0.9 at index 1
    assert p[0] < 0.9 < p[0] + p[1]
    assert torch.allclose(out[0, :2], scaled[:2]) and out[0, 2:].isinf().all()
    probs = probs_from_logits(logits, cfg)
    expect = scaled[:2].softmax(-1)
    assert torch.allclose(probs[0, :2], expect) and probs[0, 2:].sum() == 0


def test_greedy_probs_are_one_hot() -> None:
    logits = torch.tensor([[0.1, 0.7, 0.7, -2.0]])
    probs = probs_from_logits(logits, SamplingConfig(temperature=0))
    assert probs.tolist() == [[0.0, 1.0, 0.0, 0.0]]  # first maximum


def test_inverse_cdf_sampling() -> None:
    probs = torch.tensor([[0.2, 0.0, 0.5, 0.3]] * 5)
    u = torch.tensor([0.0, 0.19, 0.2, 0.69, 0.9999])
    assert sample_from_probs(probs, u).tolist() == [0, 0, 2, 2, 3]
    # Never a zero-probability token, even for u at the top edge with round-off.
    probs = torch.tensor([[0.3, 0.7, 0.0, 0.0]])
    assert sample_from_probs(probs, torch.tensor([1.0 - 1e-9])).item() == 1


def test_sampling_frequencies() -> None:
    """Inverse-CDF sampling matches p: chi-square with 3 dof, threshold 16.27 (p = 0.001)."""
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([0.1, 0.2, 0.3, 0.4])
    n = 20000
    draws = sample_from_probs(p.expand(n, -1), torch.rand(n, generator=g))
    counts = torch.bincount(draws, minlength=4).float()
    chi2 = ((counts - n * p) ** 2 / (n * p)).sum().item()
    assert chi2 < 16.27


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(temperature=-0.1), "temperature must be >= 0"),
        (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
        (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
        (dict(top_k=-1), "top_k must be an integer >= 0"),
        (dict(cfg_scale=0.5), r"cfg_scale must be in \[1, 100\]"),
        (dict(cfg_scale=1e39), r"cfg_scale must be in \[1, 100\]"),
        (dict(cfg_scale=math.inf), r"cfg_scale must be in \[1, 100\]"),
        (dict(temperature=math.nan), "temperature must be >= 0"),
    ],
)
def test_bad_sampling_config(kwargs: dict[str, float], match: str) -> None:
    with pytest.raises(LanternError, match=match):
        SamplingConfig(**kwargs)  # type: ignore[arg-type]


def test_temperature_zero_is_valid() -> None:
    assert SamplingConfig(temperature=0).greedy


def test_top_k_larger_than_vocab() -> None:
    with pytest.raises(LanternError, match=r"top_k \(300\) is larger than the vocabulary \(256"):
        validate_sampling_for_vocab(SamplingConfig(top_k=300), 256)


# cumsum_last: the vocabulary scan as short scans (a long split scan does not compile on CUDA under torch 2.11)
@pytest.mark.parametrize("vocab", [100, SCAN_BLOCK, SCAN_BLOCK + 1, 16384, 20000])
def test_cumsum_last_matches_a_float64_scan(vocab: int) -> None:
    g = torch.Generator().manual_seed(vocab)
    x = torch.rand(3, 2, vocab, generator=g)
    got = cumsum_last(x)
    assert got.shape == x.shape and got.dtype == x.dtype
    want = x.double().cumsum(-1)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-3)
    if vocab <= SCAN_BLOCK:  # short vocabularies keep the plain scan, bit for bit
        assert torch.equal(got, x.cumsum(-1))


def test_cumsum_last_on_a_long_vocabulary_uses_no_scan_longer_than_the_block() -> None:
    seen: list[int] = []
    real = torch.Tensor.cumsum

    def spy(self: torch.Tensor, dim: int, **kw: object) -> torch.Tensor:
        seen.append(self.shape[dim])
        return real(self, dim, **kw)

    torch.Tensor.cumsum = spy  # type: ignore[method-assign]
    try:
        cumsum_last(torch.rand(1, 16384))
    finally:
        torch.Tensor.cumsum = real  # type: ignore[method-assign]
    assert seen and max(seen) <= SCAN_BLOCK, seen


def test_sample_from_probs_on_a_long_vocabulary_is_the_inverse_cdf() -> None:
    """16384 codes (LlamaGen): every draw is the first index whose float64 CDF exceeds u * total,
    up to the float32 rounding of the CDF (draws within 2e-6 of the total of a boundary are left out)."""
    g = torch.Generator().manual_seed(7)
    probs = torch.rand(64, 16384, generator=g) ** 4
    probs[:, 16000:] = 0  # a zero tail: never drawn, even at u -> 1
    u = torch.rand(64, generator=g)
    u[:4] = torch.tensor([0.0, 0.999999, 0.5, 1 - 1e-7])
    out = sample_from_probs(probs, u)
    cdf = probs.double().cumsum(-1)
    target = u.double() * cdf[:, -1]
    want = torch.searchsorted(cdf, target[:, None], right=True).squeeze(-1).clamp(max=15999)
    near = ((cdf - target[:, None]).abs() / cdf[:, -1:]).min(-1).values < 2e-6
    assert (out < 16000).all()
    assert torch.equal(out[~near], want[~near])
    assert (~near).sum() >= 50  # the comparison covers most draws (power of the check)
