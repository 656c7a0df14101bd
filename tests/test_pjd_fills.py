"""PJD's first guesses (``PJDConfig.init``): uniform noise, or the token of the cell above; and the
flush bookkeeping of a stand-in root."""

from __future__ import annotations

import pytest
import torch

from lantern.decoding.config import PJDConfig, SamplingConfig
from lantern.decoding.pjd import GridJacobiDrafter
from lantern.decoding.rng import RowRandom
from lantern.errors import LanternError


def _drafter(init: str, rows: int = 1) -> GridJacobiDrafter:
    d = GridJacobiDrafter(PJDConfig(window=3, context=2, init=init), SamplingConfig(temperature=1.0), 50, 16, width=4)
    d.start(torch.zeros(rows, 1, 1), torch.arange(7, 7 + rows))
    return d


def test_row_above_copies_the_cell_above_else_the_left_neighbour() -> None:
    d = _drafter("row_above")
    d.canvas[0, 0:4] = torch.tensor([7, 11, 12, 13])  # row 0 known (the rest of the canvas: no guess yet)
    d.known[0, 0], d.known[0, 1] = 4, 1  # row 1 has its first token: its window is cells 5..7
    d.canvas[0, 4] = 20
    cell = torch.tensor([[5, 6, 7, 9, 10, 11]])  # row 1's window, then row 2 (nothing above it yet)
    d._initialise(cell, torch.ones_like(cell, dtype=torch.bool), RowRandom.from_seeds([0], torch.device("cpu")))
    assert d.canvas[0, 5:8].tolist() == [11, 12, 13]  # the row above
    # row 2: no token above; cell 9's left (cell 8) is empty too -> noise; then each copies its left
    row2 = d.canvas[0, 9:12].tolist()
    assert row2[1] == row2[0] and row2[2] == row2[0] and 0 <= row2[0] < 50


def test_random_fill_and_row_above_draw_the_same_numbers() -> None:
    """Both fills draw one uniform per slot, so a row's stream advances alike (batch independence)."""
    a, b = _drafter("random"), _drafter("row_above")
    ra, rb = RowRandom.from_seeds([5], torch.device("cpu")), RowRandom.from_seeds([5], torch.device("cpu"))
    cell = torch.tensor([[9, 10, 11]])
    a._initialise(cell, torch.ones_like(cell, dtype=torch.bool), ra)
    b._initialise(cell, torch.ones_like(cell, dtype=torch.bool), rb)
    assert a.canvas[0, 9].item() == b.canvas[0, 9].item()  # no neighbour to copy: the same noise
    assert torch.equal(ra.uniform(4), rb.uniform(4))


def test_bad_init_is_one_line() -> None:
    with pytest.raises(LanternError, match="--pjd-init must be one of random, row_above, above_mode, got 'above'"):
        PJDConfig(init="above")


def test_a_real_stand_in_flushes_row_0_once() -> None:
    """Row 1 opening on row 0's real, uncached last token caches it (its stand-in root): row 0 is then
    flushed and no later flush chain caches that token again, although row 0's padding chain sits
    in the same block (chain rows 1, 0: both mark row 0, the repeated index that once lost the mark)."""
    d = GridJacobiDrafter(PJDConfig(window=2, context=2), SamplingConfig(temperature=1.0), 50, 16, width=4)
    d.start(torch.zeros(1, 1, 1), torch.tensor([7]))
    assert d.chains >= 2
    d.canvas[0, 0:4] = torch.tensor([7, 11, 12, 13])
    d.known[0, 0] = 4  # row 0 complete, its last token not cached; row 1 open with nothing known
    rng = RowRandom.from_seeds([3], torch.device("cpu"))
    block = d.propose_grid(rng)
    assert block.chain_row[0, :2].tolist() == [1, 0] and bool(block.standin_real[0, 0])
    assert not bool(block.decodes[0, 1]) and not bool(block.commit_root[0, 1])  # row 0's chain: padding
    t = block.tokens.shape[1]
    logits = torch.randn(1, t, 50, generator=torch.Generator().manual_seed(0))
    keep, num_keep, _, _, _ = d.commit_grid(block, torch.zeros(1, d.chains, dtype=torch.long),
                                            torch.zeros(1, d.chains, dtype=torch.long), logits, rng)
    assert int(num_keep[0]) >= 1 and int(keep[0, 0]) == 0  # the stand-in root (row 0's last token) is cached
    assert bool(d.flushed[0, 0])
    _, _, flush = d._schedule()
    assert not bool(flush.any())  # so no flush chain caches it a second time
