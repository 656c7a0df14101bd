"""Batch-invariant linear layers: every matmul call runs at a row count known to give a row the same bits.

Why: a BLAS picks its kernel, its blocking and its thread split from the matrix shape. On x86
MKL's AVX2 sgemm (what MKL runs on AMD EPYC, and on Intel with ``MKL_ENABLE_INSTRUCTIONS=AVX2``)
a row's result depends on how many rows the call has and where the row sits (rows in a tile's
edge take another micro-kernel), so the same image row gets other logits in a batch of 4 than
alone, and a draw that lands near a CDF boundary flips (measured: 1 image in 48-96 on ``digits``).
cuBLAS chooses kernels by shape too. vLLM's batch-invariant mode and SGLang's deterministic
inference fix the tile of every kernel; the portable version of that is to call the BLAS only
at row counts known to give a row the same bits: the rows of ``x`` are padded with zeros and cut
into calls of those sizes, so the kernel, blocking and reduction order a row meets never change
with the batch.

What that leaves is a row's position inside a call, and which sizes agree. A GEMM's code path
does not branch on the values, only on the shape and the position, so :func:`invariant_chunks`
checks this device once per weight shape: the smallest call is the first candidate at which a
row's result is the same at every position (every position against position 0, random data, two
trials; one row per call always qualifies), and larger calls (and on a CPU every size up to 8x
the smallest, for calls that fit in one) are kept where a row's result at every position equals
its result in the smallest. Measured: MKL AVX-512 passes every size up to 64, MKL AVX2 forced on
an Intel Xeon fails at 8 (rows 6 and 7 sit in an edge tile) and passes at 16; on an AMD EPYC
(Zen 3, AVX2 only) 8 passes at every shape tried (16 to 4096 inputs), 6 fails at a 16-in, 32-out
layer, and every multiple of 8 up to 256 rows gives the 8-row bits; on a Zen 5 EPYC float32 keeps
4 and 12 to 64 rows and bf16 every size, so the answer is the probe's, never a table's.

Cost: one to three calls per layer where the native kernel makes one, plus the padding (a batch-1
AR step's 2 rows take an 8-row call where no smaller size gives them its bits), which is why this
is a mode (``lantern.load(..., deterministic=True)``, the server's default) and not always on:
docs/DESIGN.md, "Batch invariance".
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator
from typing import Any, Protocol, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lantern.machine import in_a_thread_that_ends

# Chunk sizes tried for a layer's smallest call, cheapest first at the row counts decoding sees
# (2 .. a few hundred rows).
CANDIDATE_ROWS = (8, 16, 12, 6, 4, 2, 1)
# On a GPU a small-row matmul costs its launch and one read of the weights whatever its rows, so
# 64-row chunks cost what 8-row ones do while 8-row chunks multiply the launches: a LANTERN++
# round at batch 8 verifies a few hundred rows, 40+ calls per layer at 8 rows (measured on an
# H200: the server, deterministic by default, made 5 images/s where batch-8 decoding made 81).
CUDA_CANDIDATE_ROWS = (64, 32, 16, 8, 4, 2, 1)
# The largest call a layer may make. A layer's larger calls are its smallest chunk times 2 .. 8,
# then times 16, 32, ... up to this, each kept only where it gives a row the smallest chunk's bits
# at every position, so a round's rows take one to three calls, not dozens of weight reads: on the
# AMD EPYC an 8-row call costs 2.5-4x per row what a 256-row one does, and MKL's AVX2 sgemm gives
# a row the same bits in every call whose rows are a multiple of 4 there (its edge kernel takes
# the rest).
LARGEST_CALL_ROWS = 256
CUDA_LARGEST_CALL_ROWS = 512
# On a CPU a padded row costs its arithmetic, so every size up to this many times the smallest call
# is tried as well (a batch-1 AR step's 2 rows, with guidance, took an 8-row call at every layer; a
# Jacobi round's 34 a 40-row one): kept where it gives a row the smallest call's bits at every
# position, and taken by a call whose rows fit in it. Rows are never split to save padding: 32 + 2
# rows cost more than one 40-row call (a second call's fixed cost is more than 6 rows' arithmetic).
# Not on a GPU, where padding is free and calls are not.
CPU_SINGLE_CALLS_UP_TO = 8


def candidate_rows(device: torch.device) -> tuple[int, ...]:
    """The chunk sizes :func:`invariant_chunks` tries for the smallest call on ``device``,
    cheapest first."""
    return CUDA_CANDIDATE_ROWS if device.type == "cuda" else CANDIDATE_ROWS


def largest_call_rows(device: torch.device) -> int:
    return CUDA_LARGEST_CALL_ROWS if device.type == "cuda" else LARGEST_CALL_ROWS


_PROBE_TRIALS = 2

# (in, out, bias, dtype, device) -> (chunk sizes, single-call sizes): a property of the kernels,
# found once per process
_probed: dict[tuple[Any, ...], tuple[tuple[int, ...], tuple[int, ...]]] = {}


def larger_calls(smallest: int, largest: int) -> list[int]:
    """The call sizes tried above ``smallest``: every multiple up to 8x (so that a round's row count
    pads to the next multiple of ``smallest``, in one call), then doublings up to ``largest``."""
    sizes = [smallest * j for j in range(2, 9)] + [smallest << j for j in range(4, 32)]
    return [size for size in sizes if size <= largest]


def single_calls(smallest: int, device: torch.device) -> list[int]:
    """The call sizes tried for calls whose rows fit in one (besides ``smallest`` itself): on a CPU
    every size up to ``CPU_SINGLE_CALLS_UP_TO`` times it, on CUDA none."""
    if device.type == "cuda":
        return []
    return [r for r in range(1, CPU_SINGLE_CALLS_UP_TO * smallest + 1) if r != smallest]


def call_sizes(m: int, chunks: tuple[int, ...], single: tuple[int, ...] = ()) -> tuple[int, ...]:
    """The row counts of the calls that cover ``m`` rows: ``m`` padded up to a multiple of the
    smallest chunk, then the largest chunks first (``chunks`` ascending, each a multiple of the
    first); up to the largest of ``single`` (ascending), one call of the smallest of them that holds
    the rows. Plain Python, not cached: a compiled round traces it (dynamo warns on a cache)."""
    if single and m <= single[-1]:
        for size in single:
            if size >= m:
                return (size,)
    left = -(-m // chunks[0]) * chunks[0]
    sizes: list[int] = []
    for size in reversed(chunks):
        count, left = divmod(left, size)
        sizes += [size] * count
    return tuple(sizes)


def chunked_linear(x: Tensor, weight: Tensor, bias: Tensor | None, chunks: tuple[int, ...],
                   single: tuple[int, ...] = ()) -> Tensor:
    """``F.linear(x, weight, bias)`` computed in calls of the sizes in ``chunks`` and ``single``
    (which give a row the same bits; the last rows zero-padded, see :func:`call_sizes`)."""
    k = x.shape[-1]
    flat = x.reshape(-1, k)
    m = flat.shape[0]
    sizes = call_sizes(m, chunks, single)
    if sum(sizes) > m:
        flat = F.pad(flat, (0, 0, 0, sum(sizes) - m))  # zeros: any rows would do (rows are independent)
    if len(sizes) == 1:
        out = F.linear(flat, weight, bias)
    else:
        out = torch.cat([F.linear(chunk, weight, bias) for chunk in flat.split(sizes)])
    return out[:m].reshape(*x.shape[:-1], weight.shape[0])


def _randn(gen: torch.Generator, like: Tensor, *shape: int) -> Tensor:
    return torch.randn(*shape, generator=gen).to(like.device, like.dtype)


def _row_in_a_call(weight: Tensor, bias: Tensor | None, rows: int, gen: torch.Generator) -> tuple[Tensor, Tensor]:
    """A random row and its output at position 0 of a ``rows``-row call among random rows."""
    k = weight.shape[1]
    probe = _randn(gen, weight, 1, k)[0]
    first = _randn(gen, weight, rows, k)
    first[0] = probe
    return probe, F.linear(first, weight, bias)[0]


def _same_at_every_position(weight: Tensor, bias: Tensor | None, rows: int, gen: torch.Generator) -> bool:
    """Whether a row's output is bit-identical wherever it sits in a ``rows``-row call."""
    probe, reference = _row_in_a_call(weight, bias, rows, gen)
    for _ in range(_PROBE_TRIALS):
        for position in range(1, rows):
            chunk = _randn(gen, weight, rows, weight.shape[1])
            chunk[position] = probe
            if not torch.equal(F.linear(chunk, weight, bias)[position], reference):
                return False
    return True


