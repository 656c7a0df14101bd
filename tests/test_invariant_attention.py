"""Batch-invariant attention (lantern.models.invariant's probe, lantern.models.attention.attend).

A fused attention kernel blocks its query and key axes by their lengths, so the same query could
round apart in a verified tree (many queries, a cache sized for the tree) and in an AR step (one
query, a smaller cache): in bfloat16, 7 of 8 greedy ``sd`` rows on ``digits`` left greedy AR.
Deterministic mode calls the kernel at query counts and key counts a probe found to give a query
one result. Here: the end-to-end promise (greedy lossless methods = greedy AR in bfloat16), the
float-level property on this machine's kernel, and the probe's answers for planted kernels that
depend on the query count, a query's position, the key count or the batch (each test's power).
tests/test_capabilities.py runs the ``invariance`` tests again under forced AVX2 kernels: the
end-to-end, float-level and decoder tests (the planted ones test the probe's logic, not the ISA).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_chameleon
from torch import Tensor

import lantern
from lantern.decoding.cache import KVCache
from lantern.decoding.config import SamplingConfig, TreeConfig
from lantern.decoding.trees import keys_past_first_gap, static_tree
from lantern.drafters.checks import warn_if_the_tail_is_outrun
from lantern.io import LanternWarning
from lantern.methods import METHOD_TABLE
from lantern.models import attention, invariant
from lantern.models.attention import attend, side_by_side, split_tail
from lantern.models.chameleon import ChameleonLM
from lantern.models.invariant import AttentionCalls, attention_calls, key_granule, make_batch_invariant, round_up

LOSSLESS = [m.name for m in METHOD_TABLE.values() if m.lossless and m.name != "ar"]
LABELS = list(range(8))
_SDPA = F.scaled_dot_product_attention


@pytest.fixture(scope="module")
def bf16_pipe() -> lantern.Pipeline:
    return lantern.load("digits", dtype="bfloat16", deterministic=True)


@pytest.fixture(scope="module")
def bf16_ar(bf16_pipe: lantern.Pipeline) -> Tensor:
    return bf16_pipe(labels=LABELS, method="ar", temperature=0, seed=0).codes


@pytest.fixture
def heads_apart(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Every forward's count of queries whose head (the keys the kernel sums) is not one run side
    by side (:func:`side_by_side`), one entry per split of a mask, while the test runs."""
    counts: list[int] = []

    def recorded(mask: Tensor, tail: int) -> tuple[Tensor, Tensor, Tensor]:
        head, index, valid = split_tail(mask, tail)
        counts.append(int((~side_by_side(head)).sum()))
        return head, index, valid

    monkeypatch.setattr(attention, "split_tail", recorded)
    attention._last_split.clear()  # a split kept from before would not be recorded
    yield counts
    attention._last_split.clear()


@pytest.mark.invariance
@pytest.mark.parametrize("method", LOSSLESS)
def test_greedy_lossless_methods_reproduce_greedy_ar_in_bfloat16(bf16_pipe: lantern.Pipeline, bf16_ar: Tensor,
                                                                  method: str, heads_apart: list[int]) -> None:
    """Token for token, every row (before batch-invariant attention, 7 of 8 ``sd`` rows parted).
    And by construction, not only where this machine's kernel sums keys in one order: every query
    of every forward hands the kernel a head side by side, as in an AR step (on a kernel that tiles
    keys, ATen's with AMX, a head with a gap rounds apart: one ``sjd-pac`` row in 8 left AR)."""
    codes = bf16_pipe(labels=LABELS, method=method, temperature=0, seed=0).codes
    differ = [i for i in range(len(LABELS)) if not torch.equal(codes[i], bf16_ar[i])]
    assert not differ, f"{method}: rows {differ} left greedy AR"
    assert heads_apart and sum(heads_apart) == 0, f"{method}: {sum(heads_apart)} queries' heads have gaps"


