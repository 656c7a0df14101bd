"""The counter-based per-row random streams (``lantern.decoding.rng``).

The statistical tests use fixed seeds, so each outcome is deterministic; each is a chi-square test
at significance 0.001 (a correct generator fails a given seed choice with probability 0.1 %), and
each has a power check: the same test rejects a slightly wrong generator.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from scipy.stats import chi2

from lantern.decoding import compiling
from lantern.decoding.rng import RowRandom, fmix32, uniforms_at
from lantern.decoding.sampling import make_generators

ALPHA = 0.001


def _chi_square_uniform(u: torch.Tensor, bins: int) -> tuple[float, float]:
    """(statistic, threshold at ALPHA) of u's histogram over ``bins`` equal bins of (0, 1)."""
    counts = torch.histc(u.double().flatten(), bins=bins, min=0.0, max=1.0)
    expected = u.numel() / bins
    return float(((counts - expected) ** 2 / expected).sum()), float(chi2.ppf(1 - ALPHA, bins - 1))


def test_uniforms_are_uniform_with_power() -> None:
    rng = RowRandom.from_seeds([0, 1, 2, 3], "cpu")
    u = torch.cat([rng.uniform(100_000) for _ in range(3)], dim=1)  # 4 rows x 3 calls
    assert float(u.min()) > 0 and float(u.max()) < 1  # never 0 or 1: -log(u) is finite
    stat, threshold = _chi_square_uniform(u, 1000)
    assert stat < threshold, (stat, threshold)
    bent = u ** 1.03  # a 3 % distortion of the law: rejected by the same test
    assert _chi_square_uniform(bent, 1000)[0] > threshold


def _pairs_chi_square(a: torch.Tensor, b: torch.Tensor, bins: int = 32) -> tuple[float, float]:
    """Independence of (a, b) as uniform pairs: chi-square over a bins x bins grid."""
    cell = (a * bins).long().clamp(max=bins - 1) * bins + (b * bins).long().clamp(max=bins - 1)
    counts = torch.bincount(cell.flatten(), minlength=bins * bins).double()
    expected = a.numel() / bins**2
    return float(((counts - expected) ** 2 / expected).sum()), float(chi2.ppf(1 - ALPHA, bins**2 - 1))


def test_streams_are_independent_with_power() -> None:
    """Neighbouring elements, consecutive calls and rows with adjacent seeds look independent; so do
    streams past the counter's low 32 bits."""
    rng = RowRandom.from_seeds([0, 1], "cpu")
    first, second = rng.uniform(200_000), rng.uniform(200_000)
    k0, k1 = rng.k0, rng.k1
    far = uniforms_at(k0, k1, torch.tensor((1 << 32) - 100_000), 200_000)  # crosses into the high word
    for a, b in [(first[0, :-1], first[0, 1:]), (first[0], second[0]), (first[0], first[1]), (far[0], far[1]),
                 (far[0], first[0])]:
        stat, threshold = _pairs_chi_square(a, b)
        assert stat < threshold, (stat, threshold)
    # A weak dependence with exact uniform marginals: 2 % of row 0's numbers copied from row 1.
    copied = torch.where(second[1] < 0.02, first[1], first[0])
    assert _pairs_chi_square(copied, first[1])[0] > threshold


def test_rows_ignore_their_batch_and_calls_advance() -> None:
    alone = RowRandom.from_seeds([5], "cpu")
    batch = RowRandom.from_seeds([9, 5, 7], "cpu")
    for n in (1, 17, 1000):
        a, b = alone.uniform(n), batch.uniform(n)
        assert torch.equal(a[0], b[1])
    again = RowRandom.from_seeds([5], "cpu")
    assert not torch.equal(again.uniform(17), again.uniform(17))  # each call draws fresh numbers
    assert again.drawn.tolist() == [34]  # the element counter, one per row


def test_generator_seeding_follows_the_generator_state() -> None:
    """A row's seed is one draw from its generator: the same state gives the same stream, and a
    generator reused for a second decode gives another one."""
    g1, g2 = make_generators([3, 3])
    a, b = RowRandom.from_generators([g1], "cpu"), RowRandom.from_generators([g2], "cpu")
    assert torch.equal(a.uniform(8), b.uniform(8))
    c = RowRandom.from_generators([g1], "cpu")  # g1 advanced by one draw
    assert not torch.equal(c.uniform(8), RowRandom.from_generators(make_generators([3]), "cpu").uniform(8))


def test_fmix32_is_a_bijection_on_a_sample() -> None:
    """The 16-bit-split multiplication keeps MurmurHash3's finaliser exact (a bijection: no two
    inputs of a sample collide) and in [0, 2^32)."""
    x = torch.cat([torch.arange(1 << 16), torch.tensor([(1 << 32) - 1, 1 << 31, 0x12345678])])
    h = fmix32(x)
    assert int(h.min()) >= 0 and int(h.max()) < (1 << 32)
    assert h.unique().numel() == x.numel()
    assert int(fmix32(torch.tensor([1]))) == 0x514E28B7  # MurmurHash3 fmix32(1), the reference value


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None, reason="inductor needs a C++ compiler")
def test_compiled_uniforms_equal_eager_bit_for_bit() -> None:
    """Integer ops only: inductor's kernels, built as lantern's compiled rounds build them, give
    exactly the eager numbers. Built with a plain ``torch.compile`` instead, torch 2.13's AVX2
    vector code (``ATEN_CPU_CAPABILITY=avx2``, or a CPU without AVX-512) gave garbage in the last
    elements of some rows, in a pytest worker though not in a plain script: that code is what
    ``compiling.cpu_vector_options`` turns off."""
    k0 = fmix32(torch.tensor([1, 2, 3]))
    k1 = fmix32(torch.tensor([4, 5, 6]))
    offset = torch.tensor((1 << 32) - 100)  # the stream crosses into the counter's high word
    compiled = compiling.compiled(uniforms_at, "default")
    assert torch.equal(compiled(k0, k1, offset, 4096), uniforms_at(k0, k1, offset, 4096))
