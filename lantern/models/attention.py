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
side, and a kernel that sums the keys in tiles (ATen's CPU kernel with AMX) adds them in other
groups. So, where ``calls.tail`` is set, a query's last ``tail`` attended keys (all of a node's
ancestors in any tree branching less deeply than that) leave its kernel call: the kernel attends
to the rest, which lie side by side from slot 0 in a tree as in an AR step, and returns their
log-sum-exp; the tail is gathered in sequence order and :func:`with_tail` attends to it with
elementwise float32 ops in one fixed order, joined to the kernel's part by one softmax. A query's
bits then depend on its keys and their order, not on their slots, and its tail costs no kernel call.
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
    head, index, valid, has_head = _split_once(mask, calls.tail)
    out, lse = _fixed_calls(q, k, v, head, scale, calls, with_lse=True)
    assert lse is not None
    n, h, t, d = q.shape
    tail_k, tail_v = (_gather_rows(x, index).view(n, t, h, -1, d) for x in (k, v))
    return with_tail(q, tail_k, tail_v, valid, out, lse, has_head, d**-0.5 if scale is None else scale)


# A forward hands every layer the same mask: eager, its split is made once and kept for a mask of
# the same contents (compared, not trusted by identity: a buffer reused in place is another mask).
_last_split: list[tuple[Tensor, int, tuple[Tensor, Tensor, Tensor, Tensor]]] = []


