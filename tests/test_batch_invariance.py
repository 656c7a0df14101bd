"""Batch invariance by construction (``lantern.load(..., deterministic=True)``, lantern.models.invariant).

The float level first: a row's logits are bit-identical in every batch size and at every position,
for the chunked linear layer alone and for a whole target network. Then the codes: every method
gives each image its alone codes in batches of 3 and 8 (joining and moving rows:
tests/test_rows.py). tests/test_capabilities.py runs the tests marked ``invariance`` again under
forced AVX2 kernels (MKL's AVX2 sgemm is the one whose row results depend on the batch).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import needs_libgomp, threads_left_by
from torch import Tensor, nn

import lantern
from lantern.api import resolve_settings
from lantern.methods import METHOD_TABLE
from lantern.models import invariant
from lantern.models.invariant import RowChunkedLinear, is_batch_invariant, make_batch_invariant
from lantern.run import run_conditions

pytestmark = pytest.mark.invariance

LABELS = [3, 1, 4, 1, 5, 9, 2, 6]
SEED = 11


@pytest.fixture(scope="module")
def pipe() -> lantern.Pipeline:
    return lantern.load("digits", deterministic=True)


def batch_dependence(fn: Callable[[Tensor], Tensor], x: Tensor, max_batch: int) -> list[tuple[int, int]]:
    """(batch size, position) of every row whose ``fn`` output differs, by a single bit, from the
    row's output alone; every contiguous batch of ``x``'s rows up to ``max_batch`` is tried."""
    alone = [fn(x[i : i + 1])[0] for i in range(x.shape[0])]
    found = []
    for size in range(2, max_batch + 1):
        for start in range(0, x.shape[0] - size + 1):
            out = fn(x[start : start + size])
            found += [(size, i) for i in range(size) if not torch.equal(out[i], alone[start + i])]
    return found


@pytest.fixture
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    try:
        yield request.param
    finally:
        torch.set_num_threads(before)


def test_the_check_catches_a_dependence_on_batch_size_or_position() -> None:
    """Power: a planted 1e-6 that depends on the batch size, or on the row's position, is found."""
    w = torch.randn(48, 32, generator=torch.Generator().manual_seed(0))
    x = torch.randn(12, 32, generator=torch.Generator().manual_seed(1))
    assert batch_dependence(lambda v: F.linear(v, w) * (1 + 1e-6 * v.shape[0]), x, 8)
    assert batch_dependence(lambda v: F.linear(v, w) + 1e-6 * torch.arange(v.shape[0])[:, None], x, 8)


@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("shape", [(256, 768), (704, 256), (64, 1024)])
def test_a_chunked_linear_row_is_the_same_in_every_batch(threads: int, shape: tuple[int, int]) -> None:
    """Rows of a batch-invariant ``nn.Linear`` are bit-identical at batch sizes 1..12 and every
    position, and in one call of 300 rows (every call size the layer makes, and at 2 threads the
    sizes where a BLAS splits work), and equal ``F.linear`` up to float rounding."""
    gen = torch.Generator().manual_seed(threads)
    layer = nn.Linear(*shape, bias=shape[0] == 64)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(layer.weight.shape, generator=gen) / shape[0] ** 0.5)
    make_batch_invariant(layer)
    assert type(layer) is RowChunkedLinear and layer.invariant_chunks[0] in invariant.CANDIDATE_ROWS
    x = torch.randn(300, shape[0], generator=gen)
    with torch.no_grad():
        assert batch_dependence(layer, x[:12], 12) == []
        full = layer(x)
        assert all(torch.equal(full[i], layer(x[i : i + 1])[0]) for i in range(300))
        torch.testing.assert_close(full, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)


def one_row_per_call_plus(offset: Callable[[Tensor], Tensor]) -> Callable[..., Tensor]:
    """A linear kernel that computes one row per call (so this machine's own GEMM cannot depend on
    the position or the call size) and adds ``offset(x)``, a planted dependence on them."""
    real = F.linear

    def kernel(x: Tensor, w: Tensor, b: Tensor | None = None) -> Tensor:
        out = torch.cat([real(row[None], w, b) for row in x])
        return out + torch.as_tensor(offset(x), dtype=out.dtype)

    return kernel


