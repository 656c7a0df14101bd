"""Batch-invariant linear layers and attention: every matmul and attention call runs at a shape known
to give a row the same bits.

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

Attention is held the same way (:class:`AttentionCalls`, :func:`lantern.models.attention.attend`):
the kernel blocks its query and key axes by their lengths, so a query would round apart in a
verified tree and in an AR step; see "attention" below.

Cost: one to three calls per layer where the native kernel makes one, plus the padding (a batch-1
AR step's 2 rows take an 8-row call where no smaller size gives them its bits; its one query a
4-query attention call over a cache of whole 512-key blocks), which is why this
is a mode (``lantern.load(..., deterministic=True)``, the server's default) and not always on:
docs/DESIGN.md, "Batch invariance".
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
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


# A reduced-precision output hides the order of its sums: kernels that add a row's products in
# other orders give float32 sums a few float32 ulps apart, and rounding to bfloat16 (8 bits) hides
# that in all but about 1 output in 10^3 to 10^4, so random rows passed a call size that moved the
# bits of real rows (measured on a Xeon with AMX: a 704-in layer's 64-row call, where 1 greedy
# row in 8 on `digits` then left greedy AR). The probe's sums cancel instead: a quarter of the
# inputs are large and sit in pairs (+a, -a) over equal weight columns, so the exact sum is that
# of the small inputs while a float32 partial sum carries the large ones, whose rounding (which
# depends on the order) is then a large part of the result: measured there, 8 % of the outputs
# showed the 64-row call, random rows none.
_CANCELLING_SCALE = {torch.float16: 2.0**10}  # float16 tops out at 65504; bfloat16 and float32 take 2^16
_DEFAULT_CANCELLING_SCALE = 2.0**16


@dataclass(frozen=True)
class _CancellingSums:
    """A probe layer (``weight``, ``bias``) whose columns ``first`` and ``second`` are equal, and
    :meth:`rows` whose inputs there are large and opposite: every output is a sum of large
    cancelling products and small ones, so its bits show the order the kernel added them in."""

    weight: Tensor
    bias: Tensor | None
    first: Tensor  # [P] input indices
    second: Tensor  # [P]

    @classmethod
    def like(cls, weight: Tensor, bias: Tensor | None, gen: torch.Generator) -> _CancellingSums:
        k = weight.shape[1]
        order = torch.randperm(k, generator=gen)
        first, second = order[: k // 4], order[k // 4 : 2 * (k // 4)]
        w = torch.randn(*weight.shape, generator=gen)
        w[:, second] = w[:, first]
        b = None if bias is None else _randn(gen, bias, *bias.shape)
        return cls(w.to(weight.device, weight.dtype), b, first, second)

    def rows(self, gen: torch.Generator, n: int) -> Tensor:
        x = torch.randn(n, self.weight.shape[1], generator=gen)
        scale = _CANCELLING_SCALE.get(self.weight.dtype, _DEFAULT_CANCELLING_SCALE)
        x[:, self.first] = torch.randn(n, len(self.first), generator=gen) * scale
        x[:, self.second] = -x[:, self.first]
        return x.to(self.weight.device, self.weight.dtype)

    def __call__(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias)


def _row_in_a_call(layer: _CancellingSums, rows: int, gen: torch.Generator) -> tuple[Tensor, Tensor]:
    """A probe row and its output at position 0 of a ``rows``-row call among other probe rows."""
    probe = layer.rows(gen, 1)[0]
    first = layer.rows(gen, rows)
    first[0] = probe
    return probe, layer(first)[0]


def _same_at_every_position(layer: _CancellingSums, rows: int, gen: torch.Generator) -> bool:
    """Whether a row's output is bit-identical wherever it sits in a ``rows``-row call."""
    probe, reference = _row_in_a_call(layer, rows, gen)
    for _ in range(_PROBE_TRIALS):
        for position in range(1, rows):
            chunk = layer.rows(gen, rows)
            chunk[position] = probe
            if not torch.equal(layer(chunk)[position], reference):
                return False
    return True


def _same_as_in_the_smallest_chunk(layer: _CancellingSums, smallest: int, rows: int, gen: torch.Generator) -> bool:
    """Whether a row's output at every position of a ``rows``-row call is its output in a
    ``smallest``-row call, bit for bit. Each trial puts the row at every other position, among
    other probe rows, so the trials cover every position in one call each (a GEMM's code path
    depends on the shape and the position, never on the values)."""
    probe, reference = _row_in_a_call(layer, smallest, gen)
    for trial in range(_PROBE_TRIALS):
        chunk = layer.rows(gen, rows)
        chunk[trial::_PROBE_TRIALS] = probe
        out = layer(chunk)[trial::_PROBE_TRIALS]
        if not torch.equal(out, reference.expand_as(out)):
            return False
    return True


