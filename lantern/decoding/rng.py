"""Counter-based random numbers per batch row: pure tensor ops, the same eager, compiled and in a graph.

Why not ``torch.Generator``: a decoding round is one compiled region (``lantern.decoding.compiling``),
and generators are opaque to dynamo and inductor (they break the graph or fall back to unfused
kernels) and cannot be replayed inside a CUDA graph unless registered. The fast engines draw from a
stateless counter hash instead (vLLM's model runner v2 ``gumbel.py``: noise = f(request seed,
position, token id); flashinfer's Philox ``seed, offset`` arguments). lantern does the same.

The scheme: every row b has a 64-bit seed, folded into two 32-bit keys ``k0[b], k1[b]``. Its
stream is numbered by a device counter ``e`` of the elements it has drawn so far, like Philox's
offset. The counter is per row: every row of a batch draws the same counts, but a row that joins a
running batch (continuous batching, ``lantern.decoding.rows``) starts its stream at 0.
Element ``e`` of row b is

    h = fmix32(((fmix32(lo(e) ^ k0) + (hi(e) ^ k1)) mod 2^32)      lo / hi: e's 32-bit halves
    u = (2 * (h >> 9) + 1) / 2^24                                 (an odd multiple of 2^-24 in (0, 1))

with MurmurHash3's 32-bit finaliser ``fmix32`` (a bijection with full avalanche). So a row's numbers
depend only on (its seed, the element's index in its stream): never on which rows share its batch,
and identical on every device, eager or compiled (integer ops only; multiplications are split
into 16-bit halves so that no product leaves int64). For a fixed row the map e -> h is a keyed
bijection (no repeats within 2^32 draws); two rows with different seeds are not shifted copies of
each other, because the second key is added after the first bijection. ``u`` is never 0 or 1, so
``-log(u)`` is a finite Exp(1) draw. About 45 elementwise ops per call, whatever its size.

A row's seed comes from its ``torch.Generator`` (one 62-bit draw, so a generator reused for a
second call gives new images, as before) or from an integer directly.
"""

from __future__ import annotations

import torch
from torch import Tensor

_M32 = 0xFFFFFFFF


def _mul32(x: Tensor, c: int) -> Tensor:
    """(x * c) mod 2^32 for x in [0, 2^32), without an int64 product above 2^49."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _M32


def fmix32(h: Tensor) -> Tensor:
    """MurmurHash3's finaliser: a bijection of [0, 2^32) with full avalanche (int64 tensors)."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def uniforms_at(k0: Tensor, k1: Tensor, offset: Tensor, n: int) -> Tensor:
    """The scheme of the module docstring: [B, n] float32 uniforms, elements ``offset .. offset + n - 1``
    of the streams keyed by k0, k1 [B] (``offset``: int64, 0-d or one per row [B])."""
    e = offset.reshape(-1, 1) + torch.arange(n, dtype=torch.int64, device=k0.device)  # [1 or B, n] element indices
    h = fmix32((e & _M32) ^ k0[:, None])  # [B, n]
    h = fmix32((h + (((e >> 32) & _M32) ^ k1[:, None])) & _M32)
    return ((h >> 9) * 2 + 1).to(torch.float32) * (2.0**-24)


class RowRandom:
    """Per-row random streams for one decode (see the module docstring).

    ``uniform(n)`` returns [B, n] uniforms in (0, 1) and advances the element counter in place, so
    the counter is state a compiled round mutates like a KV cache (its address never changes).
    """

    def __init__(self, seeds: Tensor) -> None:
        """seeds: [B] int64 (any values; only their low 62 bits matter)."""
        seeds = seeds.long()
        self.k0 = fmix32(seeds & _M32)
        self.k1 = fmix32(((seeds >> 32) & _M32) ^ 0x5BD1E995)
        self.drawn = torch.zeros_like(seeds)  # [B] elements each row has drawn so far

    @classmethod
    def from_seeds(cls, seeds: list[int], device: torch.device | str) -> RowRandom:
        return cls(torch.tensor([s & ((1 << 62) - 1) for s in seeds], dtype=torch.int64, device=device))

    @classmethod
    def from_generators(cls, generators: list[torch.Generator], device: torch.device | str) -> RowRandom:
        """One 62-bit seed per row, drawn from the row's generator (so its state matters, and a
        generator reused for another decode gives another stream)."""
        seeds = [int(torch.randint(0, 1 << 62, (1,), generator=g, device=g.device)) for g in generators]
        return cls.from_seeds(seeds, device)

    @property
    def rows(self) -> int:
        return self.k0.shape[0]

    def row_tensors(self) -> list[tuple[Tensor | None, int, int]]:
        """Per-row state (``lantern.decoding.rows``): the keys and each row's counter."""
        return [(self.k0, 1, 0), (self.k1, 1, 0), (self.drawn, 1, 0)]

    def uniform(self, n: int) -> Tensor:
        """[B, n] uniforms in (0, 1); the next call draws fresh ones."""
        u = uniforms_at(self.k0, self.k1, self.drawn, n)
        self.drawn.add_(n)
        return u

    def exponential(self, n: int) -> Tensor:
        """[B, n] Exp(1) draws (``-log u``)."""
        return -torch.log(self.uniform(n))