def test_the_chunk_size_skips_sizes_whose_rows_depend_on_their_position(monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe is a real check: a kernel whose rows 6 and 7 of every 8 come out differently (as
    MKL's AVX2 edge tiles do) is refused at 16, 12 and 8 and accepted at 6, and no larger call is
    kept (a 12-row call has rows in the edge too), nor any single-call size above 6 (a 7-row call
    has a row in it). The kernel under the injected edge computes one row per call, so this
    machine's own GEMM (which may itself depend on the position at 6 rows, as MKL's AVX2 code does
    on AMD EPYC) cannot move the answer."""
    edge = one_row_per_call_plus(lambda x: 1e-3 * (torch.arange(x.shape[0]) % 8 >= 6)[:, None])
    monkeypatch.setattr(invariant, "_probed", {})
    monkeypatch.setattr(invariant.F, "linear", edge)
    assert invariant.invariant_chunks(torch.randn(32, 16)) == (6,)
    assert invariant.invariant_single_calls(torch.randn(32, 16)) == (1, 2, 3, 4, 5, 6)
    monkeypatch.undo()
    monkeypatch.setattr(invariant, "_probed", {})
    assert invariant.invariant_chunks(torch.randn(32, 16))[0] in invariant.CANDIDATE_ROWS


def halves_from(rows_at_least: int) -> Callable[..., Tensor]:
    """A bfloat16 linear kernel that sums a row's products in float32 and rounds once, one row per
    call; in calls of ``rows_at_least`` rows or more it adds the two halves of the inputs apart (a
    kernel that blocks the reduction by the call size): float32 sums a few ulps apart."""
    real = F.linear

    def kernel(x: Tensor, w: Tensor, b: Tensor | None = None) -> Tensor:
        xf, wf, h = x.float(), w.float(), x.shape[1] // 2
        split = x.shape[0] >= rows_at_least
        out = torch.cat([real(row[None, :h], wf[:, :h]) + real(row[None, h:], wf[:, h:]) if split
                         else real(row[None], wf) for row in xf])
        return (out if b is None else out + b.float()).to(x.dtype)

    return kernel


def test_the_probe_sees_a_summation_order_that_bfloat16_rounding_hides(monkeypatch: pytest.MonkeyPatch) -> None:
    """A call size that adds a row's products in another order moves a bfloat16 output only where the
    float32 sums round apart, about never for random rows: the probe's rows cancel in pairs, so the
    order shows, and the sizes from 40 rows are refused (on a Xeon with AMX a 704-in layer's 40- to
    64-row calls were such sizes, and one greedy ``sd`` row on ``digits`` in 4 left greedy AR).
    Power: random rows see no difference there, the probe's rows most outputs."""
    kernel = halves_from(40)
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(32, 704, generator=gen).bfloat16()
    x = torch.randn(64, 704, generator=gen).bfloat16()
    assert torch.equal(kernel(x, weight)[:8], kernel(x[:8], weight))
    probe = invariant._CancellingSums.like(weight, None, gen)
    rows = probe.rows(gen, 64)
    assert (kernel(rows, probe.weight)[:8] != kernel(rows[:8], probe.weight)).float().mean() > 0.3
    monkeypatch.setattr(invariant, "_probed", {})
    monkeypatch.setattr(invariant.F, "linear", kernel)
    assert invariant.invariant_chunks(weight) == (8, 16, 24, 32)
    assert invariant.invariant_single_calls(weight) == tuple(range(1, 40))


def test_a_larger_call_is_kept_only_where_it_gives_a_row_the_smallest_calls_bits(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel whose 32-row calls give every row other bits (a size-driven kernel choice, as
    cuBLAS makes): 32 is refused and the other sizes kept; a layer on that kernel still gives a
    row its alone bits in every batch up to 300 rows, 32 rows included (one 33-row call; without
    the single-call sizes 24 + 8)."""
    monkeypatch.setattr(invariant, "_probed", {})
    monkeypatch.setattr(invariant.F, "linear", one_row_per_call_plus(lambda x: 1e-3 * (x.shape[0] == 32)))
    layer = make_batch_invariant(nn.Linear(16, 32))
    assert layer.invariant_chunks == (8, 16, 24, 40, 48, 56, 64, 128, 256)
    assert invariant.call_sizes(32, layer.invariant_chunks) == (24, 8)
    assert layer.invariant_single == (*range(1, 32), *range(33, 65))
    assert invariant.call_sizes(32, layer.invariant_chunks, layer.invariant_single) == (33,)
    x = torch.randn(300, 16, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        full, alone = layer(x), torch.cat([layer(row[None]) for row in x])
        assert torch.equal(full, alone)
        assert batch_dependence(layer, x[:40], 40) == []
        # power: the same kernel without the refusal changes the rows of a 32-row call
        layer.invariant_chunks, layer.invariant_single = (8, 16, 24, 32, 40, 48, 56, 64, 128, 256), ()
        assert not torch.equal(layer(x[:32]), alone[:32])


def test_a_single_call_size_is_kept_where_it_gives_the_smallest_calls_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CPU every size up to 8x the smallest call is probed too, so a batch-1 AR step's 2 rows
    need not pay for an 8-row call at every layer, nor a Jacobi round's 34 for a 40-row one (photos
    on an AMD EPYC Zen 5, bf16: AR 1.14x -> 1.06x, sjd-coupled 1.08x -> 1.03x the default mode's
    time): a kernel whose calls of a row count that is not a multiple of 4 give other bits (MKL's
    AVX2 sgemm runs rows in blocks of 4) keeps the multiples of 4 up to 64 and refuses the rest; 1
    to 4 rows then take one 4-row call, 9 rows a 12-row one, and a layer on that kernel gives every
    row its bits in an 8-row call at every batch size. Power: the same kernel in 2-row calls
    changes them."""
    kernel = one_row_per_call_plus(lambda x: 1e-3 * (x.shape[0] % 4 != 0))
    monkeypatch.setattr(invariant, "_probed", {})
    monkeypatch.setattr(invariant.F, "linear", kernel)
    layer = make_batch_invariant(nn.Linear(16, 32))
    assert layer.invariant_chunks == (8, *invariant.larger_calls(8, 256))
    assert layer.invariant_single == tuple(range(4, 65, 4))
    sizes = [invariant.call_sizes(m, layer.invariant_chunks, layer.invariant_single) for m in (1, 2, 4, 5, 9, 34, 65)]
    assert sizes == [(4,), (4,), (4,), (8,), (12,), (36,), (64, 8)]
    x = torch.randn(40, 16, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        in_8_rows = torch.cat([kernel(x[i : i + 8], layer.weight, layer.bias) for i in range(0, 40, 8)])
        assert torch.equal(torch.cat([layer(x[i : i + 2]) for i in range(0, 40, 2)]), in_8_rows)
        assert torch.equal(layer(x[:34]), in_8_rows[:34])
        assert batch_dependence(layer, x[:12], 12) == []
        layer.invariant_single = (2, 4)  # power: a 2-row call is not the 8-row call's bits
        assert not torch.equal(layer(x[:2]), in_8_rows[:2])


def test_a_row_count_up_to_8x_the_smallest_call_takes_one_call_of_a_single_call_size() -> None:
    """Rows up to the largest single-call size take one call of the smallest that holds them; more
    are padded to the smallest chunk as before, and never split to save padding (a round's 34 rows
    as 32 + 2 cost more than one 40-row call on an AMD EPYC: the second call's fixed cost is more
    than 6 rows' arithmetic). A GPU tries no single-call size (its padding is free)."""
    chunks, single = (8, *invariant.larger_calls(8, 256)), tuple(range(1, 65))
    assert [invariant.call_sizes(m, chunks, single) for m in (1, 2, 7, 9, 34, 64, 65, 200)] == [
        (1,), (2,), (7,), (9,), (34,), (64,), (64, 8), (128, 64, 8)]
    assert invariant.call_sizes(3, chunks, (2, 4, 8)) == (4,) and invariant.call_sizes(5, chunks, (2, 4, 8)) == (8,)
    assert invariant.call_sizes(9, chunks, (2, 4, 8)) == (16,)  # beyond the single-call sizes: as before
    assert invariant.single_calls(8, torch.device("cpu")) == [*range(1, 8), *range(9, 65)]
    assert invariant.single_calls(64, torch.device("cuda")) == []


@needs_libgomp
def test_the_probe_leaves_the_calling_thread_without_an_openmp_team(monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe runs at 2 threads in a thread of its own, so the thread that loads a model keeps
    no OpenMP worker: libgomp keeps a thread's team for the thread's lifetime, and a server's main
    thread holding one made its decode thread's team sleep between ops (AR 1.7x slower at 2
    threads). Power: the same probe run in the calling thread leaves its worker behind."""
    monkeypatch.setattr(invariant, "_probe_threads", lambda: [1, 2])
    weight = torch.randn(256, 256)
    monkeypatch.setattr(invariant, "_probed", {})
    assert threads_left_by(lambda: invariant.invariant_chunks(weight), settle=10.0) == 0
    chunks = invariant._probed.popitem()[1]
    assert threads_left_by(lambda: invariant._probe(weight, None), settle=0.0) >= 1  # power: a team stays
    assert invariant._probe(weight, None) == chunks  # the same answer in either thread


def test_a_failing_probe_raises_in_the_callers_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: Any) -> Tensor:
        raise RuntimeError("kernel says no")

    monkeypatch.setattr(invariant, "_probed", {})
    monkeypatch.setattr(invariant.F, "linear", broken)
    with pytest.raises(RuntimeError, match="kernel says no"):
        invariant.invariant_chunks(torch.randn(32, 16))
    assert invariant._probed == {}


@pytest.mark.parametrize(("m", "sizes"), [(1, (8,)), (8, (8,)), (9, (16,)), (34, (40,)), (64, (64,)),
                                          (65, (64, 8)), (112, (64, 48)), (200, (128, 64, 8)), (257, (256, 8)),
                                          (600, (256, 256, 64, 24))])
def test_a_row_count_takes_few_calls_and_pads_to_the_smallest_chunk(m: int, sizes: tuple[int, ...]) -> None:
    """What this machine's MKL allows on an AMD EPYC (every multiple of 8 rows up to 64, then
    doublings): at most one call up to 64 rows, padding below 8 rows; one chunk size alone pads to
    a multiple of it."""
    chunks = (8, *invariant.larger_calls(8, 256))
    assert chunks == (8, 16, 24, 32, 40, 48, 56, 64, 128, 256)
    assert invariant.call_sizes(m, chunks) == sizes
    assert invariant.call_sizes(m, (6,)) == (6,) * -(-m // 6)


@pytest.mark.parametrize("threads", [1, 2], indirect=True)
def test_a_target_rows_logits_are_bit_identical_in_every_batch(pipe: lantern.Pipeline, threads: int) -> None:
    """The whole network (embeddings, attention, norms, MLPs, head) of ``digits``: every row's
    logits at batch sizes 1..8 and every position equal its logits alone, bit for bit (at 2
    threads the larger elementwise ops and reductions split across threads)."""
    model = pipe.stack.network()
    assert is_batch_invariant(model) and pipe.deterministic
    gen = torch.Generator().manual_seed(3)
    labels = torch.randint(0, 10, (8,), generator=gen)
    tokens = torch.randint(0, model.config.vocab_size, (8, 20), generator=gen)
    rows = torch.cat([labels[:, None], tokens], dim=1)
    with torch.no_grad():
        assert batch_dependence(lambda r: model(r[:, 0], r[:, 1:])[0], rows, 8) == []


def test_make_batch_invariant_is_reversible_and_keeps_the_state_dict() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    keys = list(model.state_dict())
    make_batch_invariant(model)
    assert is_batch_invariant(model) and list(model.state_dict()) == keys
    make_batch_invariant(model, enabled=False)
    assert not is_batch_invariant(model) and all(type(m) is not RowChunkedLinear for m in model)


# Images decoded alone too: rows 5 and 7 of the batch of 8 (7 is in the last columns of an 8-row
# tile, where MKL's AVX2 edge code gave rows other floats) and rows 2 and 1 of batches of 3 and 2.
# An alone decode costs most of what the batch of 8 costs (deterministic mode pads a call to 8
# rows), so the other six are held to the alone codes through the two batchings instead.
ALONE = (5, 7)


def batch_differences(pipe: lantern.Pipeline, method: str) -> str | None:
    """What changes an image's codes with its batch, or None: the eight images decoded in batches
    of 3 (3 + 3 + 2: two batch sizes in one pass) and of 8, every image at another row and in
    another batch size in the two, must agree; the ``ALONE`` images decoded one at a time too."""
    by_3 = pipe(labels=LABELS, seed=SEED, method=method, batch_size=3).codes
    by_8 = pipe(labels=LABELS, seed=SEED, method=method, batch_size=8).codes
    differ = [i for i in range(len(LABELS)) if not torch.equal(by_3[i], by_8[i])]
    if differ:
        return f"{method}: images {differ} differ between batches of 3 and of 8"
    method_cfg, sampling = resolve_settings(pipe.stack, method)  # the call's own resolution and prepared method
    prepared = pipe.prepare(method_cfg, sampling)
    for i in ALONE:  # image i of the request, alone: its own seed, image_seed(SEED, i)
        alone = run_conditions(pipe.stack, pipe.parts.encode([LABELS[i]], 1, 1), SEED, sampling, method_cfg,
                               batch_size=1, prepared=prepared, indices=[i]).codes[0]
        if not torch.equal(by_8[i], alone):
            return f"{method}: image {i} alone differs from its codes in a batch"
    return None


@pytest.mark.parametrize("method", list(METHOD_TABLE))
def test_every_method_gives_each_image_its_alone_codes_in_batches_of_3_and_8(pipe: lantern.Pipeline,
                                                                             method: str) -> None:
    assert batch_differences(pipe, method) is None


def test_the_method_check_sees_a_batch_that_only_differs_from_alone(pipe: lantern.Pipeline) -> None:
    """Power: logits that change whenever a row is not alone (the same change in every batch, so
    the two batchings agree) are found by the alone decodes."""
    vocab = pipe.stack.network().config.vocab_size
    shift = torch.randn(vocab, generator=torch.Generator().manual_seed(0))
    # AR's forward at batch b has 2b rows (conditional and unconditional: classifier-free guidance)
    hook = pipe.stack.network().output.register_forward_hook(lambda _m, _a, out: out + shift * (out.shape[0] > 2))
    try:
        assert batch_differences(pipe, "ar") == "ar: image 5 alone differs from its codes in a batch"
    finally:
        hook.remove()


def test_drafters_follow_their_targets_mode(pipe: lantern.Pipeline) -> None:
    """A speculative method's drafter runs batch-invariant when its target does (its drafts
    decide tokens too)."""
    pipe(labels=[1], seed=0, method="lantern++", batch_size=1)
    assert pipe.drafter is not None and is_batch_invariant(pipe.drafter)
    default = lantern.load("digits")
    default(labels=[1], seed=0, method="lantern++", batch_size=1)
    assert not default.deterministic and default.drafter is not None and not is_batch_invariant(default.drafter)


def test_a_text_models_prompt_encoder_follows_its_targets_mode(t2i_stack: Path) -> None:
    """Captions decide a text-to-image row's tokens as much as its logits: in deterministic mode
    the T5 encoder is batch-invariant too, and a prompt's codes are the same alone and beside another."""
    pipe = lantern.load(t2i_stack, deterministic=True)
    alone = pipe(prompts=["a red square"], seed=1, method="ar", batch_size=1).codes
    beside = pipe(prompts=["a red square", "two blue circles"], seed=1, method="ar", batch_size=2).codes
    assert torch.equal(beside[0], alone[0])
    assert is_batch_invariant(pipe.parts.t5().model)
    assert not is_batch_invariant(lantern.load(t2i_stack).parts.t5().model)


def _invariance_layers() -> object:
    """benchmarks/invariance_layers.py, imported from its path (benchmarks/ is not a package)."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "invariance_layers.py"
    spec = importlib.util.spec_from_file_location("invariance_layers", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_layer_diagnostic_names_the_first_module_a_batch_changes(pipe: lantern.Pipeline) -> None:
    """benchmarks/invariance_layers.py (what a GPU session runs to find where a batch changes a row):
    in deterministic mode no module's input or output differs for image 0 alone and at row 0 of 3;
    with a planted batch-size term in layer 1's MLP it names that layer's ``w3`` first, at the
    prefill, and what follows it differs too."""
    tool: Any = _invariance_layers()
    args = argparse.Namespace(seed=SEED, method="ar")

    def run(calls: int) -> list[dict[str, Any]]:
        recorder = tool.Recorder(pipe.stack.network(), calls)
        try:
            tool._decode(pipe, recorder, LABELS[:1], args)
            alone, order = recorder.outputs, recorder.order
            tool._decode(pipe, recorder, LABELS[:3], args)
            assert recorder.call == calls and len(recorder.order) == len(order)  # stopped after `calls` forwards
            return tool.compare(alone, order, recorder.outputs)
        finally:
            recorder.remove()

    assert run(3) == []
    # registered before the recorder's hook, so the recorder sees the planted output
    planted = pipe.stack.network().layers[1].feed_forward.w3.register_forward_hook(
        lambda _module, _args, out: out + 1e-6 * out.shape[0])
    try:
        differ = run(2)
    finally:
        planted.remove()
    assert differ[0]["call"] == 0 and differ[0]["module"] == "layers.1.feed_forward.w3"
    assert {d["module"] for d in differ} >= {"layers.1.feed_forward.w2 (input)", "norm"}
