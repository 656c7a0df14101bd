"""One compiled region per decoding round (``lantern.decoding.compiling.round_fn``).

For every method the whole round — drafter chain or tree, verify, acceptance, residual sampling,
the commits of target and drafter and the bookkeeping — must trace as one graph with no break
(``torch._dynamo.explain``), compile with ``fullgraph=True``, and never recompile across rounds,
accepted lengths, finished rows and images. The recompilation tests compile with dynamo's
``eager`` backend: tracing and guards (what decides a recompilation) are dynamo's alone, and no
C++ is generated, so the tests stay fast; inductor itself is exercised by the tests in
tests/test_engine.py, tests/test_speculative.py and tests/test_sjd_coupled.py.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch._dynamo.utils import counters

from lantern.decoding import compiling, loop
from lantern.decoding.config import SamplingConfig
from lantern.decoding.rng import RowRandom
from lantern.decoding.sampling import make_generators
from lantern.methods import MethodConfig
from lantern.run import PreparedMethod, prepare_method
from lantern.targets.llamagen_stack import ModelStack, load_stack
from lantern.testing import make_random_stack

# method -> MethodConfig.resolve keyword arguments, sized for the 4 x 4 random stack
METHODS: dict[str, dict[str, Any]] = {
    "ar": {},
    "sd": {},  # EAGLE-2 dynamic tree
    "lantern": {},  # dynamic tree, relaxed
    "lantern++": {},  # static tree, relaxed
    "sd-static": {},
    "lantern-chain": {"tree": "chain:3"},
    "sjd": {"sjd_window": 4},
    "sjd-coupled": {"sjd_window": 4},
    "sjd-coupled-lantern": {"sjd_window": 4},
    "gsd": {"sjd_window": 4},
    "sjd-sv": {"sjd_window": 4},  # SJD-SV's run test
    "sjd-lantern-sv": {"sjd_window": 4},
    "pjd": {"pjd_window": 2, "pjd_context": 2},
}
SAMPLED = SamplingConfig(temperature=1.0, top_k=8, cfg_scale=2.0)
GREEDY = SamplingConfig(temperature=0.0, cfg_scale=2.0)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> ModelStack:
    return load_stack(make_random_stack(tmp_path_factory.mktemp("stack") / "random", seed=3, grid=4, vocab=64))


def _method(name: str) -> MethodConfig:
    kw = dict(METHODS[name])
    return MethodConfig.resolve(name.removesuffix("-chain"), tree=kw.pop("tree", None), **kw)


def _decode(prepared: PreparedMethod, labels: list[int], seeds: list[int] | None) -> loop.Decode:
    target, drafter = prepared.parts()
    device = prepared.stack.device
    rng = None if seeds is None else RowRandom.from_seeds(seeds, device)
    return loop.start_decode(target, torch.tensor(labels, device=device), rng, drafter, prepared.acceptance)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(METHODS))
def test_every_greedy_round_is_one_graph(stack: ModelStack, name: str) -> None:
    """``torch._dynamo.explain`` of a greedy round: one graph, no graph break (so no host sync:
    with dynamo's default ``capture_scalar_outputs=False`` an ``.item()`` would be a break). A
    sampled round is one graph by test_compiled_round_never_recompiles, which compiles it with
    ``fullgraph=True`` (a break is an error there)."""
    prepared = prepare_method(stack, _method(name), GREEDY)
    with torch.inference_mode():
        decode = _decode(prepared, [0, 1, 2], None)
        fn = loop._grid_round if decode.grid else loop._raster_round
        explained = torch._dynamo.explain(fn)(*decode.step_args(decode.n < prepared.stack.num_tokens))
    assert explained.graph_break_count == 0, [str(b.reason) for b in explained.break_reasons]
    assert explained.graph_count == 1
    assert explained.op_count > 50  # the forwards are in it, not only bookkeeping


@pytest.mark.slow
@pytest.mark.parametrize("name", list(METHODS))
def test_compiled_round_never_recompiles(stack: ModelStack, name: str, eager_backend: list[int]) -> None:
    """A decode compiles its round once, on the first round, as one graph (``fullgraph=True``: a
    graph break would be an error) that holds the forwards; no recompilation across rounds
    (accepted lengths and finished rows vary: three labels, rows finishing at different rounds),
    nor for a second image batch with other labels and seeds. One region call per round; the codes
    equal the eager decode's."""
    method = _method(name)
    eager = prepare_method(stack, method, SAMPLED)
    compiled = prepare_method(stack, method, SAMPLED, compile="default")
    cond = torch.tensor([0, 1, 2])
    before, calls = counters["stats"]["unique_graphs"], compiling.region_calls
    first = compiled.generate(cond, make_generators([1, 2, 3]))
    assert counters["stats"]["unique_graphs"] == before + 1
    assert len(eager_backend) == 1 and eager_backend[0] > 50  # the forwards are in it, not only bookkeeping
    assert compiling.region_calls - calls == first.stats.steps  # one region per round, nothing else
    second = compiled.generate(torch.tensor([3, 4, 5]), make_generators([7, 8, 9]))
    assert counters["stats"]["unique_graphs"] == before + 1  # the same graph: no recompilation
    assert torch.equal(first.codes, eager.generate(cond, make_generators([1, 2, 3])).codes)
    assert torch.equal(second.codes, eager.generate(torch.tensor([3, 4, 5]), make_generators([7, 8, 9])).codes)
    if name != "ar":  # rows really took different numbers of tokens per round (padding was exercised)
        assert any(len(set(step.tolist())) > 1 for step in first.stats.tokens_per_step)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["lantern", "sjd-coupled", "pjd"])  # a drafter tree, a Jacobi window, a grid