def test_the_head_check_sees_a_branch_that_runs_past_the_tail(bf16_pipe: lantern.Pipeline,
                                                               heads_apart: list[int]) -> None:
    """Power of the check above: a fork at the root, then a chain (``[[1], [0], [0, 0], ...]``). A
    node ``d`` deep has its root and first child side by side, then ``d - 1`` keys past a sibling's
    slot: the tail of 16 takes them all to ``d`` 17, and at 18 one key stays in the head, past the
    gap (and every default tree of every lossless method is held to it above).
    Such a tree is counted from its shape when a method is prepared (``keys_past_first_gap``), and
    in deterministic mode the user is warned that greedy = AR no longer holds (the default mode,
    which promises no such thing, says nothing)."""
    assert invariant.TAIL_KEYS == 16
    for depth, apart in ((17, False), (18, True)):
        heads_apart.clear()
        tree = [[1]] + [[0] * d for d in range(1, depth + 1)]
        assert keys_past_first_gap(static_tree(tree).buffers.mask) == depth - 1
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            bf16_pipe(labels=[1], method="sd", tree=tree, temperature=0, seed=0)
        assert heads_apart and (sum(heads_apart) > 0) == apart, (depth, sum(heads_apart))
        warned = [str(w.message) for w in caught if issubclass(w.category, LanternWarning)]
        assert len(warned) == apart and all(f"a node keeps {depth - 1} keys past" in w for w in warned), warned
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_if_the_tail_is_outrun(TreeConfig.from_choices(tree), lantern.load("digits").stack.network())


def test_side_by_side_is_one_run_of_keys() -> None:
    heads = torch.tensor([[1, 1, 1, 0, 0],   # an AR step's head: slots 0 .. 2
                          [0, 1, 1, 1, 0],   # after a prompt's left padding
                          [1, 1, 0, 1, 0],   # a sibling's slot left out
                          [0, 0, 0, 0, 0],   # no head (every key in the tail)
                          [0, 0, 0, 0, 1]], dtype=torch.bool)
    assert side_by_side(heads[None]).tolist() == [[True, True, False, True, True]]


@pytest.mark.invariance
def test_a_deterministic_targets_attention_and_cache_follow_the_probe(bf16_pipe: lantern.Pipeline) -> None:
    network = bf16_pipe.stack.network()
    calls = {m.attention_calls for m in network.modules() if hasattr(type(m), "attention_calls")}
    assert len(calls) == 1 and None not in calls  # every layer: one head shape, one probe
    granule = key_granule(network)
    assert granule == next(iter(calls)).keys  # type: ignore[union-attr]
    for nodes in (1, 60):  # an AR step's cache, and one sized for a 60-node tree
        target = bf16_pipe.stack.make_target(SamplingConfig(), max_tree_nodes=nodes)
        target.start(torch.tensor([1]))
        assert target.cache.max_len % granule == 0
    default = lantern.load("digits").stack.network()
    assert key_granule(default) == 1
    assert all(m.attention_calls is None for m in default.modules() if hasattr(type(m), "attention_calls"))


def _random_attention(gen: torch.Generator, rows: int, queries: int, keys: int, dtype: torch.dtype,
                      heads: int = 4, head_dim: int = 64) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """q [rows, H, queries, Dh], k / v over ``keys`` keys, a mask [rows, queries, keys] whose
    attended keys end before 300 (the rest of the cache masked)."""
    q, k, v = (torch.randn(rows, heads, n, head_dim, generator=gen).to(dtype) for n in (queries, keys, keys))
    mask = torch.rand(rows, queries, keys, generator=gen) < 0.8
    mask[..., 0], mask[..., 300:] = True, False
    return q, k, v, mask


