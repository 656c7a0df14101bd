"""The batch-invariance, API = CLI and server-determinism tests (marker ``invariance``) again, in a
child pytest under forced AVX2 kernels: ATen's AVX2 code and MKL's AVX2 sgemm, what an AMD EPYC or
any x86 CPU without AVX-512 runs. MKL's AVX2 sgemm is where a row's floats depended on its batch
(tests/test_batch_invariance.py finds them without ``deterministic=True``), so a machine unlike the
one that wrote a test cannot be the first to fail it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).parent
FORCED_AVX2 = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "DNNL_MAX_CPU_ISA": "AVX2"}


def _env() -> dict[str, str]:
    return {**os.environ, **FORCED_AVX2}


def _skip_where_the_cpus_own_kernels_are_avx2(what: str) -> None:
    """A child under forced AVX2 repeats tests that this run already ran on the same kernels where
    the CPU has no AVX-512 (AMD EPYC): ATen, MKL, oneDNN and inductor's vector code are AVX2 there.
    ATen lowered by hand on an AVX-512 CPU may leave MKL's AVX-512 code on: the child runs."""
    import torch

    if torch.backends.cpu.get_cpu_capability() == "AVX2" and "ATEN_CPU_CAPABILITY" not in os.environ:
        pytest.skip(f"this CPU's own kernels are AVX2: {what} ran under them in this run")


def test_the_forced_kernels_are_avx2() -> None:
    """The environment really lowers ATen's kernels (else the child run below proves nothing new)."""
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())"],
                         env=_env(), capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "AVX2"


# Methods whose round is another listed method's round with other acceptance constants (λ for δ,
# coupled redraws, a run test over the same ratios): under forced AVX2 the question is whether the
# kernels' floats depend on the batch, and their kernels are those of the method they vary, so the
# child skips them in the every-method and the rows tests (~20 s each there; the native run still checks
# every method).
AVX2_SKIPPED_METHODS = ("sjd-lantern++", "sjd-coupled-lantern++", "pjd-lantern++", "sjd-coupled-lantern", "sjd-sv",
                        "sjd-coupled-sv", "sjd-coupled-lantern-sv", "gsd-sv")
EVERY_METHOD_TEST = ("tests/test_batch_invariance.py::"
                     "test_every_method_gives_each_image_its_alone_codes_in_batches_of_3_and_8")
ROWS_TEST = "tests/test_rows.py::test_rows_joining_leaving_and_moving_give_their_alone_codes"  # movable methods only


@pytest.mark.long  # ~5.5 min: the marked tests again, in one child process
def test_invariance_tests_pass_under_forced_avx2_kernels(tmp_path: Path) -> None:
    # Its own compile cache: inductor's keys do not tell forced-AVX2 artifacts from native ones, so
    # a later native test must never load what this child compiled.
    from lantern.methods import METHOD_TABLE

    _skip_where_the_cpus_own_kernels_are_avx2("the invariance tests")
    assert set(AVX2_SKIPPED_METHODS) < set(METHOD_TABLE)  # a renamed method must not silently run again
    deselect = [arg for m in AVX2_SKIPPED_METHODS for test in (EVERY_METHOD_TEST, ROWS_TEST)
                for arg in ("--deselect", f"{test}[{m}]")]
    child = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-m", "invariance and not slow", *deselect,
         str(TESTS)],
        env={**_env(), "LANTERN_COMPILE_CACHE": str(tmp_path)}, cwd=TESTS.parent, capture_output=True, text=True,
        timeout=1500,
    )
    tail = (child.stdout + child.stderr)[-3000:]
    assert child.returncode == 0, tail
    assert " passed" in tail and "deselected" in tail, tail  # the marked tests ran, not nothing


@pytest.mark.slow
def test_the_compiled_sjd_round_is_right_under_forced_avx2_kernels(tmp_path: Path) -> None:
    """torch 2.13's AVX2 vector code for the fused SJD round indexes out of bounds (the process
    aborts); lantern compiles without SIMD there (``compiling.cpu_vector_options``). The compiled
    chi-square test of coupled SJD, in a child under forced AVX2, with its own compile cache."""
    test = "tests/test_sjd_coupled.py::test_coupled_sjd_matches_target_distribution[maximal-compiled]"
    _skip_where_the_cpus_own_kernels_are_avx2(test.split("::")[1])
    child = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", test],
                           env={**_env(), "LANTERN_COMPILE_CACHE": str(tmp_path)}, cwd=TESTS.parent,
                           capture_output=True, text=True, timeout=1500)
    tail = (child.stdout + child.stderr)[-3000:]
    assert child.returncode == 0 and "1 passed" in tail, tail


def test_inductor_compiles_without_simd_on_avx2_only() -> None:
    code = "from lantern.decoding.compiling import cpu_vector_options; print(cpu_vector_options())"
    forced = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=120,
                            check=True)
    assert forced.stdout.strip() == "{'cpp.simdlen': 1}"
