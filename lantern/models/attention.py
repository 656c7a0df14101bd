"""Attention over lantern's cache: PyTorch's fused kernel, called at fixed shapes in batch-invariant mode.

``attend`` is the one attention of every target and drafter layer. In the default mode it is one
``F.scaled_dot_product_attention`` call. In batch-invariant mode (``lantern.models.invariant``)
a kernel that blocks its query axis by the query count would round a query of a verified tree
(many queries) apart from the same query in an AR step (one), so the queries are zero-padded to a
multiple of the probed smallest call and cut into calls of the probed sizes, and, where the
device's kernel changes a row's bits with the batch, each row takes calls of its own. The key
axis is the cache's, whose length is a multiple of the probed granule (the targets round it up).

What the probe cannot fix is where a query's keys sit: a tree writes a node's ancestors after the
committed prefix with its siblings between them, where an AR step finds the same keys side by
side, and a kernel that sums the keys in tiles (ATen's CPU kernel with AMX: tiles of 32) adds them
in other groups. So, where ``calls.tail`` is set, a query's last ``tail`` attended keys (all of a
node's ancestors in any tree branching less deeply than that) are taken out of the kernel call:
the kernel attends to the rest, which lie side by side from slot 0 in a tree as in an AR step,
and returns its log-sum-exp; the tail is gathered into ``tail`` slots in sequence order and
merged with it by :func:`attend_tail`, an opaque op of float32 arithmetic in a fixed order, so a
query's bits depend on its keys and their order, not on their slots.
"""

from __future__ import annotations

from typing import Any

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
    if not calls.tail or dropout_p:
        return _fixed_calls(q, k, v, mask, scale, calls, dropout_p)[0]
    head, index, valid = split_tail(mask, calls.tail)
    out, lse = _fixed_calls(q, k, v, head, scale, calls, with_lse=True)
    assert lse is not None
    kt, vt = (_gather_keys(x, index) for x in (k, v))
    return attend_tail(q, kt, vt, valid, out, lse, head.any(-1), q.shape[-1] ** -0.5 if scale is None else scale)


# ATen's CPU flash kernel, what ``F.scaled_dot_product_attention`` runs on a CPU, called directly for
# its log-sum-exp (a name here, so that a test can plant a kernel of its own).
_flash_with_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def _fixed_calls(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float | None, calls: AttentionCalls,
                 dropout_p: float = 0.0, with_lse: bool = False) -> tuple[Tensor, Tensor | None]:
    """The kernel at the probed shapes: queries zero-padded and cut by :func:`call_sizes`, each row
    alone where the kernel is not ``rows_free``. Returns the output and, ``with_lse``, each query's
    log-sum-exp [N, H, T] (float32; 0 for a query with every key masked)."""
    t = q.shape[2]
    sizes = call_sizes(t, calls.queries)
    pad = sum(sizes) - t
    if pad:  # padding queries copy the last mask (a query with every key masked would give NaN); dropped below
        q = F.pad(q, (0, 0, 0, pad))
        mask = torch.cat([mask, mask[:, -1:].expand(-1, pad, -1)], 1)
    bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf")) if with_lse \
        else mask

    def call(qc: Tensor, kr: Tensor, vr: Tensor, mc: Tensor) -> tuple[Tensor, Tensor | None]:
        if with_lse:
            out, lse = _flash_with_lse(qc.contiguous(), kr, vr, attn_mask=mc[:, None], scale=scale)
            return out, lse
        return F.scaled_dot_product_attention(qc.contiguous(), kr, vr, attn_mask=mc[:, None], scale=scale,
                                              dropout_p=dropout_p), None

    rows = [slice(None)] if calls.rows_free else [slice(i, i + 1) for i in range(q.shape[0])]
    pairs = [call(qc, k[r], v[r], mc) for r in rows
             for qc, mc in zip(q[r].split(sizes, 2), bias[r].split(sizes, 1), strict=True)]
    return _join(rows, sizes, [p[0] for p in pairs], t), _join(rows, sizes, [p[1] for p in pairs], t)


def _join(rows: list[slice], sizes: tuple[int, ...], parts: list[Any], t: int) -> Any:
    """The calls' outputs [rows, H, queries, ...] put back together, padding queries dropped."""
    if parts[0] is None:
        return None
    if len(parts) == 1:  # one call: no copy
        return parts[0][:, :, :t]
    by_row = [torch.cat(parts[i : i + len(sizes)], 2) for i in range(0, len(parts), len(sizes))]
    return torch.cat(by_row)[:, :, :t]