def test_compiled_rows_independent_of_batch(stack: ModelStack, name: str, eager_backend: list[int]) -> None:
    """Under the counter-based random streams and a compiled round, a row's codes are the same
    alone and inside a batch of 3 (whose other rows finish at other rounds). (LANTERN++'s static
    tree: tests/test_chameleon_compile.py; every method eager: tests/test_batch_invariance.py.)"""
    prepared = prepare_method(stack, _method(name), SAMPLED, compile="default")
    labels, seeds = [4, 5, 6], [11, 12, 13]
    batch = prepared.generate(torch.tensor(labels), make_generators(seeds))
    for i in range(3):
        alone = prepared.generate(torch.tensor(labels[i : i + 1]), make_generators(seeds[i : i + 1]))
        assert torch.equal(batch.codes[i], alone.codes[0]), i
        assert int(batch.stats.target_forwards[i]) == int(alone.stats.target_forwards[0])


@pytest.mark.slow
def test_one_compiled_round_per_fingerprint(stack: ModelStack, eager_backend: list[int]) -> None:
    """round_fn compiles a copy of the round per fingerprint of its state (guards are checked
    once per decode, not per round): the same method and batch size reuse it image after image;
    another batch size or method gets its own."""
    prepared = prepare_method(stack, _method("lantern-chain"), SAMPLED, compile="default")
    prepared.generate(torch.tensor([0]), make_generators([0]))
    copies = len(compiling._rounds)
    prepared.generate(torch.tensor([1]), make_generators([1]))
    assert len(compiling._rounds) == copies
    prepared.generate(torch.tensor([1, 2]), make_generators([1, 2]))
    assert len(compiling._rounds) == copies + 1
    prepare_method(stack, _method("sd-static"), SAMPLED, compile="default").generate(torch.tensor([1]),
                                                                                        make_generators([1]))
    assert len(compiling._rounds) == copies + 2
    assert compiling._fingerprint([torch.zeros(2, 3)], []) != compiling._fingerprint([torch.zeros(3, 2)], [])


def test_round_state_has_no_python_counters(stack: ModelStack) -> None:
    """What a round mutates is tensors (counted in place), never Python ints that dynamo would
    specialise on: the forward counters of target and drafter are device tensors."""
    prepared = prepare_method(stack, _method("lantern++"), SAMPLED)
    target, drafter = prepared.parts()
    assert isinstance(target.forwards, torch.Tensor)
    assert drafter is not None and isinstance(drafter.forwards, torch.Tensor)
    out = prepared.generate(torch.tensor([0]), make_generators([0]))
    assert out.stats.drafter_forwards > out.stats.steps  # a chain or tree: several drafter forwards per round


