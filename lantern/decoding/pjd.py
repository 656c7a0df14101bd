"""Parallel Jacobi decoding (PJD, arXiv 2606.05703): the grid pieces and its drafter.

PJD lays Jacobi drafts out in 2-D: row r + 1 of the image becomes active once row r has
``context`` committed tokens (ZipAR's activation rule, arXiv 2412.04062), every active row drafts
a short window after its committed prefix, and one target forward verifies the windows of all
active rows. A window runs on past its row end while the next row is not open
(:func:`last_predicted_cell`): the cells it covers are then in AR order, so at ``context`` = the row
length PJD is SJD's chain over the whole image, not one cut at every row end. PJD needs what the
raster-order loop never does: commits out of raster order (a row's tokens enter the cache while an
earlier row still has holes). This module holds the parts
that make such a forward exact, tested against an explicit recomputation (tests/test_pjd.py):

* cache slots are decoupled from image cells: ``KVCache.commit`` keeps any chosen subset of a
  verify block (in slot order, which is commit order), and ``slot_cell`` [N, S] records the image
  cell (raster index) each slot holds, -1 for the condition prefix;
* positions come from the image grid (:func:`grid_positions`), never from slot order;
* visibility is an explicit mask (:func:`grid_verify_mask`): a block token sees the condition,
  every committed token *earlier in raster order*, and the earlier tokens of its own row's window
  (row-causal: windows of different rows never see each other).

:class:`GridJacobiDrafter` is PJD as a drafter of the one loop (``lantern.generate``): every round
it lays out one Jacobi chain per scheduled image row (root + ``window`` guesses), the loop verifies
all chains in one target forward (``Target.verify_grid``), accepts each chain with SJD's rule (the
loop's own chain acceptance on the chains reshaped to rows) and commits the kept tokens out of
raster order (``Target.commit_grid``). See docs/DESIGN.md ("PJD").

The first token of a newly opened row has no in-row predecessor. As ZipAR's reference code
(``decode_n_tokens_zipar``: an auxiliary copy of the row above's last generated token, fed at the
raster position just before the new row, dropped once the row has its first token), the root of
a row with no known token is a *stand-in*: the last known token of the row above, at cell
``r * width - 1``. When the row above is complete the stand-in is that row's real last token at
its real cell, so it is committed like any root; otherwise it is never committed (the row's first
token, computed while it saw the stand-in, is cached with that dependency, as in ZipAR). A complete row
whose last token is not yet cached (it was the chain's next token) gets a root-only *flush* chain
when the row below already has tokens, so later rows see it (ZipAR's ``last_token_in_row_idx``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from lantern.decoding.acceptance import clean_context, maximal_coupling

# The grid's settings live in the torch-free lantern.decoding.config; re-exported here, where they were defined first.
from lantern.decoding.config import DEFAULT_PJD_CONTEXT as DEFAULT_PJD_CONTEXT
from lantern.decoding.config import DEFAULT_PJD_WINDOW as DEFAULT_PJD_WINDOW
from lantern.decoding.config import PJD_INITS as PJD_INITS
from lantern.decoding.config import PJDConfig, SamplingConfig, check_pjd_fits
from lantern.decoding.rng import RowRandom
from lantern.decoding.sampling import one_hot, probs_from_logits, sample_from_probs
from lantern.decoding.trees import TreeBuffers, tree_from_parents
from lantern.errors import check


def active_rows(committed: Tensor, context: int, width: int) -> Tensor:
    """ZipAR's activation rule. committed [B, H]: committed tokens per image row (a prefix of the
    row). Row 0 is open from the start; row r > 0 opens once row r - 1 has ``context`` committed
    tokens; a full row is closed. Returns [B, H] bool."""
    done = torch.full_like(committed[:, :1], width)
    previous = torch.cat([done, committed[:, :-1]], dim=1)  # [B, H] committed tokens of the row above
    return (previous >= min(context, width)) & (committed < width)


def last_predicted_cell(row: Tensor, known: Tensor, context: int, width: int) -> Tensor:
    """The last cell a chain of image row ``row`` [B, R] may predict (its depth cap), [B, R].

    Its row end, or the next row's end when that next row is not open (ZipAR's rule: row r has
    fewer than ``context`` known tokens, so row r + 1 has none): no other window touches those
    cells this round, and the chain's cells in raster order are then exactly the AR order, so
    the window may run on across the row end (at context = row length PJD is then SJD's chain
    over the whole image). ``known`` [B, H] as in :func:`active_rows`; a window never spans
    more than one row end (``check_pjd_fits``: window <= width)."""
    height = known.shape[1]
    below = (row + 1).clamp(max=height - 1)
    crosses = (row + 1 < height) & (known.gather(1, below) == 0) & (known.gather(1, row) < min(context, width))
    return (row + 1 + crosses.long()) * width - 1


def grid_positions(cells: Tensor, prefix: int, width: int, row_ends: bool = False) -> Tensor:
    """Rotary positions of image cells (raster indices, any order): ``prefix + cell`` (LlamaGen,
    whose 2-D RoPE table is indexed by raster position), plus one per earlier row for layouts
    with an end-of-row token after every row (Lumina-mGPT's new-line tokens)."""
    return prefix + cells + (torch.div(cells, width, rounding_mode="floor") if row_ends else 0)


def grid_verify_mask(
    slot_cell: Tensor,  # [N, S] raster cell of each committed slot; -1 = condition prefix
    lengths: Tensor,  # [N] committed slots per row (the block is written at [len, len + T))
    block_cell: Tensor,  # [N, T] raster cell of each block token
    block_row: Tensor,  # [N, T] its image row (its window); -1 = padding
    kv_len: int,  # slots the forward attends over (>= lengths.max() + T)
) -> Tensor:
    """[N, T, kv_len] bool: what each block token may see (see the module docstring).

    Padding tokens see only themselves (their outputs are discarded, the softmax needs one key).
    """
    n, t = block_cell.shape
    cols = torch.arange(kv_len, device=slot_cell.device)[None, :]  # [1, S]
    committed = cols < lengths[:, None]  # [N, S]
    cell = torch.full((n, kv_len), -1, dtype=torch.long, device=slot_cell.device)
    width = min(kv_len, slot_cell.shape[1])
    cell[:, :width] = slot_cell[:, :width]
    real = block_row >= 0  # [N, T]
    earlier = (cell[:, None, :] < block_cell[:, :, None]) & real[:, :, None]  # [N, T, S] (prefix: -1 < any cell)
    see_committed = committed[:, None, :] & earlier
    same_row = (block_row[:, :, None] == block_row[:, None, :]) & (block_cell[:, None, :] <= block_cell[:, :, None])
    own = same_row & real[:, :, None] | torch.eye(t, dtype=torch.bool, device=slot_cell.device)[None]  # [N, T, T]
    block_slot = cols[:, None, :] - lengths[:, None, None]  # [N, 1, S] offset into the block
    in_block = (block_slot >= 0) & (block_slot < t)
    see_block = own.gather(2, block_slot.clamp(0, t - 1).expand(n, t, kv_len)) & in_block
    return see_committed | see_block


def commit_cells(slot_cell: Tensor, lengths: Tensor, block_cell: Tensor, keep: Tensor, num_keep: Tensor) -> None:
    """Record the cells of the block tokens a round keeps (``keep`` [N, A] ascending block offsets,
    -1 padded; ``num_keep`` [N]) in ``slot_cell``, at the slots ``KVCache.commit(keep, num_keep)``
    moves them to. Call it before the cache's commit (both read the old lengths)."""
    a = keep.shape[1]
    j = torch.arange(a, device=keep.device)[None, :]
    valid = j < num_keep[:, None]
    dst = (lengths[:, None] + j).clamp(max=slot_cell.shape[1] - 1)
    cells = block_cell.gather(1, keep.clamp(min=0))
    slot_cell.scatter_(1, dst, torch.where(valid, cells, slot_cell.gather(1, dst)))


@dataclass(frozen=True)
class GridBlock:
    """One round's proposal: ``R`` chains per batch row (root + ``W`` guesses each), flattened to
    ``T = R * (W + 1)`` nodes in chain order, plus what the acceptance and the commit need."""

    tokens: Tensor  # [B, T] node tokens
    cells: Tensor  # [B, T] raster cell of each node (0 for padding)
    rows: Tensor  # [B, T] image row of the node's chain; -1 = padding (also guesses past the depth cap)
    chain_row: Tensor  # [B, R] image row of each chain (any row for padding chains)
    first_cell: Tensor  # [B, R] cell the chain's root predicts (its first guess's cell)
    max_depth: Tensor  # [B, R] deepest usable guess per chain (0: root only)
    commit_root: Tensor  # [B, R] the root is a real token not yet cached: keep it
    decodes: Tensor  # [B, R] the chain decodes new tokens of its row (False: flush or padding)
    standin_real: Tensor  # [B, R] the root is the row above's real, uncached last token
    buffers: TreeBuffers  # chain buffers for B * R chains of W + 1 nodes
    q_draft: Tensor | None  # [B * R, W + 1, V] law each guess was drawn from (None: greedy)
    relaxable: Tensor  # [B, T] bool: the guess was drawn from a prediction (False: a model-free fill)
    clean: Tensor  # [B, T] bool: drawn, and conditioned on what its test will see (clean-context credit)


def grid_chains(window: int, context: int, width: int, height: int) -> int:
    """Chains per round: one row at a time when ``context`` covers a row (lossless, SJD's shape);
    otherwise about ``width / context`` open rows plus one flush chain, at most ``height``."""
    if context >= width:
        return 1
    return min(height, -(-width // context) + 1)


class GridJacobiDrafter:
    """PJD as a drafter of the one loop (see the module docstring).

    State per batch row: ``known [B, H]`` tokens known per image row (a prefix of the row; the
    last known token of a row is its *pending* root, not yet cached), ``flushed [B, H]`` (a
    complete row's last token is cached), ``canvas [B, N + 1]`` known tokens and guesses by cell
    (-1 = none; column N is a scratch column for masked writes), and for sampled decoding
    ``q [B, N + 1, V]`` with ``drawn [B, N + 1]``: the law a carried guess was drawn from (a
    guess that is not ``drawn`` was initialised: a point mass), and ``clean_root [B, N + 1]``: for
    a redraw with a clean context (``lantern.decoding.acceptance.clean_context``), the cell of the
    guess rejected when it was drawn, which is its chain's root when the chain is next proposed
    (-1: not clean; a guess tested from another root, as when the next row opens on guesses the
    row above's window made, is not clean either). Guesses are redrawn from each round's
    predictions, row by row as ``lantern.decoding.jacobi`` does: independently (SJD's rule) or
    coupled with the guess they replace (``PJDConfig.coupling``: SCD's maximal coupling).

    Randomness per batch row and round is a fixed count (``R * W`` initial guesses, ``R * (W + 2)``
    acceptance, ``R * (W + 1)`` redraws) from the row's own stream (``lantern.decoding.rng``), so a row's codes do not
    depend on its batch.
    """

    forwards = 0  # no drafter model: the target predicts for itself
    # Windows run on across a row end when the next row is not open (last_predicted_cell);
    # False keeps every window inside its row (the earlier behaviour, kept for comparisons).
    crosses_rows = True

    def __init__(self, config: PJDConfig, sampling: SamplingConfig, vocab_size: int, num_tokens: int,
                 width: int | None = None) -> None:
        """``width``: codes per image row (None: a square grid, as LlamaGen's)."""
        if width is None:
            width = math.isqrt(num_tokens)
            check(width * width == num_tokens, f"PJD needs a square token grid, got {num_tokens} image tokens")
        check(num_tokens % width == 0, f"{num_tokens} image tokens do not fill rows of {width}")
        height = num_tokens // width
        check_pjd_fits(config, height, width)
        self.config, self.sampling = config, sampling
        self.vocab_size, self.num_tokens, self.width, self.height = vocab_size, num_tokens, width, height
        self.chains = grid_chains(config.window, config.context, width, height)
        self.known = self.flushed = self.canvas = self.drawn = self.mode = self.clean_root = torch.empty(0)
        self.q: Tensor | None = None
        self._own_rng: RowRandom | None = None
        self._buffers: TreeBuffers | None = None

    @property
    def num_nodes(self) -> int:
        """Block size per round (what the target cache must hold beyond the image)."""
        return self.chains * (self.config.window + 1)

    def start(self, hidden: Tensor, root: Tensor) -> None:
        """hidden is unused; root [B] is image token 0 (the pending root of image row 0)."""
        b, device, n = root.shape[0], root.device, self.num_tokens
        self.known = torch.zeros(b, self.height, dtype=torch.long, device=device)
        self.known[:, 0] = 1
        self.flushed = torch.zeros(b, self.height, dtype=torch.bool, device=device)
        self.canvas = torch.full((b, n + 1), -1, dtype=torch.long, device=device)
        self.canvas[:, 0] = root
        self.drawn = torch.zeros(b, n + 1, dtype=torch.bool, device=device)
        self.clean_root = torch.full((b, n + 1), -1, dtype=torch.long, device=device)
        self.mode = torch.full((b, n + 1), -1, dtype=torch.long, device=device)  # above_mode's source
        self.q = None if self.sampling.greedy else torch.zeros(b, n + 1, self.vocab_size, device=device)
        self._own_rng = RowRandom.from_seeds([0] * b, device)
        self._chain(b * self.chains, device)  # built here: tree buffers cost host syncs

    # -- propose ------------------------------------------------------------------------------------

    def _schedule(self) -> tuple[Tensor, Tensor, Tensor]:
        """(chain_row [B, R], decodes [B, R], flush [B, R]): the open rows (ZipAR's rule) and the
        rows to flush, first rows first, at most R; the rest wait for a later round."""
        known, width, r = self.known, self.width, self.chains
        opened = active_rows(known, self.config.context, width)
        below = torch.cat([known[:, 1:], torch.zeros_like(known[:, :1])], dim=1)
        flush = (known >= width) & ~self.flushed & (below > 0)
        wanted = opened | flush
        order = torch.argsort((~wanted).to(torch.int8), dim=1, stable=True)[:, :r]  # [B, R]
        valid = torch.arange(r, device=known.device)[None, :] < wanted.sum(1, keepdim=True)
        return order, valid & opened.gather(1, order), valid & flush.gather(1, order)

    def propose_grid(self, rng: RowRandom | None) -> GridBlock:
        gens = rng if rng is not None else self._own_rng
        assert gens is not None
        w, width, n = self.config.window, self.width, self.num_tokens
        row, decodes, flush = self._schedule()
        b, r = row.shape
        k = self.known.gather(1, row)  # [B, R]
        above = (row - 1).clamp(min=0)
        k_above = self.known.gather(1, above)
        standin = decodes & (k == 0)
        root_cell = torch.where(k == 0, row * width - 1, row * width + k - 1)
        source = torch.where(standin, above * width + k_above - 1, root_cell)  # the stand-in copies the row above
        root = self.canvas.gather(1, source.clamp(min=0)).clamp(min=0)  # padding chains may read an empty cell
        standin_real = standin & (k_above >= width) & ~self.flushed.gather(1, above)
        commit_root = (decodes & ((k > 0) | standin_real)) | flush
        first = row * width + k  # [B, R] cell of guess 0
        # Node j predicts cell first + j: the cap keeps the last prediction at the chain's last
        # cell (a row's last token is sampled as the image's is in raster order).
        last = last_predicted_cell(row, self.known, self.config.context, width) if self.crosses_rows \
            else (row + 1) * width - 1
        max_depth = torch.where(decodes, (last - first).clamp(min=0, max=w), 0)
        j = torch.arange(w, device=row.device)
        usable = (j[None, None, :] < max_depth[:, :, None])  # [B, R, W]
        cell = torch.where(usable, first[:, :, None] + j, n)  # unusable guesses use the scratch column
        self._initialise(cell.view(b, -1), usable.view(b, -1), gens)
        guesses = self.canvas.gather(1, cell.view(b, -1)).view(b, r, w).clamp(min=0)
        tokens = torch.cat([root[:, :, None], guesses], dim=2).view(b, -1)
        real = torch.cat([(decodes | flush)[:, :, None], usable], dim=2)
        cells = torch.where(real, torch.cat([root_cell[:, :, None], cell], dim=2), 0).view(b, -1)
        rows = torch.where(real, row[:, :, None], -1).view(b, -1)
        q_draft = None
        if self.q is not None:
            q_guess = torch.where(self.drawn.gather(1, cell.view(b, -1))[:, :, None],
                                  self.q.gather(1, cell.view(b, -1, 1).expand(-1, -1, self.vocab_size)),
                                  one_hot(guesses.view(b, -1), self.vocab_size))
            q_guess = q_guess.view(b * r, w, -1)
            q_draft = torch.cat([q_guess, torch.zeros_like(q_guess[:, :1])], dim=1)  # node j's child ~ q[:, j]
        # Guesses drawn from an earlier round's prediction may take a relaxed rule's credit; fills
        # (uniform noise) are tested exactly (lantern.decoding.acceptance: drawn / undrawn).
        drawn = self.drawn.gather(1, cell.view(b, -1)).view(b, r, w)
        relaxable = torch.cat([torch.ones_like(drawn[:, :, :1]), drawn], dim=2).view(b, -1)
        clean = drawn & (self.clean_root.gather(1, cell.view(b, -1)).view(b, r, w) == root_cell[:, :, None])
        clean = torch.cat([torch.ones_like(clean[:, :, :1]), clean], dim=2).view(b, -1)
        return GridBlock(tokens, cells, rows, row, first, max_depth, commit_root, decodes, standin_real,
                         self._chain(b * r, row.device), q_draft, relaxable, clean)

    def _initialise(self, cell: Tensor, usable: Tensor, gens: RowRandom) -> None:
        """First guesses at usable cells that have none yet (``PJDConfig.init``): uniform noise, or
        the token above (else to the left; else noise), or their predictions' modes
        (``above_mode``). The noise is drawn either way, so a row's stream advances the same
        whatever its batch-mates hold."""
        u = gens.uniform(cell.shape[1])
        noise = (u * self.vocab_size).long().clamp(max=self.vocab_size - 1)
        if self.config.init == "random":
            old = self.canvas.gather(1, cell)
            self.canvas.scatter_(1, cell, torch.where(usable & (old < 0), noise, old))
            return
        b, w = cell.shape[0], self.config.window
        cells, fill, noise = cell.view(b, -1, w), usable.view(b, -1, w), noise.view(b, -1, w)
        for i in range(w):  # slot by slot along each chain: a guess may copy the one just made to its left
            c = cells[:, :, i]
            above = self._neighbour((c - self.width).clamp(min=0))
            left = self._neighbour((c - 1).clamp(min=0))
            guess = torch.where((c % self.width > 0) & (left >= 0), left, noise[:, :, i])
            guess = torch.where((c >= self.width) & (above >= 0), above, guess)
            old = self.canvas.gather(1, c)
            self.canvas.scatter_(1, c, torch.where(fill[:, :, i] & (old < 0), guess, old))

    def _neighbour(self, cell: Tensor) -> Tensor:
        """[B, M] what a fill copies from ``cell`` [B, M]: the token there (-1: none), or for
        ``above_mode`` the mode of the target's last prediction for it when there is one (a cell
        never predicted, such as a guess just filled or image token 0, gives its token)."""
        token = self.canvas.gather(1, cell)
        if self.config.init != "above_mode":
            return token
        mode = self.mode.gather(1, cell)
        return torch.where(mode >= 0, mode, token)

    def _chain(self, chains: int, device: torch.device) -> TreeBuffers:
        if self._buffers is None or self._buffers.parents.shape[0] != chains:
            parents = torch.arange(-1, self.config.window, device=device)
            self._buffers = tree_from_parents(parents[None].expand(chains, -1).contiguous())
        return self._buffers

    # -- commit -------------------------------------------------------------------------------------

    def commit_grid(
        self, block: GridBlock, num_acc: Tensor, next_token: Tensor, logits: Tensor, rng: RowRandom | None,
        probs: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """Record a round: ``num_acc`` / ``next_token`` [B, R] per chain, ``logits`` [B, T, V] guided,
        ``probs`` their p if the acceptance made it (else made here, when sampling).

        Returns (keep [B, T] block offsets to cache, ascending, -1 padded; num_keep [B]; cells
        [B, R * (W + 1)] and values to write into the codes, masked writes aimed at cell N; new
        tokens per batch row [B])."""
        w, n = self.config.window, self.num_tokens
        b, r = block.chain_row.shape
        a = torch.where(block.decodes, num_acc, 0)
        j = torch.arange(w + 1, device=a.device)
        drafts = block.tokens.view(b, r, w + 1)[:, :, 1:]
        vals = torch.cat([drafts, next_token[:, :, None]], dim=2).scatter(2, a[:, :, None], next_token[:, :, None])
        new_cell = block.first_cell[:, :, None] + j  # [B, R, W+1]: node j predicts this cell
        fresh = (j <= a[:, :, None]) & block.decodes[:, :, None]
        cells = torch.where(fresh, new_cell, n).view(b, -1)
        vals = torch.where(fresh.view(b, -1), vals.view(b, -1), self.canvas.gather(1, cells))
        self.canvas.scatter_(1, cells, vals)
        # A window that ran across its row end adds tokens to two rows: count each cell in its own row.
        cell_row = torch.div(new_cell, self.width, rounding_mode="floor").clamp(max=self.height - 1)
        self.known.scatter_add_(1, cell_row.view(b, -1), fresh.long().view(b, -1))
        # Flush chains cache a complete row's last token; so does a chain whose pending token is
        # already in the next row (its row's last token was an accepted guess, kept this round).
        crossed = block.decodes & (block.first_cell + a >= (block.chain_row + 1) * self.width)
        done = (block.commit_root & ~block.decodes) | crossed
        self.flushed.scatter_(1, block.chain_row, done | self.flushed.gather(1, block.chain_row))
        # A stand-in that was the row above's real last token cached it: that row is flushed. Rows 0
        # and 1 both point at row 0 here, and scatter_ keeps one write of a repeated index (row 0's
        # padding chain's "not flushed" could undo row 1's, caching that token again later), so the
        # marks are summed, which no order changes.
        above = (block.chain_row - 1).clamp(min=0)
        stood_in = torch.zeros_like(self.known).scatter_add_(1, above, block.standin_real.long())
        self.flushed |= stood_in > 0
        kept = torch.cat([block.commit_root[:, :, None], block.decodes[:, :, None] & (j[1:] <= a[:, :, None])], dim=2)
        keep, num_keep = kept_offsets(kept.view(b, -1))
        gens = rng if rng is not None else self._own_rng
        assert gens is not None
        self._carry_over(block, a, new_cell, logits.view(b, r, w + 1, -1), gens,
                         None if probs is None else probs.view(b, r, w + 1, -1))
        return keep, num_keep, cells, vals, torch.where(block.decodes, a + 1, 0).sum(1)

    def _carry_over(self, block: GridBlock, a: Tensor, new_cell: Tensor, logits: Tensor, gens: RowRandom,
                    probs: Tensor | None = None) -> None:
        """Redraw the guess at every cell a usable node predicted that is still unknown (Jacobi
        carry-over, per row as in ``lantern.decoding.jacobi``); its q becomes the node's p. ``a``
        [B, R]: guesses each chain accepted (node a + 1 held the rejected one); ``probs``: p of
        ``logits`` [B, R, t, V] if already made."""
        b, r, t, v = logits.shape
        j = torch.arange(t, device=logits.device)
        cell_row = torch.div(new_cell, self.width, rounding_mode="floor").clamp(max=self.height - 1)  # [B, R, t]
        k_now = self.known.gather(1, cell_row.view(b, -1)).view(b, r, t)  # the cell's own row (windows cross)
        open_cell = new_cell - cell_row * self.width >= k_now
        predicted = block.decodes[:, :, None] & (j <= block.max_depth[:, :, None])  # [B, R, t]
        carry = predicted & open_cell
        if self.config.init == "above_mode":  # a decided cell is never predicted again: its mode is final
            at = torch.where(predicted, new_cell, self.num_tokens).view(b, -1)
            mode = torch.where(predicted.view(b, -1), logits.argmax(dim=-1).view(b, -1), self.mode.gather(1, at))
            self.mode.scatter_(1, at, mode)
        cell = torch.where(carry, new_cell, self.num_tokens).view(b, -1)  # [B, R*t]
        old = self.canvas.gather(1, cell)
        if self.q is None:
            y = logits.argmax(dim=-1).view(b, -1)
        else:
            p = (probs if probs is not None else probs_from_logits(logits, self.sampling)).view(b, r * t, v)
            index = cell[:, :, None].expand(-1, -1, v)
            y = self._redraw(p, old, cell, index, gens)
            flat = carry.view(b, -1)
            self.q.scatter_(1, index, torch.where(flat[:, :, None], p.to(self.q.dtype), self.q.gather(1, index)))
        self.drawn.scatter_(1, cell, carry.view(b, -1) | self.drawn.gather(1, cell))  # greedy too: argmax draws
        self._mark_clean(block, a, cell, carry, y == old)
        self.canvas.scatter_(1, cell, torch.where(carry.view(b, -1), y, old))

    def _redraw(self, p: Tensor, old: Tensor, cell: Tensor, index: Tensor, gens: RowRandom) -> Tensor:
        """New guesses [B, M] drawn from p [B, M, V] at ``cell`` [B, M] (``index``: the cells as a
        gather index over V), replacing ``old`` [B, M] (-1: none yet). ``maximal``: SCD's coupling
        with the old guess and the law it was drawn from (``q``; a fill, drawn from no prediction,
        is coupled as a point mass: given the fill, the coupled draw is still distributed as p), so
        a guess changes only where p moved away from it. One uniform per redraw either way."""
        b, m, v = p.shape
        u = gens.uniform(m)
        if self.config.coupling == "independent":
            return sample_from_probs(p.reshape(-1, v), u.view(-1)).view(b, m)
        assert self.q is not None
        drawn = self.drawn.gather(1, cell)
        q_old = torch.where(drawn[:, :, None], self.q.gather(1, index).to(p.dtype),
                            one_hot(old.clamp(min=0), v).to(p.dtype) * (old >= 0)[:, :, None])  # no guess: q = 0
        return maximal_coupling(p.reshape(-1, v), q_old.reshape(-1, v), old.clamp(min=0).reshape(-1),
                                u.view(-1)).view(b, m)

    def _mark_clean(self, block: GridBlock, a: Tensor, cell: Tensor, carry: Tensor, same: Tensor) -> None:
        """``clean_root`` of the redrawn cells ``cell`` [B, R * t] (carried: ``carry`` [B, R, t]; the redraw
        equals the old guess: ``same`` [B, R * t]): node j's context was the chain's guesses before
        it, so it is :func:`clean_context`'s, with the rejected guess at node a + 1, cell first + a."""
        b, r, t = carry.shape
        rejected = torch.where(block.decodes & (a < block.max_depth), a + 1, 0).clamp(max=t - 1)  # node, 0: none
        rejected_drawn = block.relaxable.view(b, r, t).gather(2, rejected[:, :, None])[:, :, 0] & (rejected > 0)
        clean = clean_context(same.view(b * r, t), (a + 1).view(-1), rejected_drawn.view(-1)).view(b, r, t)
        origin = torch.where(clean & carry, (block.first_cell + a)[:, :, None], -1).view(b, -1)
        self.clean_root.scatter_(1, cell, torch.where(carry.view(b, -1), origin, self.clean_root.gather(1, cell)))


def kept_offsets(kept: Tensor) -> tuple[Tensor, Tensor]:
    """kept [B, T] bool -> (ascending kept offsets [B, T], -1 padded; their count [B])."""
    t = kept.shape[1]
    offsets = torch.arange(t, device=kept.device)[None, :].expand_as(kept)
    keep = torch.where(kept, offsets, t).sort(dim=1).values
    return torch.where(keep < t, keep, -1), kept.sum(1)