@pytest.mark.invariance
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("queries", [5, 13, 40])
def test_a_query_gets_its_alone_bits_in_any_call_batch_and_cache_length(dtype: torch.dtype, queries: int) -> None:
    """This machine's kernel through ``attend`` with its probed calls: a query in a call of
    ``queries`` queries (padded), in a batch of 3, over a cache one or two granules longer, has
    the bits it has alone, one query over the shortest cache that holds its keys."""
    calls = attention_calls(4, 64, dtype, torch.device("cpu"))
    gen = torch.Generator().manual_seed(queries)
    short = invariant.round_up(300, calls.keys)
    for extra in (1, 2):
        keys = short + extra * calls.keys
        q, k, v, mask = _random_attention(gen, 3, queries, keys, dtype)
        out = attend(q, k, v, mask, calls=calls)
        for row in range(3):
            for t in range(queries):
                alone = attend(q[row : row + 1, :, t : t + 1], k[row : row + 1, :, :short],
                               v[row : row + 1, :, :short], mask[row : row + 1, t : t + 1, :short], calls=calls)
                assert torch.equal(out[row, :, t], alone[0, :, 0]), (extra, row, t)


def _planted(change: Callable[[Tensor, Tensor], Tensor | bool]) -> Callable[..., Tensor]:
    """ATen's kernel plus a change of 1e-2 where ``change(q, k)`` (a bool, or a mask over the
    output's query axis) says so: a kernel whose rounding depends on the call's shape."""

    def kernel(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None = None, **kw: Any) -> Tensor:
        out = _SDPA(q, k, v, attn_mask=attn_mask, **kw)
        where = change(q, k)
        if isinstance(where, Tensor):
            return out + 1e-2 * where[None, None, :, None].to(out.dtype)
        return out + 1e-2 if where else out

    return kernel


def _probe_with(monkeypatch: pytest.MonkeyPatch, kernel: Callable[..., Tensor]) -> AttentionCalls:
    monkeypatch.setattr(invariant, "_probed_attention", {})
    monkeypatch.setattr(invariant.F, "scaled_dot_product_attention", kernel)
    return attention_calls(2, 16, torch.float32, torch.device("cpu"))


def test_the_probe_finds_this_kernels_calls_and_a_real_query_check_fails_without_them() -> None:
    """The unplanted answer on a CPU: one of the candidate query counts with larger calls kept
    (the Zen 5 EPYC: 4, then every multiple of 4 to 32, 64, 128, 256), ATen's 512-key blocks or
    more, and every batch. Power of the float-level test above: without the calls, a float32 query
    over a cache of 7 more masked keys, or alone against in a call of 8, changes bits somewhere."""
    calls = attention_calls(4, 64, torch.float32, torch.device("cpu"))
    assert calls.queries[0] in invariant.ATTENTION_QUERY_CANDIDATES and len(calls.queries) > 1
    assert calls.keys in invariant.KEY_GRANULES and calls.rows_free
    gen = torch.Generator().manual_seed(0)
    q, k, v, mask = _random_attention(gen, 1, 8, 1100, torch.float32, heads=16)
    full = attend(q, k, v, mask)
    longer = attend(q, F.pad(k, (0, 0, 0, 7)), F.pad(v, (0, 0, 0, 7)), F.pad(mask, (0, 7)))
    alone = torch.cat([attend(q[:, :, t : t + 1], k, v, mask[:, t : t + 1]) for t in range(8)], 2)
    assert not torch.equal(full, longer) or not torch.equal(full, alone)


def test_the_probe_drops_query_counts_that_round_a_query_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    """Calls of 32 or more queries round apart: the probe keeps the sizes it keeps unplanted, below 32."""
    native = attention_calls(2, 16, torch.float32, torch.device("cpu"))
    calls = _probe_with(monkeypatch, _planted(lambda q, k: q.shape[2] >= 32))
    assert calls.queries == tuple(r for r in native.queries if r < 32) and len(calls.queries) > 1