def _probe_threads() -> list[int]:
    """The intra-op thread counts a chunk size must pass at: one, the current count and the
    machine's default. A server loads on a one-thread side thread and decodes on a full one, so
    the chunk size it picks must be the one ``pipe(...)`` picks in a full-thread main thread."""
    return sorted({1, torch.get_num_threads(), max(1, min(os.cpu_count() or 1, 64))})


def at_every_thread_count(check: Callable[[], bool]) -> bool:
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
    layer = _CancellingSums.like(weight, bias, gen)
    smallest = next(r for r in candidate_rows(weight.device)
                    if r == 1 or at_every_thread_count(functools.partial(_same_at_every_position, layer, r, gen)))

    def same(r: int) -> bool:
        return at_every_thread_count(functools.partial(_same_as_in_the_smallest_chunk, layer, smallest, r, gen))

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


# ---- attention ----------------------------------------------------------------------------------
# A fused attention kernel blocks the query and key axes by their lengths: measured with ATen's
# CPU kernel, a query's output took other bits in a call of 4 queries than alone (about 1 head-row
# in 100 in bfloat16, every one in float32 at 1,100 keys), and in a call over 7 more keys, masked:
# a tree round (many queries, a cache sized for the tree) and an AR step (one query, a smaller
# cache) then rounded a position apart, and in bfloat16 7 of 8 greedy `sd` rows on `digits` left
# greedy AR. Batch-invariant attention calls the kernel at query counts and key counts a probe
# found to give a query one result (:class:`AttentionCalls`, :func:`lantern.models.attention.attend`).

# Key-axis granules tried, smallest first: a cache's length is rounded up to a multiple (masked
# keys). ATen's CPU kernel cuts the keys into blocks of 512 and sums a block's keys in an order
# that follows the block's length: over a cache one 256-key granule longer, a float32 query whose
# keys end at 700 took other bits in every (head, query) output, a bfloat16 one in 0.2-0.6 % of
# them at granules of 64 and 128 (too rare for a probe to be sure to see), none at 512.
KEY_GRANULES = (512, 1024)
CUDA_KEY_GRANULES = (64, 128, 256, 512, 1024)
# Query counts tried for the smallest call. On a GPU a call of 64 queries costs what one of 1 does.
ATTENTION_QUERY_CANDIDATES = (4, 8, 16, 2, 1)
CUDA_ATTENTION_QUERY_CANDIDATES = (64, 32, 16, 8, 4, 2, 1)
# Batch sizes at which a row's result is checked against its result alone; CUDA's kernels pick
# their split of the keys by batch x heads (FlashAttention's split-KV heuristic), ATen's CPU one
# runs each (row, head, query block) alone.
ATTENTION_ROW_COUNTS = (2, 3, 8)
# A query's last attended keys computed apart from the rest (``lantern.models.attention``): a tree
# puts a node's ancestors between its siblings, so the same keys sit at other cache slots than in
# an AR step, and a kernel that sums keys in tiles rounds them apart (measured: ATen's CPU kernel
# with AMX, bfloat16, one greedy `sjd-pac` row on `digits` in 8). A node whose keys past the first
# slot of another branch number at most 16 is covered (`sjd-pac`'s run 2 deep, EAGLE's default 4;
# `attention.side_by_side`, which the greedy tests hold every lossless method's forwards to).
# 16, not more: the tail's elementwise ops cost per query and key (a 16 x 35-query float32 layer
# on photos' 4 x 64 heads: 22 ms with it, 11 ms without). CUDA keeps one kernel call until a
# device run checks the tail path there.
TAIL_KEYS = 16


@dataclass(frozen=True)
class AttentionCalls:
    """How batch-invariant attention calls its kernel on one device, dtype and head shape.

    ``queries``: the query counts of a call, smallest first (each a multiple of the first; a
    forward's queries are zero-padded to a multiple of it and cut by :func:`call_sizes`).
    ``keys``: the key-axis granule; a cache holds a multiple of it (:func:`key_granule`), so that
    a cache sized for a larger tree only adds whole blocks of masked keys, which leave a query's
    bits alone. ``rows_free``: whether a call may hold any number of rows (else one row per call).
    ``tail``: how many of a query's last attended keys are computed apart from the kernel, in a
    layout that does not depend on where they sit in the cache (0: none; :data:`TAIL_KEYS` on a
    CPU)."""

    queries: tuple[int, ...]
    keys: int
    rows_free: bool
    tail: int = 0


