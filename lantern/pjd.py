"""Parallel Jacobi decoding (PJD, arXiv 2606.05703): the grid pieces, not yet a method of the loop.

PJD lays Jacobi drafts out in 2-D: row r + 1 of the image becomes active once row r has
``context`` committed tokens (ZipAR's activation rule, arXiv 2412.04062), every active row drafts
a short window after its committed prefix, and one target forward verifies the windows of all
active rows. That needs what the raster-order loop never does: commits out of raster order (a
row's tokens enter the cache while an earlier row still has holes). This module holds the parts
that make such a forward exact, tested against an explicit recomputation (tests/test_pjd.py):

* cache slots are decoupled from image cells: ``KVCache.commit`` keeps any chosen subset of a
  verify block (in slot order, which is commit order), and ``slot_cell`` [N, S] records the image
  cell (raster index) each slot holds, -1 for the condition prefix;
* positions come from the image grid (:func:`grid_positions`), never from slot order;
* visibility is an explicit mask (:func:`grid_verify_mask`): a block token sees the condition,
  every committed token *earlier in raster order*, and the earlier tokens of its own row's window
  (row-causal: windows of different rows never see each other).

The remaining work (the drafter, the per-row acceptance and its residual, the loop's
commit of several rows per round) is described in docs/DESIGN.md ("PJD: what is left").
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor

from lantern.errors import check

DEFAULT_PJD_WINDOW = 4
DEFAULT_PJD_CONTEXT = 8


@dataclass(frozen=True)
class PJDConfig:
    """``window``: drafts per active row and round; ``context``: committed tokens row r needs
    before row r + 1 opens (``context`` >= the row length: one row at a time, which is lossless)."""

    window: int = DEFAULT_PJD_WINDOW
    context: int = DEFAULT_PJD_CONTEXT

    def __post_init__(self) -> None:
        for flag, value in (("--pjd-window", self.window), ("--pjd-context", self.context)):
            check(isinstance(value, int) and not isinstance(value, bool) and value >= 1,
                  f"{flag} must be an integer >= 1, got {value!r}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def check_pjd_fits(config: PJDConfig, height: int, width: int) -> None:
    """A window or context longer than an image row can never be used as such."""
    check(config.window <= width, f"--pjd-window ({config.window}) must be at most the image row length ({width})")
    check(config.context <= width,
          f"--pjd-context ({config.context}) must be at most the image row length ({width}); "
          f"{width} already decodes one row at a time")
    check(height >= 1, f"the image needs at least one row, got {height}")


def active_rows(committed: Tensor, context: int, width: int) -> Tensor:
    """ZipAR's activation rule. committed [B, H]: committed tokens per image row (a prefix of the
    row). Row 0 is open from the start; row r > 0 opens once row r - 1 has ``context`` committed
    tokens; a full row is closed. Returns [B, H] bool."""
    done = torch.full_like(committed[:, :1], width)
    previous = torch.cat([done, committed[:, :-1]], dim=1)  # [B, H] committed tokens of the row above
    return (previous >= min(context, width)) & (committed < width)


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
