"""Batch-invariant linear layers: every matmul call computes the same number of rows.

Why: a BLAS picks its kernel, its blocking and its thread split from the matrix shape. On x86
MKL's AVX2 sgemm (what MKL runs on AMD EPYC, and on Intel with ``MKL_ENABLE_INSTRUCTIONS=AVX2``)
a row's result depends on how many rows the call has and where the row sits (rows in a tile's
edge take another micro-kernel), so the same image row gets other logits in a batch of 4 than
alone, and a draw that lands near a CDF boundary flips (measured: 1 image in 48-96 on ``digits``).
cuBLAS chooses kernels by shape too. vLLM's batch-invariant mode and SGLang's deterministic
inference fix the tile of every kernel; the portable version of that is to call the BLAS only
with one fixed shape: the rows of ``x`` are cut into chunks of ``rows`` (the last one padded with
zeros) and each chunk is one ``F.linear`` call, so the kernel, blocking and reduction order never
change with the batch.

What that leaves is a row's position inside a chunk. A GEMM's code path does not branch on the
values, only on the shape and the position, so :func:`invariant_rows` checks each chunk size on
this device once per weight shape (every position against position 0, random data, two trials)
and takes the first candidate at which a row's result is the same at every position; one row
per call always qualifies. Measured: MKL AVX-512 passes every size up to 64, MKL AVX2 forced on
an Intel Xeon fails at 8 (rows 6 and 7 sit in an edge tile) and passes at 16; on an AMD EPYC
(Zen 3, AVX2 only) 8 passes at every shape tried (16 to 4096 inputs) and 6 fails at a 16-in,
32-out layer, so the answer is the probe's, never a table's.

Cost (2-core CPU, photos shapes): 1.5-2.5x per matmul at mid and large row counts, up to 7x at
2 rows, which is why this is a mode (``lantern.load(..., deterministic=True)``, the server's
default) and not always on: docs/DESIGN.md, "Batch invariance".
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# Chunk sizes tried, cheapest first at the row counts decoding sees (2 .. a few hundred rows).
CANDIDATE_ROWS = (8, 16, 12, 6, 4, 2, 1)
# On a GPU a small-row matmul costs its launch and one read of the weights whatever its rows, so
# 64-row chunks cost what 8-row ones do while 8-row chunks multiply the launches: a LANTERN++
# round at batch 8 verifies a few hundred rows, 40+ calls per layer at 8 rows (measured on an
# H200: the server, deterministic by default, made 5 images/s where batch-8 decoding made 81).
CUDA_CANDIDATE_ROWS = (64, 32, 16, 8, 4, 2, 1)


def candidate_rows(device: torch.device) -> tuple[int, ...]:
    """The chunk sizes :func:`invariant_rows` tries on ``device``, cheapest first."""
    return CUDA_CANDIDATE_ROWS if device.type == "cuda" else CANDIDATE_ROWS
_PROBE_TRIALS = 2

# (in, out, bias, dtype, device) -> rows: a property of the kernels, found once per process
_probed: dict[tuple[Any, ...], int] = {}


def chunked_linear(x: Tensor, weight: Tensor, bias: Tensor | None, rows: int) -> Tensor:
    """``F.linear(x, weight, bias)`` computed ``rows`` rows per call (zero-padded last chunk)."""
    k = x.shape[-1]
    flat = x.reshape(-1, k)
    m = flat.shape[0]
    pad = -m % rows
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad, k)])
    out = torch.cat([F.linear(chunk, weight, bias) for chunk in flat.split(rows)])
    return out[:m].reshape(*x.shape[:-1], weight.shape[0])


def _same_at_every_position(weight: Tensor, bias: Tensor | None, rows: int, gen: torch.Generator) -> bool:
    """Whether a row's output is bit-identical wherever it sits in a ``rows``-row call."""
    k = weight.shape[1]

    def randn(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=gen).to(weight.device, weight.dtype)

    probe = randn(1, k)
    first = randn(rows, k)
    first[0] = probe[0]
    reference = F.linear(first, weight, bias)[0]
    for _ in range(_PROBE_TRIALS):
        for position in range(1, rows):
            chunk = randn(rows, k)
            chunk[position] = probe[0]
            if not torch.equal(F.linear(chunk, weight, bias)[position], reference):
                return False
    return True


def _probe_threads() -> list[int]:
    """The intra-op thread counts a chunk size must pass at: one, the current count and the
    machine's default. A server loads on a one-thread side thread and decodes on a full one, so
    the chunk size it picks must be the one ``pipe(...)`` picks in a full-thread main thread."""
    return sorted({1, torch.get_num_threads(), max(1, min(os.cpu_count() or 1, 64))})


def _passes(w: Tensor, b: Tensor | None, rows: int, gen: torch.Generator) -> bool:
    before = torch.get_num_threads()
    try:
        for threads in _probe_threads():
            torch.set_num_threads(threads)
            if not _same_at_every_position(w, b, rows, gen):
                return False
        return True
    finally:
        torch.set_num_threads(before)


@torch.no_grad()
def invariant_rows(weight: Tensor, bias: Tensor | None = None) -> int:
    """The first candidate chunk size at which this device's matmul gives a row the same result
    at every position, at every thread count of :func:`_probe_threads` (checked on ``weight``'s
    shape, dtype and device; cached per process)."""
    key = (weight.shape[1], weight.shape[0], bias is not None, weight.dtype, weight.device)
    if key not in _probed:
        gen = torch.Generator().manual_seed(0)
        w = torch.randn(weight.shape, generator=gen).to(weight.device, weight.dtype)
        b = None if bias is None else torch.randn(bias.shape, generator=gen).to(bias.device, bias.dtype)
        _probed[key] = next(r for r in candidate_rows(weight.device) if r == 1 or _passes(w, b, r, gen))
    return _probed[key]


class RowChunkedLinear(nn.Linear):
    """An ``nn.Linear`` whose forward is :func:`chunked_linear`; same parameters and state dict.

    Modules become one by :func:`make_batch_invariant` (a class swap, so transformers' layers and
    lantern's own convert alike, and the checkpoint keys do not change)."""

    invariant_rows: int

    def forward(self, x: Tensor) -> Tensor:
        return chunked_linear(x, self.weight, self.bias, self.invariant_rows)


def make_batch_invariant(module: nn.Module, enabled: bool = True) -> nn.Module:
    """Turn every ``nn.Linear`` inside ``module`` into a :class:`RowChunkedLinear` (or back, with
    ``enabled=False``). In place; returns ``module``."""
    for sub in module.modules():
        if enabled and type(sub) is nn.Linear:
            sub.invariant_rows = invariant_rows(sub.weight, sub.bias)
            sub.__class__ = RowChunkedLinear
        elif not enabled and type(sub) is RowChunkedLinear:
            sub.__class__ = nn.Linear
    return module


def is_batch_invariant(module: nn.Module) -> bool:
    """Whether ``module`` (or any module inside it) computes its matmuls in fixed-size chunks."""
    return any(type(sub) is RowChunkedLinear for sub in module.modules())


def follow_batch_invariance(module: nn.Module, target: nn.Module) -> None:
    """Give ``module`` the mode of ``target`` (a network or a layer of it): whatever feeds a
    target's tokens (a drafter, which reads the target's lm_head; the T5 encoder of its captions)
    must be batch-invariant when the target is."""
    if is_batch_invariant(target):
        make_batch_invariant(module)