def _split_once(mask: Tensor, tail: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """:func:`split_tail` and whether each query has a head [N, T], once per mask in eager code."""
    if torch.compiler.is_compiling():
        head, index, valid = split_tail(mask, tail)
        return head, index, valid, head.any(-1)
    last = _last_split[0] if _last_split else None
    if (last is not None and last[1] == tail and last[0].shape == mask.shape and last[0].device == mask.device
            and torch.equal(last[0], mask)):
        return last[2]
    head, index, valid = split_tail(mask, tail)
    parts = (head, index, valid, head.any(-1))
    _last_split[:] = [(mask.clone(), tail, parts)]
    return parts


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


def side_by_side(head: Tensor) -> Tensor:
    """Whether each query's head [N, T, S] (:func:`split_tail`'s) is one run of keys side by side,
    no slot between its first and last left out, as every query's is in an AR step (a prompt's
    left padding only moves where the run starts) [N, T] (bool): then the kernel sums a tree node's
    head as it sums the AR step's, at the same slots. A node's keys lie side by side up to the
    first slot that holds another branch's node; the tail must take every key past that gap
    (``--tree`` ``[[1], [0], [0, 0], ...]``, a fork at the root and a chain below: a node ``d`` deep
    has ``d - 1`` such keys, so a tail of 16 covers it to ``d`` 17; a chain of any length has none).
    The tests hold every lossless method's forwards to it, so that greedy = AR rests on the layout
    on any CPU, not on a kernel that happens not to tile keys."""
    slots = torch.arange(head.shape[-1], device=head.device)
    first = torch.where(head, slots, head.shape[-1]).amin(-1)
    last = torch.where(head, slots, -1).amax(-1)
    count = head.sum(-1)
    return (count == 0) | (last - first + 1 == count)


def _gather_rows(x: Tensor, index: Tensor) -> Tensor:
    """x [N, H, S, Dh] at index [N, T, W] -> [N * T, H, W, Dh] (one row per query): whole Dh-rows
    picked out of x's storage by one ``index_select`` (a cache's keys are a slice of it; ``gather``
    with an index expanded over Dh took 15x as long)."""
    n, h, _, d = x.shape
    t, w = index.shape[1:]
    if x.stride(-1) != 1 or x.stride(-2) != d or x.stride(0) % d or x.stride(1) % d:
        x = x.contiguous()
    row, head = x.stride(0) // d, x.stride(1) // d  # in Dh-rows
    first = torch.arange(n, device=x.device)[:, None] * row + torch.arange(h, device=x.device)[None, :] * head
    rows = first[:, None, :, None] + index[:, :, None, :]  # [N, T, H, W]
    span = (n - 1) * row + (h - 1) * head + x.shape[2]
    return x.as_strided((span, d), (d, 1)).index_select(0, rows.reshape(-1)).view(n * t, h, w, d)


def _ordered_sum(x: Tensor, dim: int) -> Tensor:
    """``x`` summed over ``dim`` in place (``x`` is spent), in one fixed order: the first half of
    the slices gets the last half added (an odd middle slice carried), until one is left. Each step
    is one rounded add per element, so a sum's bits follow its own terms alone, not a reduction
    kernel's blocking, vector width or threads (nor the rows beside it)."""
    n = x.shape[dim]
    while n > 1:
        half = n // 2
        x.narrow(dim, 0, half).add_(x.narrow(dim, n - half, half))
        n -= half
    return x.select(dim, 0)


# The softmax over a query's head (its log-sum-exp) and its tail keys runs over rows 64 wide (then
# -inf): ATen computes a softmax row by row, never splitting one between threads, and a 64-wide
# float32 row is whole vectors on AVX2 and AVX-512, so a query's weights do not depend on the rows
# beside it (a vector exp and a scalar one may round apart). The rest is exactly rounded products
# and :func:`_ordered_sum`.
_MERGE_WIDTH = 64


def with_tail(q: Tensor, tail_k: Tensor, tail_v: Tensor, valid: Tensor, head_out: Tensor, head_lse: Tensor,
              has_head: Tensor, scale: float) -> Tensor:
    """Attention over each query's head and tail: the head as the kernel's output and log-sum-exp
    (head_out [N, H, T, Dh], head_lse [N, H, T]; only where ``has_head`` [N, T]), the tail as its
    keys and values in order (tail_k / tail_v [N, T, H, W, Dh], slots ``valid`` [N, T, W]), in
    float32 with no kernel: a query's tail costs a few elementwise ops, not a kernel call of its
    own. Compiled, an opaque op (:func:`_with_tail_op`) runs these very ops (inductor would fuse
    its own products, exps and sums); eager, they run without the op's dispatch."""
    if torch.compiler.is_compiling():
        return _with_tail_op(q, tail_k, tail_v, valid, head_out, head_lse, has_head, scale)
    return _with_tail(q, tail_k, tail_v, valid, head_out, head_lse, has_head, scale)


def _with_tail(q: Tensor, tail_k: Tensor, tail_v: Tensor, valid: Tensor, head_out: Tensor, head_lse: Tensor,
               has_head: Tensor, scale: float) -> Tensor:
    w = tail_k.shape[3]
    assert w < _MERGE_WIDTH, f"a tail of {w} keys does not fit a {_MERGE_WIDTH}-wide softmax row"
    no_head = ~has_head[..., None]  # [N, T, 1]
    products = q.transpose(1, 2)[:, :, :, None].float() * tail_k.float()  # [N, T, H, W, Dh]
    scores = (_ordered_sum(products, -1) * scale).masked_fill(~valid[:, :, None], float("-inf"))
    head_logit = head_lse.float().transpose(1, 2).masked_fill(no_head, float("-inf"))  # [N, T, H]
    logits = torch.cat([head_logit[..., None], scores], -1)
    weights = torch.softmax(F.pad(logits, (0, _MERGE_WIDTH - 1 - w), value=float("-inf")), -1)
    tail = _ordered_sum(weights[..., 1 : 1 + w, None] * tail_v.float(), -2)  # [N, T, H, Dh]
    head = head_out.float().transpose(1, 2).masked_fill(no_head[..., None], 0.0)  # a keyless query's may be NaN
    out = weights[..., :1] * head + tail
    return out.transpose(1, 2).to(q.dtype).contiguous()


_with_tail_op = torch.library.custom_op("lantern::with_tail", _with_tail, mutates_args=())


@_with_tail_op.register_fake
def _(q: Tensor, tail_k: Tensor, tail_v: Tensor, valid: Tensor, head_out: Tensor, head_lse: Tensor,
      has_head: Tensor, scale: float) -> Tensor:
    return torch.empty_like(q, memory_format=torch.contiguous_format)
