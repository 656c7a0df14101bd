"""Validate before you allocate: bad counts, labels, devices, guidance and trees fail at once, in one line."""

from __future__ import annotations

import json
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch

import lantern.targets.llamagen_stack
import lantern.train.loop
import lantern.validate
from lantern.cli.main import main
from lantern.decoding.config import TreeConfig
from lantern.drafters.checks import check_tree_fits
from lantern.errors import LanternError
from lantern.testing import make_random_stack
from lantern.train.loop import RunOptions
from lantern.validate import check_batch_memory, check_device


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_random_stack(tmp_path_factory.mktemp("stack") / "random", seed=4)


def fails_with(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> str:
    """Run the CLI; assert exit 2 and exactly one stderr line ``lantern: error: ...`` containing ``message``."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("lantern: error: ") and err.count("\n") == 1, err
    assert message in err, err
    return err


@pytest.mark.parametrize("extra,message", [
    (["--labels", "99999999999999999999"], "--labels: label 99999999999999999999 is out of range"),
    (["--labels", "0,-1"], "--labels: label -1 is out of range"),
    (["--labels", "0", "--cfg-scale", "1e39"], "--cfg-scale: cfg_scale must be in [1, 100]"),
    (["--labels", "0", "--cfg-scale", "nan"], "--cfg-scale: cfg_scale must be in [1, 100]"),
    (["--labels", "0", "--temperature", "inf"], "--temperature: temperature must be >= 0"),
    (["--labels", "0,1", "--num-per-label", "1000000000000"],
     "--num-per-label / --num-per-prompt: 2 x 1000000000000 = 2000000000000 images in one run; at most 1000000"),
    (["--labels", "0", "--num-per-label", "0"], "--num-per-label / --num-per-prompt must be an integer >= 1"),
    (["--labels", "0", "--num-per-label", "-3"], "--num-per-label / --num-per-prompt must be an integer >= 1"),
    (["--labels", "0", "--batch-size", "0"], "--batch-size must be an integer >= 1"),
    (["--labels", "0", "--device", "tpu9"], "--device: unknown device 'tpu9'"),
    (["--labels", "0", "--device", "meta"], "--device: lantern runs on cpu, cuda[:N] or mps"),
    # The tree's size is checked from the flags, before the image's (old: the depth against the image).
    (["--labels", "0", "--method", "lantern++", "--tree", "chain:100000"],
     "--tree chain:100000 makes a tree of 100001 nodes per round (root included); at most 256"),
    (["--labels", "0", "--method", "lantern++", "--tree", "chain:100"],
     "tree 'chain:100' has depth 100, not less than the image's 64 tokens"),
    # Old: seed 2^63 gave seed 0's images (the per-image seeds are taken mod 2^63), -1 was taken.
    (["--labels", "0", "--seed", "9223372036854775808"], "--seed must be in [0, 2^63), got 9223372036854775808"),
    (["--labels", "0", "--seed", "-1"], "--seed must be in [0, 2^63), got -1"),
    # Old: built the subtree first (64^63 nodes: memory until an allocation failed; 1000 x 1000: ~1 min, then
    # an out-of-memory error that blamed --batch-size).
    (["--labels", "0", "--method", "sjd-pac", "--pac-width", "64", "--pac-depth", "64", "--sjd-window", "63"],
     "--pac-width 64 --pac-depth 64 (--sjd-window 63) makes a tree of 6.3e+113 nodes per round"),
    (["--labels", "0", "--method", "sjd-pac", "--pac-width", "1000"], "--pac-width must be at most 256"),
    (["--labels", "0", "--method", "sjd-pac", "--pac-width", "64"], "makes a tree of 4175 nodes"),
])
def test_generate_bad_values_fail_in_one_line_without_output(
    stack: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    out = tmp_path / "out"
    fails_with(["generate", "--model", str(stack), "--out", str(out), "--no-progress", *extra], message, capsys)
    assert not out.exists()


def test_cfg_scale_at_the_bound_still_generates(stack: Path, tmp_path: Path) -> None:
    """The bound refuses nonsense only: 100 is accepted and the codes are real tokens (not the
    all-zero codes an overflowing guidance gave)."""
    out = tmp_path / "out"
    assert main(["generate", "--model", str(stack), "--labels", "0,1", "--cfg-scale", "100", "--out", str(out),
                 "--no-progress"]) == 0
    run = json.loads((out / "run.json").read_text())
    assert run["sampling"]["cfg_scale"] == 100.0
    codes = np.load(out / "codes.npy")
    assert codes.shape == (2, 64) and len(np.unique(codes)) > 8


def test_device_cuda_without_cuda_is_one_line(
    stack: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for command in (["generate", "--model", str(stack), "--labels", "0"], ["profile", "--model", str(stack)],
                    ["bench", "--model", str(stack)]):
        fails_with([*command, "--device", "cuda", "--out", str(tmp_path / "o"), "--no-progress"],
                   "--device cuda: CUDA is not available", capsys)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(LanternError, match="cuda:3: CUDA is not available"):
        check_device("cuda:3")


def test_a_huge_batch_is_refused_before_its_cache_is_allocated(
    stack: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # The random stack's cache: 2 (k, v) x 2 layers x 64 dims x (1 + 64 + 1 + 1) slots x 4 bytes = 68.6 kB a row.
    argv = ["generate", "--model", str(stack), "--labels", "0", "--num-per-label", "200000", "--batch-size",
            "200000", "--out", str(tmp_path / "o"), "--no-progress"]
    monkeypatch.setattr(lantern.validate, "available_memory", lambda device: 8 * 2**30)
    err = fails_with(argv, "--batch-size: decoding 200000 images together needs about 12.8 GiB", capsys)
    assert "more than the 8.0 GiB free on cpu; use a smaller --batch-size" in err
    assert not (tmp_path / "o").exists()
    # The estimate counts the rows actually decoded together: 200000 images, 64 at a time, fit.
    check_batch_memory(64 * 68608, 64, torch.device("cpu"))
    with pytest.raises(LanternError, match="decoding 200000 images together"):
        check_batch_memory(200000 * 68608, 200000, torch.device("cpu"))


def test_random_stack_cache_size_assumed_above(stack: Path) -> None:
    cfg = json.loads((stack / "target" / "config.json").read_text())
    head_dim = cfg["dim"] // cfg["n_head"]
    kv_heads = cfg["n_kv_head"] or cfg["n_head"]
    assert 2 * cfg["n_layer"] * kv_heads * head_dim * (cfg["cls_token_num"] + cfg["block_size"] + 2) * 4 == 68608


def test_a_long_chain_tree_is_rejected_without_being_built() -> None:
    """``--tree chain:N`` is checked by its depth; building its N(N+1)/2 choices first took 24 GB
    for N = 100000 (here N = 3000 would take ~40 MB of Python lists)."""
    tree = TreeConfig.parse("chain:3000")
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        with pytest.raises(LanternError, match="has depth 3000, not less than the image's 64 tokens"):
            check_tree_fits(tree, 64)
        assert tree.num_nodes == 3001
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1_000_000 and time.perf_counter() - t0 < 1.0
    with pytest.raises(LanternError, match="has depth 100000"):
        check_tree_fits(TreeConfig.parse("chain:100000"), 1024)


@pytest.mark.parametrize("argv,message", [
    (["demo", "--num-images", "0"], "--num-images must be an integer >= 1, got 0"),
    (["demo", "--num-images", "-2"], "--num-images must be an integer >= 1, got -2"),
    (["demo", "--num-images", "99999999999999999999"], "--num-images must be at most 1000000"),
    (["demo", "--repeats", "0"], "--repeats must be an integer >= 1"),
    (["demo", "--batch-size", "0"], "--batch-size must be an integer >= 1"),
    (["demo", "--cfg-scale", "1e39"], "--cfg-scale: cfg_scale must be in [1, 100]"),
    (["bench", "--top-p", "0"], "--top-p: top_p must be in (0, 1]"),
    (["profile", "--temperature", "-1"], "--temperature: temperature must be >= 0"),
    (["bench", "--num-images", "0"], "--num-images must be >= 1"),
    (["bench", "--num-images", "99999999999999999999"], "--num-images must be at most 1000000"),
    (["bench", "--repeats", "10000000"], "--repeats must be at most 1000000"),
    (["profile", "--batch-size", "0"], "--batch-size must be an integer >= 1"),
    # Old: not capped (5.6 GB at 57 s), and 0 refused only once the model was loaded.
    (["profile", "--trace", "ar", "--trace-images", "1000000000"], "--trace-images must be at most 1000000"),
    (["profile", "--trace", "ar", "--trace-images", "0"], "--trace-images must be an integer >= 1, got 0"),
    # Old: --trace's errors named --methods (bench's flag), once the model was loaded.
    (["profile", "--trace", "ar,foo"], "--trace: unknown method 'foo'"),
    (["profile", "--trace", "ar,sjd/bogus=1"], "--trace 'sjd/bogus=1': expected /KEY=VALUE"),
    (["profile", "--trace", "ar,sjd-pac/width=64/depth=3"], "makes a tree of 4175 nodes"),
    # Old: the subtree was built once the model was loaded (64^63 nodes; width 100000: 10^10).
    (["bench", "--methods", "ar,sjd-pac/width=64/depth=64/window=63"], "--pac-width 64 --pac-depth 64"),
    (["bench", "--methods", "ar,sjd-pac/width=100000"], "--pac-width must be at most 256"),
    (["bench", "--methods", "ar,sjd/window=1000"], "--sjd-window 1000 makes a tree of 1001 nodes"),
    # Old: the seeds aliased mod 2^63.
    (["demo", "--seed", "9223372036854775808"], "--seed must be in [0, 2^63), got 9223372036854775808"),
    (["bench", "--seed", "-5"], "--seed must be in [0, 2^63), got -5"),
    (["profile", "--seed", "99999999999999999999"], "--seed must be in [0, 2^63)"),
])
def test_demo_bench_profile_counts_and_flags_fail_before_loading(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def load_stack(*args: object, **kwargs: object) -> None:
        raise AssertionError("loaded before the arguments were checked")

    monkeypatch.setattr(lantern.targets.llamagen_stack, "load_stack", load_stack)
    fails_with([argv[0], "--model", "digits", *argv[1:], "--out", str(tmp_path / "o"), "--no-progress"], message,
               capsys)
    assert not (tmp_path / "o").exists()


def test_train_chameleon_drafter_names_the_missing_or_wrong_folder(
    stack: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a cat\n")
    base = ["train-chameleon-drafter", "--prompts", str(prompts), "--out", str(tmp_path / "o")]
    err = fails_with([*base, "--model", str(tmp_path / "nope")], "--model: no such folder", capsys)
    assert "is a Chameleon-family model" not in err
    err = fails_with([*base, "--model", str(stack)], "is not a Chameleon-family, Janus or Emu3 model folder", capsys)
    fails_with(["extract-codes", "--tokenizer", str(tmp_path / "nope"), "--data", "digits", "--out",
                str(tmp_path / "o")], "--tokenizer: no such folder", capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prompts.txt"]


def test_training_out_is_checked_first_and_not_left_empty(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    fails_with(["train-tokenizer", "--data", str(tmp_path / "nope"), "--out", str(blocker)],
               "--out: " + str(blocker) + " exists and is not a directory", capsys)  # before the data is read
    fails_with(["train-tokenizer", "--data", str(tmp_path / "nope"), "--out", str(tmp_path / "o")],
               "--data: image folder not found", capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_a_training_run_that_fails_before_its_first_checkpoint_removes_its_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def failing(task: object, loop: object, options: RunOptions) -> None:
        out = Path(options.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "train_config.json").write_text("{}")
        if options.resume:  # a resumable run: a checkpoint exists when it fails
            (out / "checkpoints" / "step-00000002").mkdir(parents=True)
            (out / "checkpoints" / "step-00000002" / lantern.train.loop.STATE_FILE).write_text("{}")
        raise LanternError("diverged")

    monkeypatch.setattr(lantern.train.loop, "_train", failing)
    with pytest.raises(LanternError):
        lantern.train.loop.train(None, None, RunOptions(tmp_path / "fresh"))  # type: ignore[arg-type]
    assert not (tmp_path / "fresh").exists()
    with pytest.raises(LanternError):
        lantern.train.loop.train(None, None, RunOptions(tmp_path / "kept", resume=True))  # type: ignore[arg-type]
    assert (tmp_path / "kept" / "checkpoints").is_dir()  # something to --resume from: kept
    (tmp_path / "theirs").mkdir()
    with pytest.raises(LanternError):
        lantern.train.loop.train(None, None, RunOptions(tmp_path / "theirs"))  # type: ignore[arg-type]
    assert (tmp_path / "theirs").is_dir()  # not created by this run: never removed


def test_top_level_turns_os_errors_into_one_line_and_keeps_tracebacks_for_bugs(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    import lantern.cli.tools

    def refused(args: object) -> int:
        raise PermissionError(13, "Permission denied", str(tmp_path / "x"))

    monkeypatch.setattr(lantern.cli.tools, "cmd_make_random_stack", refused)
    fails_with(["make-random-stack", "--out", str(tmp_path / "s")], f"Permission denied: {tmp_path / 'x'}", capsys)

    def out_of_memory(args: object) -> int:
        raise MemoryError()

    monkeypatch.setattr(lantern.cli.tools, "cmd_make_random_stack", out_of_memory)
    fails_with(["make-random-stack", "--out", str(tmp_path / "s")], "out of memory; use a smaller --batch-size",
               capsys)

    class OutOfMemoryError(RuntimeError):  # torch.cuda.OutOfMemoryError's name and base
        pass

    def cuda_out_of_memory(args: object) -> int:
        raise OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB\nmore details")

    monkeypatch.setattr(lantern.cli.tools, "cmd_make_random_stack", cuda_out_of_memory)
    fails_with(["make-random-stack", "--out", str(tmp_path / "s")], "out of memory; use a smaller --batch-size",
               capsys)

    def bug(args: object) -> int:
        raise ZeroDivisionError("a bug in lantern")

    monkeypatch.setattr(lantern.cli.tools, "cmd_make_random_stack", bug)
    with pytest.raises(ZeroDivisionError):  # a bug is not dressed up as a user error
        main(["make-random-stack", "--out", str(tmp_path / "s")])

    def runtime_bug(args: object) -> int:
        raise RuntimeError("shape mismatch in lantern")

    monkeypatch.setattr(lantern.cli.tools, "cmd_make_random_stack", runtime_bug)
    with pytest.raises(RuntimeError, match="shape mismatch"):
        main(["make-random-stack", "--out", str(tmp_path / "s")])
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize(("argv", "line"), [
    (["--method", "lantern", "--lantern-delta", "-0.1"], "--lantern-delta: lantern_delta must be in [0, 1], got -0.1"),
    # jadohu/LANTERN's --lantern_delta 5 is LANTERN++'s lambda: the error says where it went
    (["--method", "lantern", "--lantern-delta", "5"], "--lantern-delta: lantern_delta must be in [0, 1], got 5.0 "
     "(a value above 1 was LANTERN++'s lambda in jadohu/LANTERN: use method lantern++ with lantern_lambda=5)"),
    (["--method", "lantern", "--lantern-k", "100000"],
     "--lantern-k: lantern_k (100000) exceeds the proximity table's K_max (128)"),
    (["--top-k", "5000"], "--top-k: top_k (5000) is larger than the vocabulary (1024 image tokens)"),
])
def test_a_settings_error_is_led_by_its_flag(argv: list[str], line: str, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """These checks, written once for Python and the command line, named no flag there (a probe,
    2026-11-30), while the sampling flags' errors did (``--top-p: top_p must be in (0, 1]``)."""
    from lantern.cli.main import main

    assert main(["generate", "--model", "digits", "--labels", "1", *argv, "--out", str(tmp_path / "o"),
                 "--no-progress"]) == 2
    assert capsys.readouterr().err == f"lantern: error: {line}\n"