def split_tail(mask: Tensor, tail: int) -> tuple[Tensor, Tensor, Tensor]:
    """A query's attended keys [N, T, S] parted into its head (all but the last ``tail``, as a mask)
    and its tail: the key indices [N, T, tail] of its last ``tail`` attended keys in order (the last
    in slot ``tail - 1``) and which slots hold one (a query with fewer keys fills the last ones).
    Integer arithmetic only: the same in eager and compiled code."""
    before = mask.long().cumsum(-1)  # attended keys at or before each key (ascending)
    count = before[..., -1:]  # [N, T, 1]
    head = mask & (before <= count - tail)
    number = count - tail + 1 + torch.arange(tail, device=mask.device)  # [N, T, tail]: 1-based key numbers
    valid = number >= 1
    index = torch.searchsorted(before, number.clamp(min=1))  # the first key whose count reaches the number
    return head, index.clamp(max=mask.shape[-1] - 1), valid


def _gather_keys(x: Tensor, index: Tensor) -> Tensor:
    """x [N, H, S, Dh] at index [N, T, W] -> [N, H, T, W, Dh]."""
    n, h, _, d = x.shape
    t, w = index.shape[1:]
    flat = index.reshape(n, 1, t * w, 1).expand(n, h, t * w, d)
    return x.gather(2, flat).view(n, h, t, w, d)


# The tail's arithmetic is the same float ops for a query whatever the rows beside it, their count
# and the thread count: products and sums are exactly rounded IEEE ops, the same in a vector lane
# or a scalar loop, and every sum adds halves elementwise in one fixed order (a reduction kernel
# would choose its order by shape); the one transcendental op, softmax's exp, runs row by row in
# ATen (a row never split between threads) over rows 64 wide, whole vectors on AVX2 and AVX-512.
# Row blocks bound the float32 products held at once.
_TAIL_BLOCK_ELEMENTS = 1 << 22
_SOFTMAX_WIDTH = 64


def _halving_sum(x: Tensor) -> Tensor:
    """``x`` summed over its last dim in one fixed order: the dim zero-padded to a power of two,
    then halves added elementwise (each add exactly rounded, wherever the element sits)."""
    n = x.shape[-1]
    width = 1 << max(n - 1, 0).bit_length()
    if width != n:
        x = F.pad(x, (0, width - n))
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x[..., 0]


def _attend_tail_rows(q: Tensor, kt: Tensor, vt: Tensor, valid: Tensor, head_out: Tensor,
                      head_lse: Tensor, scale: float) -> Tensor:
    """Rows [R] of float32: q [R, D], kt / vt [R, W, D], valid [R, W], head_out [R, D], head_lse [R]
    (-inf: no head) -> [R, D]."""
    r, w = valid.shape
    scores = _halving_sum(q[:, None, :] * kt) * scale  # [R, W]
    logits = torch.full((r, _SOFTMAX_WIDTH), float("-inf"), dtype=torch.float32, device=q.device)
    logits[:, :w] = scores.masked_fill(~valid, float("-inf"))
    logits[:, w] = head_lse
    p = torch.softmax(logits, -1)
    tail = _halving_sum((p[:, :w, None] * vt).transpose(1, 2))  # [R, D]
    return tail + p[:, w, None] * head_out


@torch.library.custom_op("lantern::attend_tail", mutates_args=())
def attend_tail(q: Tensor, kt: Tensor, vt: Tensor, valid: Tensor, head_out: Tensor, head_lse: Tensor,
                has_head: Tensor, scale: float) -> Tensor:
    """Attention of queries q [N, H, T, D] over their head (the kernel's output and log-sum-exp
    [N, H, T], used where ``has_head`` [N, T]) and their tail keys kt / vt [N, H, T, W, D] (slots
    where ``valid`` [N, T, W]): softmax over the tail's scores and the head's log-sum-exp, in
    float32. An opaque op, so that a compiled round runs these very ops (inductor would fuse them
    in an order of its own)."""
    n, h, t, d = q.shape
    w = kt.shape[3]
    if w + 1 > _SOFTMAX_WIDTH:
        raise ValueError(f"attend_tail takes at most {_SOFTMAX_WIDTH - 1} tail keys, got {w}")
    lse = head_lse.float().masked_fill(~has_head[:, None], float("-inf"))
    head_out = head_out.float().masked_fill(~has_head[:, None, :, None], 0.0)  # a keyless query's may be NaN
    qf, kf, vf = q.float().reshape(-1, d), kt.float().reshape(-1, w, d), vt.float().reshape(-1, w, d)
    validf = valid[:, None].expand(n, h, t, w).reshape(-1, w)
    outf, lsef = head_out.reshape(-1, d), lse.reshape(-1)
    block = max(1, _TAIL_BLOCK_ELEMENTS // (w * d))
    out = torch.cat([_attend_tail_rows(qf[i : i + block], kf[i : i + block], vf[i : i + block], validf[i : i + block],
                                       outf[i : i + block], lsef[i : i + block], scale)
                     for i in range(0, n * h * t, block)])
    return out.view(n, h, t, d).to(q.dtype)


@attend_tail.register_fake
def _(q: Tensor, kt: Tensor, vt: Tensor, valid: Tensor, head_out: Tensor, head_lse: Tensor,
      has_head: Tensor, scale: float) -> Tensor:
    return torch.empty_like(q)