def test_the_probe_skips_a_query_count_whose_edge_positions_round_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    """In calls of an odd multiple of the first candidate, the second half of the first candidate's
    positions (an edge tile) rounds apart: the probe skips that count and keeps no size that has it."""
    first = invariant.ATTENTION_QUERY_CANDIDATES[0]

    def edge(q: Tensor, k: Tensor) -> Tensor | bool:
        t = q.shape[2]
        return (torch.arange(t) % first >= first // 2) if t % (2 * first) == first else False

    calls = _probe_with(monkeypatch, _planted(edge))
    assert calls.queries[0] != first and all(r % (2 * first) != first for r in calls.queries)


def test_the_probe_takes_a_granule_of_whole_key_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel whose rounding follows the key count unless it is a multiple of 1024: granule 1024."""
    calls = _probe_with(monkeypatch, _planted(lambda q, k: k.shape[2] % 1024 != 0))
    assert calls.keys == 1024


def test_a_batch_dependent_kernel_gets_one_row_per_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel whose rounding changes with the batch: the probe says so, and ``attend`` then gives
    each row its alone bits (one call per row) where one batched call does not."""
    kernel = _planted(lambda q, k: q.shape[0] > 1)
    calls = _probe_with(monkeypatch, kernel)
    assert not calls.rows_free
    q, k, v, mask = _random_attention(torch.Generator().manual_seed(1), 3, 5, 2 * calls.keys, torch.float32)
    out = attend(q, k, v, mask, calls=calls)
    batched = attend(q, k, v, mask, calls=AttentionCalls(calls.queries, calls.keys, True))
    for row in range(3):
        alone = attend(q[row : row + 1], k[row : row + 1], v[row : row + 1], mask[row : row + 1], calls=calls)
        assert torch.equal(out[row], alone[0]) and not torch.equal(batched[row], alone[0])


def test_a_kernel_that_never_agrees_gets_a_warning_and_the_most_careful_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    noisy = torch.Generator().manual_seed(2)

    def kernel(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None = None, **kw: Any) -> Tensor:
        out = _SDPA(q, k, v, attn_mask=attn_mask, **kw)
        return out + 1e-2 * torch.rand(out.shape, generator=noisy)

    with pytest.warns(UserWarning, match="other bits at every key granule"):
        calls = _probe_with(monkeypatch, kernel)
    assert calls == AttentionCalls((1,), invariant.KEY_GRANULES[-1], False, invariant.TAIL_KEYS)


def test_split_tail_parts_a_querys_keys_into_its_head_and_its_last_keys_in_order() -> None:
    """A query's last ``tail`` attended keys, in order and wherever they sit (the last in the last
    slot), and the rest as its head; a query with fewer keys fills the last slots only."""
    mask = torch.zeros(1, 3, 10, dtype=torch.bool)
    mask[0, 0, :4] = True  # side by side (an AR step): head 0-1, tail 2, 3
    mask[0, 1, [0, 1, 2, 6, 9]] = True  # a tree node: its ancestors 6 and 9 among masked siblings
    mask[0, 2, 5] = True  # one key: no head
    head, index, valid = split_tail(mask, 2)
    assert head[0].nonzero().tolist() == [[0, 0], [0, 1], [1, 0], [1, 1], [1, 2]]
    assert index[0, :2].tolist() == [[2, 3], [6, 9]] and index[0, 2, 1] == 5
    assert valid[0].tolist() == [[True, True], [True, True], [False, True]]


def _query_in_two_layouts(gen: torch.Generator, dtype: torch.dtype, calls: AttentionCalls, prefix: int, depth: int
                          ) -> tuple[Tensor, Tensor]:
    """One query (4 heads of 64) whose keys are a ``prefix`` and ``depth`` more, through ``attend``:
    an AR step's layout (the keys side by side, the query alone, over the fewest granules that hold
    them) and a tree's (the last ``depth`` keys among masked random siblings after the prefix, the
    query at position 17 of a 35-query call over a cache one granule longer)."""
    keys = prefix + depth
    q, k, v = (torch.randn(1, 4, n, 64, generator=gen).to(dtype) for n in (1, keys, keys))
    short = invariant.round_up(keys, calls.keys)
    mask = torch.zeros(1, 1, short, dtype=torch.bool)
    mask[..., :keys] = True
    pad = (0, 0, 0, short - keys)
    ar = attend(q, F.pad(k, pad), F.pad(v, pad), mask, calls=calls)[0, :, 0]
    slots = prefix + torch.randperm(40, generator=gen)[:depth].sort().values
    long = short + calls.keys
    tk, tv = (torch.randn(1, 4, long, 64, generator=gen).to(dtype) for _ in range(2))
    tq = torch.randn(1, 4, 35, 64, generator=gen).to(dtype)
    tmask = torch.rand(1, 35, long, generator=gen) < 0.5
    tk[:, :, :prefix], tv[:, :, :prefix] = k[:, :, :prefix], v[:, :, :prefix]
    tk[:, :, slots], tv[:, :, slots] = k[:, :, prefix:], v[:, :, prefix:]
    tq[:, :, 17], tmask[0, 17] = q[:, :, 0], False
    tmask[0, 17, :prefix] = tmask[0, 17, slots] = True
    tree = attend(tq, tk, tv, tmask, calls=calls)[0, :, 17]
    return ar, tree


@pytest.mark.invariance
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_querys_bits_do_not_depend_on_where_its_last_keys_sit(dtype: torch.dtype) -> None:
    """This machine's kernel through ``attend`` with its probed calls: a query whose last 1-5 keys
    sit among masked siblings (a tree node's ancestors) has the bits it has with them side by side
    (an AR step), 40 cases (on a Xeon with AMX, in bfloat16, one greedy ``sjd-pac`` row on
    ``digits`` in 8 left greedy AR before the tail was taken out of the kernel call)."""
    calls = attention_calls(4, 64, dtype, torch.device("cpu"))
    assert calls.tail == invariant.TAIL_KEYS
    gen = torch.Generator().manual_seed(7)
    for case in range(40):
        prefix, depth = int(torch.randint(1, 400, (1,), generator=gen)), 1 + case % 5
        ar, tree = _query_in_two_layouts(gen, dtype, calls, prefix, depth)
        assert torch.equal(ar, tree), (case, prefix, depth)


def _slot_planted(kernel: Callable[..., Any], lse: bool) -> Callable[..., Any]:
    """``kernel`` plus 1e-3 times the slot of each query's last attended key: a kernel whose
    rounding follows where the keys sit (``attn_mask`` bool, or a float bias with -inf)."""

    def planted(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor, **kw: Any) -> Any:
        result = kernel(q, k, v, attn_mask=attn_mask, **kw)
        attended = attn_mask if attn_mask.dtype == torch.bool else attn_mask == 0
        last = (attended * torch.arange(k.shape[2])).amax(-1)  # [N, 1, T]
        if not lse:
            return result + 1e-3 * last[..., None].to(result.dtype)
        return result[0] + 1e-3 * last[..., None].to(result[0].dtype), result[1]

    return planted


def test_the_tail_keeps_a_query_from_a_kernel_that_rounds_by_key_slot(monkeypatch: pytest.MonkeyPatch) -> None:
    """Power of the test above on any machine: a planted kernel whose result follows the slot of a
    query's last attended key gives a tree node other bits than its AR step when the kernel sees
    all of its keys (no tail), and the same bits with the tail taken out."""
    native = attention_calls(4, 64, torch.float32, torch.device("cpu"))
    monkeypatch.setattr(F, "scaled_dot_product_attention", _slot_planted(_SDPA, lse=False))
    monkeypatch.setattr(attention, "_flash_with_lse", _slot_planted(attention._flash_with_lse, lse=True))
    for calls, same in ((native, True), (dataclasses.replace(native, tail=0), False)):
        gen = torch.Generator().manual_seed(3)
        outcomes = {torch.equal(*_query_in_two_layouts(gen, torch.float32, calls, 100 + 37 * i, 3)) for i in range(4)}
        assert outcomes == {same}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_with_a_tail_is_attention(dtype: torch.dtype) -> None:
    """``attend`` with its head and tail computed apart is softmax attention: against one fused call,
    in a batch of 3 with 40 queries, some with fewer keys than the tail (no head) and some over
    masked gaps."""
    calls = attention_calls(4, 64, dtype, torch.device("cpu"))
    q, k, v, mask = _random_attention(torch.Generator().manual_seed(4), 3, 40, calls.keys, dtype)
    mask[0, :5, 12:] = False  # 12 or fewer keys: all tail
    assert calls.tail > 12
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(attend(q, k, v, mask, calls=calls), attend(q, k, v, mask), **tol)


def _pairwise(values: list[float]) -> float:
    """The float32 sum of ``values`` in :func:`attention._ordered_sum`'s order: the last half added
    to the first, an odd middle term carried."""
    xs = [torch.tensor(x, dtype=torch.float32) for x in values]
    while len(xs) > 1:
        half = len(xs) // 2
        xs = [xs[i] + xs[len(xs) - half + i] for i in range(half)] + (xs[half : half + 1] if len(xs) % 2 else [])
    return float(xs[0])


@pytest.mark.parametrize("size", [64, 16, 13])
def test_the_tail_sums_in_one_fixed_order(size: int) -> None:
    """The tail's sums (over a head's 64 dims, over its 16 keys) follow one order, that of
    :func:`_pairwise` on scalars, for 200 rows in one call; power: ATen's own sum rounds some of
    the same rows apart (another order), so the check can tell orders apart."""
    x = torch.randn(200, size, generator=torch.Generator().manual_seed(8)) * torch.logspace(-3, 3, size)
    ours = attention._ordered_sum(x.clone(), -1)
    want = torch.tensor([_pairwise(row.tolist()) for row in x])
    assert torch.equal(ours, want)
    assert not torch.equal(x.sum(-1), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_querys_tail_does_not_depend_on_the_queries_and_rows_beside_it(dtype: torch.dtype) -> None:
    """``with_tail`` for one query alone (an AR step) and in a batch of 3 rows x 35 queries at 1 and
    2 threads: the same bits (its ops are elementwise, a row-by-row softmax and fixed-order sums)."""
    gen = torch.Generator().manual_seed(9)
    n, t, h, w, d = 3, 35, 4, invariant.TAIL_KEYS, 64
    q = torch.randn(n, h, t, d, generator=gen).to(dtype)
    tail_k, tail_v = (torch.randn(n, t, h, w, d, generator=gen).to(dtype) for _ in range(2))
    valid = torch.rand(n, t, w, generator=gen) < 0.8
    valid[..., -1] = True
    head_out = torch.randn(n, h, t, d, generator=gen).to(dtype)
    head_lse = torch.randn(n, h, t, generator=gen) * 4
    has_head = torch.rand(n, t, generator=gen) < 0.7
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            batch = attention.with_tail(q, tail_k, tail_v, valid, head_out, head_lse, has_head, 0.125)
            for i, j in ((0, 0), (1, 17), (2, 34)):
                alone = attention.with_tail(q[i : i + 1, :, j : j + 1], tail_k[i : i + 1, j : j + 1],
                                            tail_v[i : i + 1, j : j + 1], valid[i : i + 1, j : j + 1],
                                            head_out[i : i + 1, :, j : j + 1], head_lse[i : i + 1, :, j : j + 1],
                                            has_head[i : i + 1, j : j + 1], 0.125)
                assert torch.equal(alone[0, :, 0], batch[i, :, j]), (count, i, j)
    finally:
        torch.set_num_threads(threads)


def test_a_mask_changed_in_place_gets_its_own_split() -> None:
    """A forward's layers share one split of its mask, but a mask buffer reused in place (a static
    buffer) is another mask: the second call attends as over a fresh tensor of its contents."""
    calls = attention_calls(4, 64, torch.float32, torch.device("cpu"))
    q, k, v, mask = _random_attention(torch.Generator().manual_seed(6), 2, 6, calls.keys, torch.float32)
    first = attend(q, k, v, mask, calls=calls)
    mask[:, :, 100:] = False
    again = attend(q, k, v, mask, calls=calls)
    assert torch.equal(again, attend(q, k, v, mask.clone(), calls=calls)) and not torch.equal(again, first)


@pytest.mark.slow
def test_a_compiled_attention_with_a_tail_gives_the_eager_bits() -> None:
    """The tail's attention and its merge with the head are one opaque op, so a compiled round runs
    the eager ops (inductor would fuse its own products, exps and sums): the same bits compiled as
    eager, bfloat16."""
    calls = attention_calls(4, 64, torch.bfloat16, torch.device("cpu"))
    q, k, v, mask = _random_attention(torch.Generator().manual_seed(5), 2, 12, calls.keys, torch.bfloat16)
    compiled = torch.compile(lambda *a: attend(*a, calls=calls), fullgraph=True, dynamic=False)
    assert torch.equal(compiled(q, k, v, mask), attend(q, k, v, mask, calls=calls))


def _chameleon_hidden(lm: ChameleonLM, ids: Tensor, prompt: int, keys: int, one_at_a_time: bool) -> Tensor:
    """The final hidden states [N, L - prompt, D] of ``ids`` after a ``prompt``-token prefill, over
    a cache of ``keys`` slots: one forward per token (AR steps), or one forward over them all (a
    verified chain)."""
    n, length = ids.shape
    cache = KVCache(lm.n_layer, n, lm.kv_heads, keys, lm.head_dim, lm.dtype, lm.device)
    pos = torch.arange(length).expand(n, -1)

    def forward(a: int, b: int) -> Tensor:
        mask = torch.arange(keys)[None, :] <= pos[0, a:b, None]  # causal over the cache's slots
        return lm.forward_cached(ids[:, a:b], pos[:, a:b], pos[:, a:b], mask.expand(n, -1, -1), cache)

    forward(0, prompt)
    if one_at_a_time:
        return torch.cat([forward(i, i + 1) for i in range(prompt, length)], 1)
    return forward(prompt, length)


@pytest.mark.invariance
@pytest.mark.parametrize("planted", [False, True])
def test_a_chameleon_decoders_ar_steps_and_chain_forward_agree_bit_for_bit(monkeypatch: pytest.MonkeyPatch,
                                                                          planted: bool) -> None:
    """A Chameleon-family decoder (transformers' layers over lantern's cache), deterministic:
    32 tokens one AR step at a time over a cache of the fewest granules equal, bit for bit, one
    forward over all 32 over a cache one granule longer. Power: a planted kernel that rounds calls
    of fewer than 4 queries apart makes the default mode's two differ (this machine's float32
    kernel does too: 96 of 96 positions, measured), and the probe then keeps AR steps at 4."""
    if planted:
        monkeypatch.setattr(invariant, "_probed_attention", {})
        monkeypatch.setattr(invariant.F, "scaled_dot_product_attention", _planted(lambda q, k: q.shape[2] < 4))
    ids = torch.randint(0, 100, (3, 40), generator=torch.Generator().manual_seed(0))
    for deterministic in (True, False):
        lm = ChameleonLM(tiny_chameleon(seed=0, num_codes=16))
        make_batch_invariant(lm, enabled=deterministic)
        granule = max(key_granule(lm), 64)
        steps = _chameleon_hidden(lm, ids, 8, round_up(40, granule), one_at_a_time=True)
        chain = _chameleon_hidden(lm, ids, 8, round_up(40, granule) + granule, one_at_a_time=False)
        if deterministic:
            assert key_granule(lm) > 1 and torch.equal(steps, chain)
        elif planted:
            assert not torch.equal(steps, chain)
