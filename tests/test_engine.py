"""The decode engine itself: round tracing, static shapes and padding, compilation, bf16 numerics.

Everything runs on CPU with tiny random models (compilation included: gcc builds inductor's C++
kernels). Invariants are the loop's: a row's codes never depend on its batch-mates or on how the
loop pads, and the compiled path decodes exactly what the eager path decodes.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.autograd import DeviceType

from lantern.decoding.compiling import resolve_compile
from lantern.decoding.config import SamplingConfig
from lantern.decoding.phases import phase
from lantern.decoding.sampling import make_generators
from lantern.errors import LanternError
from lantern.eval.roundtrace import ROUND_PHASES, count_ops, device_kernels, trace_markdown, trace_methods
from lantern.methods import MethodConfig
from lantern.run import prepare_method
from lantern.targets.llamagen_stack import load_stack
from lantern.testing import make_random_stack


@pytest.fixture(scope="module")
def random_stack(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_random_stack(tmp_path_factory.mktemp("stack") / "random", seed=3, grid=4, vocab=64)


# ---- round trace ------------------------------------------------------------------------------


def test_count_ops_attributes_ops_and_syncs_to_phases(capfd: pytest.CaptureFixture[str]) -> None:
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

    counts = count_ops(run, torch.device("cpu"))
    ops, syncs = counts.ops, counts.syncs
    assert counts.cuda_syncs is None and counts.cuda_kernels is None
    assert ops["verify"] == 2
    assert syncs["accept"] == 3 and syncs["commit"] >= 1 and syncs["verify"] == 0
    assert sum(syncs.values()) == syncs["accept"] + syncs["commit"]  # nothing from prefill
    assert "USDT:" not in capfd.readouterr().err  # the profiler library's start / stop lines are dropped


def test_kineto_notices_are_dropped_and_other_lines_kept(capfd: pytest.CaptureFixture[str]) -> None:
    from lantern.eval.roundtrace import _without_kineto_notices

    with _without_kineto_notices():
        os.write(2, b"USDT:2026-11-30 00:16:26 8054:8054 SyncActivityProfilerHandler.cpp:52] profiler_start\n")
        os.write(2, b"a warning of its own\n")
    assert capfd.readouterr().err == "a warning of its own\n"
    os.write(2, b"after\n")  # the descriptor is back
    assert capfd.readouterr().err == "after\n"


def test_device_kernels_are_the_device_events_that_are_not_copies() -> None:
    """What the trace counts as a GPU round's kernels (profiler events, faked here: this CPU has no
    CUDA): device events that are neither copies nor fills; the CPU-side ops never count, nor does a
    launch call made on the host."""

    def event(name: str, device: DeviceType) -> SimpleNamespace:
        return SimpleNamespace(name=name, device_type=device)

    cuda, cpu = DeviceType.CUDA, DeviceType.CPU
    events = [event("triton_poi_fused_add_0", cuda), event("void at::native::gemv<float>", cuda),
              event("Memcpy DtoH (Device -> Pinned)", cuda), event("Memset (Device)", cuda),
              event("aten::mm", cpu), event("cudaGraphLaunch", cpu), event("cudaLaunchKernel", cpu)]
    assert device_kernels(events) == 2
    assert device_kernels([]) == 0


@pytest.mark.slow
def test_trace_methods_accounts_for_every_round(random_stack: Path) -> None:
    stack = load_stack(random_stack)
    sampling = SamplingConfig(temperature=1.0, top_k=8, cfg_scale=2.0)
    methods = {"ar": MethodConfig.resolve("ar"), "sd": MethodConfig.resolve("sd", tree="chain:3")}
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


@pytest.mark.slow
def test_cli_trace_writes_its_tables(random_stack: Path, tmp_path: Path) -> None:
    """``lantern profile --trace``: the table printed is the one written, all-or-nothing into --out;
    a used --out is refused before anything is traced."""
    import json

    from lantern.cli.main import main

    out = tmp_path / "trace"
    args = ["profile", "--model", str(random_stack), "--trace", "ar,sd", "--trace-images", "1", "--no-progress",
            "--out", str(out)]
    assert main(args) == 0
    assert sorted(p.name for p in out.iterdir()) == ["trace.json", "trace.md"]
    md = (out / "trace.md").read_text()
    assert md.count("\n| ") == 2 and "| ar | - | 1.00 | 1.00 |" in md
    assert [m["method"] for m in json.loads((out / "trace.json").read_text())["methods"]] == ["ar", "sd"]
    assert main(args) == 2 and (out / "trace.md").read_text() == md


# ---- compilation ------------------------------------------------------------------------------


HAS_CXX = shutil.which("g++") is not None or shutil.which("c++") is not None or shutil.which("clang++") is not None


@pytest.mark.slow
@pytest.mark.skipif(not HAS_CXX, reason="inductor's CPU backend needs a C++ compiler")
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_compiled_decoding_equals_eager(random_stack: Path, temperature: float) -> None:
    """AR and LANTERN (a relaxed chain: drafter steps, draft sampling, fused acceptance) with the
    round compiled by inductor (fullgraph=True: a graph break would raise): one graph per method,
    reused by a second batch (static shapes: no recompilation per image or per round).

    Greedy: the codes equal eager decoding's token for token. Sampled: the same random numbers,
    but inductor's fused kernels round differently from eager ones (logits differ by ~1e-5), so
    a draw that lands that close to a top-k or CDF boundary can flip, and the row follows another
    path from there. Sampled compiled decoding is therefore checked in distribution
    (tests/test_speculative.py and tests/test_sjd_coupled.py run their chi-square tests compiled);
    here most tokens must agree (a wrong round would agree on ~1/64)."""
    from torch._dynamo.utils import counters

    stack = load_stack(random_stack)
    sampling = SamplingConfig(temperature=temperature, top_k=8, cfg_scale=2.0)
    cond = torch.tensor([0, 1, 2])
    for method in (MethodConfig.resolve("ar"), MethodConfig.resolve("lantern", tree="chain:3")):
        eager = prepare_method(stack, method, sampling).generate(cond, make_generators([1, 2, 3]))
        compiled = prepare_method(stack, method, sampling, compile="default")
        first = compiled.generate(cond, make_generators([1, 2, 3]))
        graphs = counters["stats"]["unique_graphs"]
        again = compiled.generate(cond, make_generators([1, 2, 3]))
        assert counters["stats"]["unique_graphs"] == graphs
        assert torch.equal(again.codes, first.codes)  # compiled decoding is deterministic
        if temperature == 0:
            assert torch.equal(first.codes, eager.codes)
            assert first.stats.mean_accepted == eager.stats.mean_accepted
        else:
            assert float((first.codes == eager.codes).float().mean()) > 0.75


def test_bad_compile_mode() -> None:
    with pytest.raises(LanternError, match="--compile must be off, auto or one of default"):
        resolve_compile("fast", "cpu")
    assert resolve_compile("auto", "cpu") == "default" and resolve_compile("off", "cpu") is None


# ---- static shapes: padding near the image end and for finished rows ---------------------------


@pytest.mark.parametrize("method,tree", [("lantern", "chain:6"), ("lantern++", "static:cpu_9"), ("sjd", None)])
def test_padding_never_changes_a_rows_codes(random_stack: Path, method: str, tree: str | None) -> None:
    """B = 3 rows that finish at different rounds decode exactly what each decodes alone: finished
    rows keep riding along (and drawing from their own generators), trees deeper than the
    remaining image are padded rather than shrunk, and code writes past the image land in the
    padding tail."""
    stack = load_stack(random_stack)
    sampling = SamplingConfig(temperature=1.0, top_k=8, cfg_scale=2.0)
    cfg = MethodConfig.resolve(method, tree=tree, sjd_window=6 if method == "sjd" else None)
    prepared = prepare_method(stack, cfg, sampling)
    seeds, labels = [21, 22, 23], torch.tensor([4, 5, 6])
    batch = prepared.generate(labels, make_generators(seeds))
    forwards = batch.stats.target_forwards
    assert len(set(forwards.tolist())) > 1, forwards  # the rows really finish at different rounds
    assert (batch.codes >= 0).all()
    for i, seed in enumerate(seeds):
        alone = prepared.generate(labels[i : i + 1], make_generators([seed]))
        assert torch.equal(alone.codes[0], batch.codes[i]), i
        assert int(alone.stats.target_forwards[0]) == int(forwards[i])


# ---- bf16 numerics ------------------------------------------------------------------------------


def test_bf16_keeps_float32_statistics_and_float32_argmax() -> None:
    """A bf16 copy of the trained ``digits`` target keeps its rotary table in float32 (as
    LlamaGen's ``freqs_cis``; RMSNorm statistics and logits are float32 in the forward), and its
    teacher-forced argmax agrees with float32's on >= 95 % of positions, and on every position
    where float32's top-1 / top-2 margin exceeds 0.5.

    Why these bounds: bf16 keeps 8 mantissa bits (relative rounding 2^-9 per op); through 8
    layers the logits move by up to ~0.2 (measured 0.18 here), so only near-ties can flip. On
    this model 97.3 % of positions agree and every flip had a float32 margin below 0.05; 0.5 and
    95 % leave room for other CPUs' kernels while still failing for a bf16 rotary table or a
    bf16 norm, which move logits by whole units.
    """
    import copy

    m32 = load_stack("digits", dtype=torch.float32).target.eval()
    m16 = copy.deepcopy(m32).to(torch.bfloat16)
    assert m16.freqs_cis.dtype == torch.float32 and m16.tok_embeddings.weight.dtype == torch.bfloat16
    assert torch.equal(m16.freqs_cis, m32.freqs_cis)
    gen = torch.Generator().manual_seed(0)
    labels = torch.arange(8) % m32.config.num_classes
    tokens = torch.randint(m32.config.vocab_size, (8, m32.config.block_size - 1), generator=gen)
    with torch.no_grad():
        l32, _ = m32(labels, tokens)
        l16, _ = m16(labels, tokens)
    assert l16.dtype == torch.float32  # logits leave the model in float32
    top2 = l32.topk(2, dim=-1).values
    margin = top2[..., 0] - top2[..., 1]
    agree = l32.argmax(-1) == l16.argmax(-1)
    assert agree.float().mean() >= 0.95
    assert agree[margin > 0.5].all()


@pytest.mark.parametrize("command", ["generate", "demo", "profile"])
def test_cli_bad_compile_mode_exits_2_before_writing(command: str, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    from lantern.cli.main import main

    out = tmp_path / "out"
    extra = ["--labels", "0"] if command == "generate" else []
    assert main([command, "--model", "digits", *extra, "--compile", "fast", "--out", str(out), "--no-progress"]) == 2
    assert "--compile must be off, auto or one of" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize("quiet", [True, False])
def test_compiling_raises_no_deprecation_warning_from_torch(quiet: bool) -> None:
    """Inductor's first compilation imports torch.utils.mkldnn, whose classes use the deprecated
    ``torch.jit.script_method``; ``compiled`` imports it first with that warning silenced. A fresh
    process with DeprecationWarnings as errors: the import inductor makes passes after the quiet
    import, and fails without it (power)."""
    import subprocess
    import sys

    quiet_import = "from lantern.decoding.compiling import _quiet_inductor_imports; _quiet_inductor_imports(); "
    prelude = quiet_import if quiet else ""
    code = prelude + "import torch.fx.experimental.optimization"
    proc = subprocess.run([sys.executable, "-W", "error::DeprecationWarning", "-c", code], capture_output=True,
                          text=True, cwd=Path(__file__).resolve().parents[1])
    warns = _script_method_warns()  # older torch (2.6) does not deprecate script_method: nothing to silence
    assert (proc.returncode == 0) is (quiet or not warns), proc.stderr[-500:]
    assert quiet or not warns or "torch.jit.script_method` is deprecated" in proc.stderr


def _script_method_warns() -> bool:
    """Whether this torch's ``torch.jit.script_method`` warns (DeprecationWarning) when applied."""
    import warnings

    def method(self: object) -> None:
        return None

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.jit.script_method(method)
    return any(issubclass(w.category, DeprecationWarning) for w in caught)


@pytest.mark.parametrize("quiet", [True, False])
def test_compiling_on_a_cpu_logs_nothing_about_cuda(quiet: bool, tmp_path: Path) -> None:
    """A CUDA build of torch (``pip install torch`` on Linux) on a machine with a CUDA toolkit and
    no GPU logs "No CUDA runtime is found, using CUDA_HOME=..." when inductor imports
    torch.utils.cpp_extension, so a compiled run's one-line error came second (found with torch
    2.13.0+cu130 on Python 3.13). A fresh process stands in for that build (``_is_compiled`` and
    ``version.cuda`` set, ``CUDA_HOME`` an existing folder): after ``compiled``'s quiet import,
    inductor's import logs nothing; without it the line is logged (power)."""
    import subprocess
    import sys

    fake_cuda_build = ("import torch; torch.cuda._is_compiled = lambda: True; torch.version.cuda = '13.0'; "
                       "torch.cuda.is_available = lambda: False; ")
    quiet_import = "from lantern.decoding.compiling import _quiet_inductor_imports; _quiet_inductor_imports(); "
    inductors_import = "import torch.utils.cpp_extension as c; print(c.CUDA_HOME)"
    code = fake_cuda_build + (quiet_import if quiet else "") + inductors_import
    env = {**os.environ, "CUDA_HOME": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 0 and proc.stdout.strip() == str(tmp_path), proc.stderr[-500:]  # the build was faked
    assert ("No CUDA runtime is found" in proc.stderr) is not quiet, proc.stderr[-500:]
