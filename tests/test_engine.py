"""The decode engine itself: round tracing, static shapes and padding, compilation, bf16 numerics.

Everything runs on CPU with tiny random models (compilation included: gcc builds inductor's C++
kernels). Invariants are the loop's: a row's codes never depend on its batch-mates or on how the
loop pads, and the compiled path decodes exactly what the eager path decodes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lantern.compiling import resolve_compile
from lantern.config import SamplingConfig
from lantern.errors import LanternError
from lantern.phases import phase
from lantern.pipeline import MethodConfig, prepare_method
from lantern.roundtrace import ROUND_PHASES, count_ops, trace_markdown, trace_methods
from lantern.sampling import make_generators
from lantern.stack import load_stack
from lantern.testing import make_random_stack


@pytest.fixture(scope="module")
def random_stack(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_random_stack(tmp_path_factory.mktemp("stack") / "random", seed=3, grid=4, vocab=64)


# ---- round trace ------------------------------------------------------------------------------


def test_count_ops_attributes_ops_and_syncs_to_phases() -> None:
    """Known work inside known phases: 3 syncs (item, bool, tolist) in accept, 1 nonzero in
    commit, 2 plain ops in verify; nested ops (add's internals) count once; prefill is skipped."""
    x = torch.arange(6.0)

    def run() -> None:
        with phase("prefill"):
            x.sum().item()
        with phase("verify"):
            y = x + 1
            y.mul_(2)
        with phase("accept"):
            y.max().item()
            bool(y.any())
            y.tolist()
        with phase("commit"):
            y[y > 3].sum()

    ops, syncs, cuda = count_ops(run, torch.device("cpu"))
    assert cuda is None
    assert ops["verify"] == 2
    assert syncs["accept"] == 3 and syncs["commit"] >= 1 and syncs["verify"] == 0
    assert sum(syncs.values()) == syncs["accept"] + syncs["commit"]  # nothing from prefill


def test_trace_methods_accounts_for_every_round(random_stack: Path) -> None:
    stack = load_stack(random_stack)
    sampling = SamplingConfig(temperature=1.0, top_k=8, cfg_scale=2.0)
    methods = {"ar": MethodConfig.resolve("ar"), "sd": MethodConfig.resolve("sd", "chain:3")}
    traces = trace_methods(stack, sampling, methods, [0, 1], batch_size=2)
    ar, sd = traces
    n = stack.target.config.block_size
    assert ar.tau == 1.0 and ar.rounds == n - 1  # one round per token after the prefill's
    assert sd.tau >= 1.0 and sd.rounds <= n - 1
    assert set(ar.ms) == set(ROUND_PHASES) and ar.ms["verify"] > 0 and ar.ms["drafter"] == 0
    assert sd.ms["drafter"] > 0 and sd.ops["drafter"] > 0 and ar.ops["drafter"] == 0
    assert ar.ops["verify"] > 10  # a transformer forward is many ops
    table = trace_markdown(traces)
    assert table.count("\n| ") == 2 and "| ar | - | 1.00 | 1.00 |" in table


# ---- compilation ------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_compiled_decoding_equals_eager(random_stack: Path, temperature: float) -> None:
    """AR and LANTERN (a relaxed chain: draft sampling, drafter steps, fused acceptance) decode the
    same codes compiled (fullgraph=True: a graph break would raise) as eager, for the same
    generators; a second batch reuses the graphs (static shapes: no recompilation per image)."""
    from torch._dynamo.utils import counters

    stack = load_stack(random_stack)
    sampling = SamplingConfig(temperature=temperature, top_k=8, cfg_scale=2.0)
    cond = torch.tensor([0, 1, 2])
    for method in (MethodConfig.resolve("ar"), MethodConfig.resolve("lantern", "chain:3")):
        eager = prepare_method(stack, method, sampling).generate(cond, make_generators([1, 2, 3]))
        compiled = prepare_method(stack, method, sampling, compile="default")
        first = compiled.generate(cond, make_generators([1, 2, 3]))
        graphs = counters["stats"]["unique_graphs"]
        again = compiled.generate(cond, make_generators([1, 2, 3]))
        assert counters["stats"]["unique_graphs"] == graphs
        assert torch.equal(first.codes, eager.codes) and torch.equal(again.codes, eager.codes)
        assert first.stats.mean_accepted == eager.stats.mean_accepted


def test_bad_compile_mode() -> None:
    with pytest.raises(LanternError, match="--compile must be off, auto or one of default"):
        resolve_compile("fast", "cpu")
    assert resolve_compile("auto", "cpu") == "default" and resolve_compile("off", "cpu") is None