def _same_as_in_the_smallest_chunk(weight: Tensor, bias: Tensor | None, smallest: int, rows: int,
                                   gen: torch.Generator) -> bool:
    """Whether a row's output at every position of a ``rows``-row call is its output in a
    ``smallest``-row call, bit for bit. Each trial puts the row at every other position, among
    random rows, so the trials cover every position in one call each (a GEMM's code path depends
    on the shape and the position, never on the values)."""
    probe, reference = _row_in_a_call(weight, bias, smallest, gen)
    for trial in range(_PROBE_TRIALS):
        chunk = _randn(gen, weight, rows, weight.shape[1])
        chunk[trial::_PROBE_TRIALS] = probe
        out = F.linear(chunk, weight, bias)[trial::_PROBE_TRIALS]
        if not torch.equal(out, reference.expand_as(out)):
            return False
    return True


def _probe_threads() -> list[int]:
    """The intra-op thread counts a chunk size must pass at: one, the current count and the
    machine's default. A server loads on a one-thread side thread and decodes on a full one, so
    the chunk size it picks must be the one ``pipe(...)`` picks in a full-thread main thread."""
    return sorted({1, torch.get_num_threads(), max(1, min(os.cpu_count() or 1, 64))})


def _at_every_thread_count(check: Callable[[], bool]) -> bool:
    before = torch.get_num_threads()
    try:
        for threads in _probe_threads():
            torch.set_num_threads(threads)
            if not check():
                return False
        return True
    finally:
        torch.set_num_threads(before)


