"""PJD's grid pieces (``lantern.decoding.pjd``): out-of-raster-order commits, grid positions, row-causal mask.

The engine side runs the target's cached forward round by round: each round verifies a block of
per-row windows (several image rows at once, padded), then keeps a prefix of some rows' windows
(``KVCache.commit`` + ``commit_cells``), so cache slots end up in commit order, not raster order.
The reference is an explicit recomputation: one uncached-style forward over the condition, every
token kept so far and the block, at their image positions, where each token attends to exactly
the tokens it could see when it was computed. Every round's logits must agree, for every row of a
batch whose rows progress differently; with one row at a time the result is plain AR's.
"""

from __future__ import annotations

import pytest
import torch
from conftest import PJD_WIDTH, PJDToken, pjd_model, pjd_reference
from torch import Tensor

from lantern.decoding.cache import KVCache
from lantern.decoding.config import PJDConfig, check_pjd_fits
from lantern.decoding.pjd import active_rows, commit_cells, grid_positions, grid_verify_mask
from lantern.errors import LanternError
from lantern.models.llamagen import LlamaGen


class _Engine:
    """The cached side: one KVCache, slot_cell bookkeeping, rows of a batch in lockstep rounds."""

    def __init__(self, model: LlamaGen, labels: Tensor) -> None:
        cfg = model.config
        self.model, self.cls, n = model, cfg.cls_token_num, labels.shape[0]
        self.cache = KVCache(cfg.n_layer, n, cfg.kv_heads, self.cls + cfg.block_size + 16, cfg.head_dim)
        self.slot_cell = torch.full((n, self.cache.max_len), -1, dtype=torch.long)
        h = model.embed_condition(labels)
        pos = torch.arange(self.cls).expand(n, -1)
        mask = torch.ones(self.cls, self.cls, dtype=torch.bool).tril().expand(n, -1, -1)
        model.forward_cached(h, pos, pos, mask, self.cache)
        self.cache.lengths.fill_(self.cls)

    def verify(self, tokens: Tensor, cells: Tensor, rows: Tensor) -> Tensor:
        t = tokens.shape[1]
        lengths = self.cache.lengths
        kv_len = int(lengths.max()) + t
        mask = grid_verify_mask(self.slot_cell, lengths, cells, rows, kv_len)
        slots = lengths[:, None] + torch.arange(t)
        positions = grid_positions(cells, self.cls, PJD_WIDTH)
        hidden = self.model.forward_cached(self.model.tok_embeddings(tokens), positions, slots, mask, self.cache)
        return self.model.logits(hidden)

    def commit(self, cells: Tensor, keep: Tensor, num_keep: Tensor) -> None:
        commit_cells(self.slot_cell, self.cache.lengths, cells, keep, num_keep)
        self.cache.commit(keep, num_keep)


# Per round and row: the window of each active image row as (row, first cell of the window,
# length), and how many of each window's tokens the round keeps (a prefix, as a Jacobi test does).
ROUNDS = [
    {0: [((0, 0, 3), 3)], 1: [((0, 0, 2), 1)]},
    {0: [((0, 3, 1), 1), ((1, 4, 3), 2)], 1: [((0, 1, 3), 3)]},
    {0: [((1, 6, 2), 0), ((2, 8, 3), 3)], 1: [((0, 4, 0), 0), ((1, 4, 3), 3)]},  # 0: row 2 commits, row 1 has holes
    {0: [((1, 6, 2), 2), ((2, 11, 1), 1), ((3, 12, 2), 1)], 1: [((1, 7, 1), 1), ((2, 8, 2), 2)]},
]


@torch.no_grad()
def test_out_of_order_commits_equal_explicit_recomputation() -> None:
    """Four rounds, two batch rows progressing differently, up to three image rows verified in one
    forward, commits that leave holes in earlier rows: every block token's logits equal the
    explicit recomputation over exactly what it may see (to float round-off)."""
    model, labels = pjd_model(), torch.tensor([3, 7])
    engine = _Engine(model, labels)
    cls, g = model.config.cls_token_num, torch.Generator().manual_seed(0)
    history: list[list[PJDToken]] = [[PJDToken(0, -1, list(range(i))) for i in range(cls)] for _ in range(2)]
    checked = 0
    for plan in ROUNDS:
        t = max(sum(w[2] for w, _ in plan[b]) for b in range(2))
        tokens, cells = torch.zeros(2, t, dtype=torch.long), torch.zeros(2, t, dtype=torch.long)
        rows = torch.full((2, t), -1, dtype=torch.long)
        blocks: list[list[PJDToken]] = [[], []]
        for b in range(2):
            for (row, start, length), _ in plan[b]:
                for cell in range(start, start + length):
                    i = len(blocks[b])
                    tokens[b, i] = int(torch.randint(0, 32, (1,), generator=g))
                    cells[b, i], rows[b, i] = cell, row
                    sees = [k for k, tok in enumerate(history[b]) if tok.cell < cell]  # condition: cell -1
                    sees += [len(history[b]) + j for j, o in enumerate(blocks[b]) if o.cell < cell
                             and int(rows[b, j]) == row]
                    blocks[b].append(PJDToken(int(tokens[b, i]), cell, sees))
        logits = engine.verify(tokens, cells, rows)
        keep_lists = []
        for b in range(2):
            ref = pjd_reference(model, int(labels[b]), history[b], blocks[b])
            assert torch.allclose(logits[b, : len(blocks[b])], ref, atol=1e-5), (plan, b)
            checked += len(blocks[b])
            offset, keep = 0, []
            for (_, _, length), kept in plan[b]:
                keep += list(range(offset, offset + kept))
                offset += length
            keep_lists.append(keep)
        a = max(len(k) for k in keep_lists)
        keep_t = torch.tensor([k + [-1] * (a - len(k)) for k in keep_lists], dtype=torch.long)
        engine.commit(cells, keep_t, torch.tensor([len(k) for k in keep_lists]))
        for b in range(2):  # the kept tokens join the history with what they saw when computed
            base = len(history[b])
            remap = {base + j: base + i for i, j in enumerate(keep_lists[b])}
            for j in keep_lists[b]:
                tok = blocks[b][j]
                history[b].append(PJDToken(tok.token, tok.cell, [remap.get(s, s) for s in tok.sees]))
    assert checked >= 20
    assert torch.equal(engine.cache.lengths, torch.tensor([cls + 13, cls + 10]))  # the rows drifted apart