def test_fixed_accept_override(stack: ModelStack) -> None:
    """``Acceptance.fixed_accept`` (benchmarks only) makes every round accept exactly that many
    drafts (capped at the image's end), whatever the drafter proposed."""
    from dataclasses import replace

    prepared = prepare_method(stack, _method("lantern-chain"), SAMPLED)
    prepared.acceptance = replace(prepared.acceptance, fixed_accept=2)
    out = prepared.generate(torch.tensor([0, 1]), make_generators([0, 1]))
    n = prepared.stack.num_tokens
    steps = torch.stack(out.stats.tokens_per_step)  # [rounds, B]
    # 1 token from the prefill, then 3 per round until fewer than 3 remain
    expected = [3] * ((n - 1) // 3) + ([(n - 1) % 3] if (n - 1) % 3 else [])
    assert steps[:, 0].tolist() == expected and steps[:, 1].tolist() == expected


@pytest.mark.slow
def test_trace_counts_one_region_per_compiled_round(stack: ModelStack, eager_backend: list[int]) -> None:
    """``lantern profile --trace --compile``: ``regions_per_round`` is 1 for AR and a chain (the
    issue allows 2); eager rounds have none."""
    from lantern.eval.roundtrace import trace_markdown, trace_methods

    methods = {"ar": MethodConfig.resolve("ar"), "sd": MethodConfig.resolve("sd", tree="chain:3")}
    compiled = trace_methods(stack, SAMPLED, methods, [0, 1], batch_size=2, compile="default")
    assert [t.regions for t in compiled] == [1.0, 1.0]
    assert all(t.ms["round"] > 0 and t.ms["verify"] == 0 for t in compiled)  # the phases are inside the region
    assert "| 1.0 |" in trace_markdown(compiled)
    eager = trace_methods(stack, SAMPLED, methods, [0, 1], batch_size=2)
    assert [t.regions for t in eager] == [0.0, 0.0] and all(t.ms["verify"] > 0 for t in eager)


def test_a_compiled_regions_first_call_is_announced_once(stack: ModelStack, eager_backend: list[int]) -> None:
    """Compiling takes seconds to minutes before a decode's first tokens: within
    ``announce_compiles`` the round's first call says so, before and after (one line each); the
    same round's later calls, eager decoding, and a first call outside the block say nothing."""
    lines: list[str] = []
    compiled = prepare_method(stack, _method("lantern-chain"), SAMPLED, compile="default")
    eager = prepare_method(stack, _method("lantern-chain"), SAMPLED)
    labels = torch.tensor([0, 1])
    with compiling.announce_compiles(lines.append):
        first = compiled.generate(labels, make_generators([1, 2]))
        assert len(lines) == 2  # the announcement, then the time it took
        compiled.generate(labels, make_generators([3, 4]))  # the same region, already compiled
        eager.generate(labels, make_generators([1, 2]))
    assert first.stats.steps > 1  # several rounds ran: only the first was announced
    assert lines[0] == (f"compiling the decoding round (once per method and batch size in a process; inductor's "
                        f"kernels are cached in {compiling.compile_cache_dir()}) ...")
    assert re.fullmatch(r"compiled the decoding round in \d+\.\d s", lines[1]), lines[1]
    prepare_method(stack, _method("ar"), SAMPLED, compile="default").generate(labels, make_generators([1, 2]))
    assert len(lines) == 2  # another method's first call, outside the block: nothing


def test_the_cli_announces_a_compile_unless_told_not_to(eager_backend: list[int], tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """``lantern generate --compile``: the round's compile is a line on stderr; ``--no-progress``
    leaves it out (each run a fresh process's regions)."""
    from lantern.cli.main import main

    argv = ["generate", "--model", "digits", "--labels", "0", "--compile", "default"]
    for quiet in (False, True):
        monkeypatch.setattr(compiling, "_rounds", {})
        assert main([*argv, "--out", str(tmp_path / str(quiet)), *(["--no-progress"] if quiet else [])]) == 0
        err = capsys.readouterr().err
        announced = "lantern: compiling the decoding round (" in err
        assert announced == ("lantern: compiled the decoding round in " in err)  # both lines, or neither
        assert announced != quiet, err[-2000:]


def test_the_api_announces_a_compile_with_its_progress(eager_backend: list[int], monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """``pipe(..., progress=True)`` shows the compile's lines on stderr; ``progress=False`` (the
    default) prints nothing."""
    import lantern

    pipe = lantern.load("digits", compile="default")
    for progress in (False, True):
        monkeypatch.setattr(compiling, "_rounds", {})
        pipe(labels=[1], seed=0, method="ar", progress=progress)
        err = capsys.readouterr().err
        assert ("lantern: compiling the decoding round (" in err) == progress, err[-2000:]
        assert ("lantern: compiled the decoding round in " in err) == progress


def test_compile_cache_dir_is_lanterns(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Compiled artifacts persist under lantern's cache folder ($LANTERN_COMPILE_CACHE, else the
    user cache directory), unless the user chose inductor's folder before importing lantern."""
    import os

    monkeypatch.setenv("LANTERN_COMPILE_CACHE", str(tmp_path / "c"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/somewhere/inductor/chose")  # inductor's default, say
    monkeypatch.setattr(compiling, "_USER_CACHE_DIR", False)
    assert compiling.compile_cache_dir() == tmp_path / "c"
    compiling._use_cache_dir()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "c") and (tmp_path / "c").is_dir()
    monkeypatch.setattr(compiling, "_USER_CACHE_DIR", True)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    compiling._use_cache_dir()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")
    monkeypatch.delenv("LANTERN_COMPILE_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compiling.compile_cache_dir() == tmp_path / "xdg" / "lantern" / "compile"