def _probe(weight: Tensor, bias: Tensor | None) -> tuple[tuple[int, ...], tuple[int, ...]]:
    gen = torch.Generator().manual_seed(0)
    w = _randn(gen, weight, *weight.shape)
    b = None if bias is None else _randn(gen, bias, *bias.shape)
    smallest = next(r for r in candidate_rows(weight.device)
                    if r == 1 or _at_every_thread_count(functools.partial(_same_at_every_position, w, b, r, gen)))

    def same(r: int) -> bool:
        return _at_every_thread_count(functools.partial(_same_as_in_the_smallest_chunk, w, b, smallest, r, gen))

    larger = [r for r in larger_calls(smallest, largest_call_rows(weight.device)) if same(r)]
    single = [r for r in single_calls(smallest, weight.device) if r in larger or same(r)]
    return (smallest, *larger), tuple(sorted([smallest, *single])) if single else ()


def invariant_chunks(weight: Tensor, bias: Tensor | None = None) -> tuple[int, ...]:
    """The call sizes at which this device's matmul gives a row one result wherever it sits,
    smallest first, at every thread count of :func:`_probe_threads` (checked on ``weight``'s
    shape, dtype and device; cached per process). The smallest is the first candidate at which
    a row's result is the same at every position of the call; the others are the
    :func:`larger_calls` at which a row's result at every position equals its result in the
    smallest call. On a CPU the probe runs in a thread of its own (``machine.in_a_thread_that_ends``:
    it opens a team at every probed thread count, which must not stay with the caller's thread)."""
    return _probed_sizes(weight, bias)[0]


def invariant_single_calls(weight: Tensor, bias: Tensor | None = None) -> tuple[int, ...]:
    """On a CPU, the call sizes up to ``CPU_SINGLE_CALLS_UP_TO`` times the smallest of
    :func:`invariant_chunks` at which a row's result at every position equals its result in the
    smallest call, ascending (the smallest included; empty on CUDA): a call of at most the largest
    of them takes one call of the smallest that holds its rows (:func:`call_sizes`)."""
    return _probed_sizes(weight, bias)[1]


@torch.no_grad()
def _probed_sizes(weight: Tensor, bias: Tensor | None) -> tuple[tuple[int, ...], tuple[int, ...]]:
    key = (weight.shape[1], weight.shape[0], bias is not None, weight.dtype, weight.device)
    if key not in _probed:
        probe = functools.partial(_probe, weight, bias)
        _probed[key] = in_a_thread_that_ends(probe) if weight.device.type == "cpu" else probe()
    return _probed[key]


class RowChunkedLinear(nn.Linear):
    """An ``nn.Linear`` whose forward is :func:`chunked_linear`; same parameters and state dict.

    Modules become one by :func:`make_batch_invariant` (a class swap, so transformers' layers and
    lantern's own convert alike, and the checkpoint keys do not change)."""

    invariant_chunks: tuple[int, ...]
    invariant_single: tuple[int, ...] = ()

    def forward(self, x: Tensor) -> Tensor:
        return chunked_linear(x, self.weight, self.bias, self.invariant_chunks, self.invariant_single)


def make_batch_invariant(module: nn.Module, enabled: bool = True) -> nn.Module:
    """Turn every ``nn.Linear`` inside ``module`` into a :class:`RowChunkedLinear` (or back, with
    ``enabled=False``). In place; returns ``module``."""
    for sub in module.modules():
        if enabled and type(sub) is nn.Linear:
            layer = cast(RowChunkedLinear, sub)  # (one, swapped next)
            layer.invariant_chunks = invariant_chunks(sub.weight, sub.bias)
            layer.invariant_single = invariant_single_calls(sub.weight, sub.bias)
            _swap_class(sub, RowChunkedLinear)
        elif not enabled and type(sub) is RowChunkedLinear:
            _swap_class(sub, nn.Linear)
    return module


def _swap_class(module: nn.Module, cls: type[nn.Module]) -> None:
    """Give ``module`` another class of the same parameters: another forward, the same object."""
    module.__class__ = cls


class Modular(Protocol):
    """An ``nn.Module``, or one typed by what is read of it (a target's ``lantern.decoding.loop.CodeHead``)."""

    def modules(self) -> Iterator[nn.Module]: ...


def is_batch_invariant(module: Modular) -> bool:
    """Whether ``module`` (or any module inside it) computes its matmuls in fixed-size chunks."""
    return any(type(sub) is RowChunkedLinear for sub in module.modules())


def follow_batch_invariance(module: nn.Module, target: Modular) -> None:
    """Give ``module`` the mode of ``target`` (a network or a layer of it): whatever feeds a
    target's tokens (a drafter, which reads the target's lm_head; the T5 encoder of its captions)
    must be batch-invariant when the target is."""
    if is_batch_invariant(target):
        make_batch_invariant(module)
