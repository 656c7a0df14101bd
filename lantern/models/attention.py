"""Attention over lantern's cache: PyTorch's fused kernel, called at fixed shapes in batch-invariant mode.

``attend`` is the one attention of every target and drafter layer. In the default mode it is one
``F.scaled_dot_product_attention`` call. In batch-invariant mode (``lantern.models.invariant``)
a kernel that blocks its query axis by the query count would round a query of a verified tree
(many queries) apart from the same query in an AR step (one), so the queries are zero-padded to a
multiple of the probed smallest call and cut into calls of the probed sizes, and, where the
device's kernel changes a row's bits with the batch, each row takes calls of its own. The key
axis is the cache's, whose length is a multiple of the probed granule (the targets round it up).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from lantern.models.invariant import AttentionCalls, call_sizes


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, *, scale: float | None = None,
           calls: AttentionCalls | None = None, dropout_p: float = 0.0) -> Tensor:
    """softmax(q kᵀ · scale, masked) v: q [N, H, T, Dh], k / v [N, H, S, Dh] (grouped heads already
    repeated), mask [N, T, S] bool (True = attend) -> [N, H, T, Dh]. ``calls``: the batch-invariant
    mode's call shapes (None: one fused call)."""
    if calls is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], scale=scale, dropout_p=dropout_p)
    t = q.shape[2]
    sizes = call_sizes(t, calls.queries)
    pad = sum(sizes) - t
    if pad:  # padding queries copy the last mask (a query with every key masked would give NaN); dropped below
        q = F.pad(q, (0, 0, 0, pad))
        mask = torch.cat([mask, mask[:, -1:].expand(-1, pad, -1)], 1)
    rows = [slice(None)] if calls.rows_free else [slice(i, i + 1) for i in range(q.shape[0])]
    outs = [F.scaled_dot_product_attention(qc.contiguous(), k[r], v[r], attn_mask=mc[:, None], scale=scale,
                                           dropout_p=dropout_p)
            for r in rows for qc, mc in zip(q[r].split(sizes, 2), mask[r].split(sizes, 1), strict=True)]
    if len(outs) == 1:  # one call: no copy
        return outs[0][:, :, :t]
    by_row = [torch.cat(outs[i : i + len(sizes)], 2) for i in range(0, len(outs), len(sizes))]
    return torch.cat(by_row)[:, :, :t]