@torch.no_grad()
def test_one_row_at_a_time_is_plain_ar() -> None:
    """Committing whole windows of one row at a time in raster order, the grid forward gives the
    model's own uncached causal logits: positions and mask reduce to raster-order AR."""
    model, label = pjd_model(), torch.tensor([5])
    tokens = torch.randint(0, 32, (1, PJD_WIDTH * PJD_WIDTH), generator=torch.Generator().manual_seed(1))
    full = model(label, tokens)[0][0]  # [n+1, V]: row i predicts image token i
    engine = _Engine(model, label)
    for row in range(PJD_WIDTH):
        for start, length in ((0, 3), (3, 1)):  # two windows per row
            cells = row * PJD_WIDTH + torch.arange(start, start + length)[None]
            logits = engine.verify(tokens[:, cells[0]], cells, cells // PJD_WIDTH)
            assert torch.allclose(logits[0], full[cells[0] + 1], atol=1e-5), (row, start)
            engine.commit(cells, torch.arange(length)[None], torch.tensor([length]))


def test_mask_by_hand() -> None:
    """Committed: condition (slot 0), cells 0, 1, 4, 9 (slots 1-4, commit order). Block: row 0's
    window (cells 2, 3), row 1's (cell 5), one padding token."""
    slot_cell = torch.tensor([[-1, 0, 1, 4, 9, -1, -1, -1, -1]])
    block_cell, block_row = torch.tensor([[2, 3, 5, 0]]), torch.tensor([[0, 0, 1, -1]])
    mask = grid_verify_mask(slot_cell, torch.tensor([5]), block_cell, block_row, 9)
    assert mask[0, 0].tolist() == [True, True, True, False, False, True, False, False, False]
    assert mask[0, 1].tolist() == [True, True, True, False, False, True, True, False, False]
    # cell 5 sees the committed cells before it in raster order (0, 1, 4), not cell 9, nor row 0's window
    assert mask[0, 2].tolist() == [True, True, True, True, False, False, False, True, False]
    assert mask[0, 3].tolist() == [False] * 8 + [True]  # padding: itself only
    assert grid_positions(torch.tensor([0, 3, 4, 9]), 1, PJD_WIDTH).tolist() == [1, 4, 5, 10]
    assert grid_positions(torch.tensor([0, 3, 4, 9]), 3, PJD_WIDTH, row_ends=True).tolist() == [3, 6, 8, 14]


def test_zipar_activation() -> None:
    committed = torch.tensor([[4, 2, 0, 0], [3, 0, 0, 0], [4, 4, 1, 0]])
    assert active_rows(committed, 2, 4).tolist() == [
        [False, True, True, False], [True, True, False, False], [False, False, True, False]]
    assert active_rows(committed, 4, 4).tolist() == [  # context = row length: one row at a time
        [False, True, False, False], [True, False, False, False], [False, False, True, False]]
    assert active_rows(committed, 9, 4).tolist() == active_rows(committed, 4, 4).tolist()


def test_bad_pjd_settings() -> None:
    with pytest.raises(LanternError, match=r"--pjd-window must be an integer >= 1, got 0"):
        PJDConfig(window=0)
    with pytest.raises(LanternError, match=r"--pjd-context must be an integer >= 1, got True"):
        PJDConfig(context=True)
    with pytest.raises(LanternError, match=r"--pjd-window \(5\) must be at most the image row length \(4\)"):
        check_pjd_fits(PJDConfig(window=5, context=2), 4, 4)
    with pytest.raises(LanternError, match=r"--pjd-context \(6\) must be at most the image row length \(4\)"):
        check_pjd_fits(PJDConfig(window=2, context=6), 4, 4)
    check_pjd_fits(PJDConfig(window=4, context=4), 4, 4)