def _probe_key_ends(granule: int) -> tuple[int, ...]:
    """Where the probe's queries' own keys end: inside the first three granules (so that the fewest
    granules holding them are 1 to 3 of them, odd and even counts) and at lengths that end inside
    the blocks a kernel cuts the key axis into (ATen's CPU kernel: 512 keys; measured in float32, a
    query whose keys end at 700 took other bits over 768 keys than over 1,024)."""
    return (granule // 2 + 1, granule + granule // 3, 2 * granule + granule // 5, 333, 777)


@dataclass
class _AttentionCase:
    """A query, its mask (its keys end at ``real``, some before masked) and random keys and values,
    tried over caches of several multiples of a granule: the fewest that hold its keys, then 1 and 2
    granules more, all masked (a cache sized for a larger tree)."""

    q: Tensor  # [H, Dh]
    k: Tensor  # [H, S_max, Dh]
    v: Tensor
    mask: Tensor  # [S_max] bool
    key_counts: tuple[int, ...]
    gen: torch.Generator

    @classmethod
    def random(cls, gen: torch.Generator, heads: int, head_dim: int, like: Tensor, granule: int,
               real: int) -> _AttentionCase:
        fit = round_up(real, granule)
        key_counts = (fit, fit + granule, fit + 2 * granule)
        k, v = (_randn(gen, like, heads, key_counts[-1], head_dim) for _ in range(2))
        mask = torch.rand(key_counts[-1], generator=gen) < 0.8
        mask[0], mask[real:] = True, False
        return cls(_randn(gen, like, heads, head_dim), k, v, mask.to(like.device), key_counts, gen)

    def outputs(self, queries: int, positions: range, keys: int, rows: int = 1, row: int = 0) -> Tensor:
        """The query's outputs [P, H, Dh] when it sits at each of ``positions`` of one call of
        ``queries`` queries over the first ``keys`` keys, in row ``row`` of ``rows`` (the other
        queries, their masks and the other rows random)."""
        heads, head_dim = self.q.shape
        q = _randn(self.gen, self.q, rows, heads, queries, head_dim)
        mask = (torch.rand(rows, 1, queries, keys, generator=self.gen) < 0.8).to(self.mask.device)
        mask[..., 0] = True
        q[row, :, positions], mask[row, 0, positions] = self.q[:, None], self.mask[:keys]
        # other rows: the case's keys and values moved along the key axis (other values, no new draws)
        k, v = (kv[None, :, :keys] if rows == 1 else torch.stack([kv[:, :keys].roll(i - row, 1) for i in range(rows)])
                for kv in (self.k, self.v))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return out[row, :, positions].transpose(0, 1)

    def agrees(self, queries: int, reference: int, key_counts: tuple[int, ...] = ()) -> bool:
        """Whether the query, at every position of a ``queries``-query call (every other position in
        each of two calls) and over each of ``key_counts`` keys (default: the case's), gets its bits
        at position 0 of a ``reference``-query call over the fewest."""
        want = self.outputs(reference, range(1), self.key_counts[0])
        spots = [range(0, queries, 2), range(1, queries, 2)]
        return all(torch.equal(self.outputs(queries, spot, keys), want.expand(len(spot), -1, -1))
                   for keys in key_counts or self.key_counts for spot in spots if len(spot))

    def heads(self, n: int | None) -> _AttentionCase:
        """The case with its first ``n`` heads (None: all)."""
        return _AttentionCase(self.q[:n], self.k[:n], self.v[:n], self.mask, self.key_counts, self.gen)


# A kernel's rounding of a query differs only where its sums round apart: measured on ATen's CPU
# kernel in bfloat16, 0.2-0.6 % of (head, query) outputs over a cache one granule of 64 or 128
# keys longer, so one check must see thousands. ATen's CPU kernel computes each (row, head, query
# block) alone, so a head's bits do not depend on the head count: there the probe's heads are
# samples, 64 of them (4 in a larger call, whose many queries are samples too, and in a batch,
# which changes no order there). CUDA's kernels choose their split of the keys by batch x heads:
# there the probe takes the model's heads, and 8 random cases per key end instead (a GPU call
# costs microseconds).
_CPU_PROBE_HEADS = 64
_CPU_FEW_HEADS = 4
_CUDA_PROBE_TRIALS = 8


def _probe_attention(heads: int, head_dim: int, like: Tensor) -> AttentionCalls:
    gen = torch.Generator().manual_seed(0)
    trials = 1
    if like.device.type == "cpu":
        heads = _CPU_PROBE_HEADS
    else:
        trials = _CUDA_PROBE_TRIALS
    candidates = CUDA_ATTENTION_QUERY_CANDIDATES if like.device.type == "cuda" else ATTENTION_QUERY_CANDIDATES
    # Fewer calls first, then fewer masked keys: a granule of 512 adds at most 511 keys to a cache
    # of hundreds to thousands, where one query per call would multiply a round's calls by its size.
    for smallest in candidates:
        for granule in CUDA_KEY_GRANULES if like.device.type == "cuda" else KEY_GRANULES:
            cases = [_AttentionCase.random(gen, heads, head_dim, like, granule, real)
                     for real in _probe_key_ends(granule) for _ in range(trials)]

            def agree(c: list[_AttentionCase] = cases, q: int = smallest) -> bool:
                return all(case.agrees(q, q) for case in c)

            if at_every_thread_count(agree):
                return _calls_from(cases, granule, smallest, like.device)
    warnings.warn(f"attention on {like.device} ({like.dtype}, {heads} x {head_dim}) gave a query other bits at "
                  f"every key granule up to {KEY_GRANULES[-1]}: batch-invariant mode calls it one query and one "
                  "row at a time, and a cache sized for another tree may still change a query's last bits",
                  stacklevel=2)
    return AttentionCalls((1,), KEY_GRANULES[-1], False, tail_keys(like.device))


def _calls_from(cases: list[_AttentionCase], granule: int, smallest: int, device: torch.device) -> AttentionCalls:
    """The calls once ``smallest`` queries passed at ``granule``: the larger query counts that give
    a query its bits in the smallest call (two cases whose keys fit in two granules, over one
    granule more), and whether a row's output is its output alone in a batch of each of
    ``ATTENTION_ROW_COUNTS``."""
    short = [case.heads(_CPU_FEW_HEADS if device.type == "cpu" else None)
             for case in cases if case.key_counts[0] <= 2 * granule][:2]

    def same(r: int) -> bool:
        return all(case.agrees(r, smallest, case.key_counts[1:2]) for case in short)

    def alone_in_a_batch(case: _AttentionCase, rows: int, row: int) -> bool:
        keys = case.key_counts[1]
        return torch.equal(case.outputs(smallest, range(1), keys, rows, row), case.outputs(smallest, range(1), keys))

    larger = [r for r in larger_calls(smallest, largest_call_rows(device))
              if at_every_thread_count(functools.partial(same, r))]
    rows_free = all(alone_in_a_batch(case, rows, row)
                    for case in short for rows in ATTENTION_ROW_COUNTS for row in range(rows))
    return AttentionCalls((smallest, *larger), granule, rows_free, tail_keys(device))


def tail_keys(device: torch.device) -> int:
    """:data:`TAIL_KEYS` on a CPU, 0 on CUDA (see there)."""
    return TAIL_KEYS if device.type == "cpu" else 0


# (heads, head dim, dtype, device) -> AttentionCalls, found once per process
_probed_attention: dict[tuple[Any, ...], AttentionCalls] = {}


@torch.no_grad()
def attention_calls(heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> AttentionCalls:
    """The :class:`AttentionCalls` of this device's ``F.scaled_dot_product_attention`` for one
    head shape and dtype: the first query count (of ``ATTENTION_QUERY_CANDIDATES``) and, for it,
    the first key granule (of ``KEY_GRANULES``) at which a query's output is the same at every
    position of a call and over the fewest granules that hold its keys and one and two more (all
    masked), the larger query counts that give it the same bits, and whether a row's output is the
    same in a batch (checked at every thread count of :func:`_probe_threads`; cached per process;
    on a CPU run in a thread of its own)."""
    key = (heads, head_dim, dtype, device)
    if key not in _probed_attention:
        like = torch.empty(0, dtype=dtype, device=device)
        probe = functools.partial(_probe_attention, heads, head_dim, like)
        _probed_attention[key] = in_a_thread_that_ends(probe) if device.type == "cpu" else probe()
    return _probed_attention[key]


class AttentionModule(Protocol):
    """A module that computes attention (lantern's LlamaGen layer, a cached decoder, a drafter layer):
    ``attention_calls`` is None in the default mode."""

    n_head: int
    head_dim: int
    attention_calls: AttentionCalls | None


def key_granule(module: Modular) -> int:
    """The key granule a cache for ``module`` must be a multiple of: the largest of its attention
    layers' (1 in the default mode)."""
    return max([calls.keys for sub in module.modules()
                if (calls := getattr(sub, "attention_calls", None)) is not None], default=1)


def round_up(n: int, granule: int) -> int:
    return -(-n // granule) * granule


def _set_attention_calls(module: nn.Module, enabled: bool) -> None:
    """Probe (or clear) the calls of a module whose class declares ``attention_calls``."""
    if not hasattr(type(module), "attention_calls"):
        return
    layer = cast(AttentionModule, module)
    if not enabled:
        layer.attention_calls = None
        return
    weight = next(module.parameters())
    dtype = getattr(module, "dtype", weight.dtype)  # a decoder's own (a wrapped VQ model may keep float32)
    layer.attention_calls = attention_calls(layer.n_head, layer.head_dim, dtype, weight.device)


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
        _set_attention_calls(sub, enabled)
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
