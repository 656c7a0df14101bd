"""Logits processing: classifier-free guidance, temperature, top-k, top-p (pure functions).

The order is LlamaGen's ([LlamaGen code] generate.py): guidance on raw logits, then temperature, then top-k
(ties with the k-th largest are kept), then top-p (tokens whose cumulative probability, sorted
descending, exceeds p are dropped; the most likely token is always kept). The official LANTERN
code applies top-p before top-k; the two orders agree whenever top_p = 1, which is every
configuration the papers report.

The same processing is applied to target and drafter logits, so the drafter's q and the target's
p live on the same support.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lantern.decoding.config import SamplingConfig
from lantern.errors import check


def apply_cfg(logits: Tensor, scale: float, num_streams: int) -> Tensor:
    """Combine the ``[cond; uncond]`` halves: ``l_u + s * (l_c - l_u)``.

    logits: [S*B, ..., V] with S = ``num_streams`` (2 with guidance, 1 without). Returns [B, ..., V].
    """
    if num_streams == 1:
        return logits
    cond, uncond = logits.chunk(2, dim=0)
    return uncond + scale * (cond - uncond)


# Longest scan inductor generates as one scan. Longer scans over a few rows become a "split scan"
# kernel on CUDA (more than 8192 elements, under 2 rows per multiprocessor), and torch 2.11 fuses a
# reduction into that kernel, which it cannot generate ("NYI TritonSplitDimKernel reductions"):
# the compiled round of a 16384-code LlamaGen failed at batch 1 on an H200 (benchmarks/RESULTS.md).
SCAN_BLOCK = 8192


def cumsum_last(x: Tensor) -> Tensor:
    """``x.cumsum(-1)`` as scans no longer than :data:`SCAN_BLOCK`: within blocks of 128, then
    over the block totals. The plain scan where the last dim fits (photos, Chameleon's 8192 codes),
    so those results are bit for bit what they were."""
    v = x.shape[-1]
    if v <= SCAN_BLOCK:
        return x.cumsum(dim=-1)
    blocks = -(-v // 128)
    padded = torch.nn.functional.pad(x, (0, blocks * 128 - v)).unflatten(-1, (blocks, 128))
    inner = padded.cumsum(dim=-1)  # [..., blocks, 128]
    totals = inner[..., -1]
    offsets = totals.cumsum(dim=-1) - totals  # what precedes each block
    return (inner + offsets.unsqueeze(-1)).flatten(-2)[..., :v]


def top_k_filter(logits: Tensor, k: int) -> Tensor:
    """Keep logits >= the k-th largest along the last dim (ties kept); others become -inf."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]  # [..., 1]
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: Tensor, p: float) -> Tensor:
    """Nucleus filter: drop tokens once the sorted cumulative probability exceeds ``p``."""
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    cum = cumsum_last(sorted_logits.softmax(dim=-1))
    drop_sorted = cum > p
    # Shift right so the token that crosses p is kept, and the first token always survives.
    drop_sorted[..., 1:] = drop_sorted[..., :-1].clone()
    drop_sorted[..., 0] = False
    drop = drop_sorted.scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def process_logits(logits: Tensor, cfg: SamplingConfig) -> Tensor:
    """Temperature, top-k, top-p on (already guided) logits [..., V]. Greedy keeps logits as is."""
    if cfg.greedy:
        return logits
    logits = logits / max(cfg.temperature, 1e-5)
    logits = top_k_filter(logits, cfg.top_k)
    return top_p_filter(logits, cfg.top_p)


def one_hot(index: Tensor, num_classes: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """``F.one_hot(index, num_classes).to(dtype)`` without its host sync (it reads the indices'
    min and max to validate them): a scatter of ones. index [...] -> [..., num_classes]."""
    out = torch.zeros(*index.shape, num_classes, dtype=dtype, device=index.device)
    return out.scatter_(-1, index[..., None], 1)


def probs_from_logits(logits: Tensor, cfg: SamplingConfig) -> Tensor:
    """The distribution tokens are drawn from: softmax of processed logits, or one-hot argmax."""
    if cfg.greedy:
        return one_hot(logits.argmax(dim=-1), logits.shape[-1], logits.dtype)
    return process_logits(logits.float(), cfg).softmax(dim=-1)


def sample_from_probs(probs: Tensor, u: Tensor) -> Tensor:
    """Inverse-CDF sampling with one uniform per row; never returns a zero-probability token.

    probs: [B, V] (need not be normalised); u: [B] in [0, 1). Returns [B] int64.
    """
    cdf = cumsum_last(probs)  # [B, V]
    target = (u.to(cdf.dtype) * cdf[:, -1]).unsqueeze(-1)  # [B, 1]
    # first index with cdf > target: for a non-decreasing cdf, the count of entries <= target (what
    # searchsorted(right=True) returns). A count is a plain reduction; torch 2.11's inductor cannot
    # lower searchsorted on the blocked scan's view (NotImplementedError: View, on an H200).
    idx = (cdf <= target).sum(dim=-1)
    # Float round-off can push idx past the last positive entry; clamp to it (0 if none is).
    positions = torch.arange(probs.shape[-1], device=probs.device)
    last_positive = torch.where(probs > 0, positions, 0).amax(dim=-1)
    return torch.minimum(idx, last_positive)


def make_generators(seeds: list[int], device: torch.device | str = "cpu") -> list[torch.Generator]:
    """One seeded generator per row."""
    gens = []
    for s in seeds:
        g = torch.Generator(device=device)
        g.manual_seed(int(s))
        gens.append(g)
    return gens


def validate_sampling_for_vocab(cfg: SamplingConfig, vocab_size: int) -> None:
    check(
        cfg.top_k <= vocab_size,
        f"top_k ({cfg.top_k}) is larger than the vocabulary ({vocab_size} image tokens)", field="top_k",
    )
