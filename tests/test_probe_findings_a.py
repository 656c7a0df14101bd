"""Regressions of the bad-input probe of issue 30 (findings 1, 4, 5, 7, 8, 12): each bad input ends
in one ``lantern: error:`` line naming the argument or file, exit code 2, and nothing written."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import pytest

from lantern.cli.main import main
from lantern.testing import make_random_stack, make_tiny_chameleon_folder, tiny_vq


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str], message: str) -> None:
    """``lantern argv`` exits 2 with exactly one ``lantern: error:`` line matching ``message``."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("lantern: error: ") and err.count("\n") == 1, err
    assert re.search(message, err), err


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_random_stack(tmp_path_factory.mktemp("stack") / "random", grid=2, vocab=64)


# ----------------------------------------------------------------------------------------------
# Finding 8: tracebacks on bad values
# ----------------------------------------------------------------------------------------------


def test_extract_codes_batch_size_zero(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tiny_vq(vocab=64).save_pretrained(tmp_path / "tok")
    out = tmp_path / "codes"
    _refused(["extract-codes", "--tokenizer", str(tmp_path / "tok"), "--data", "digits", "--channels", "3",
              "--num-samples", "4", "--eval-samples", "2", "--out", str(out), "--batch-size", "0", "--no-progress"],
             capsys, r"--batch-size must be an integer >= 1, got 0")
    assert not out.exists()


@pytest.mark.parametrize("value", ["2", "nan", "-0.1"])
def test_train_target_dropout_out_of_range(value: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "target"
    _refused(["train-target", "--codes", str(tmp_path / "codes"), "--out", str(out), "--dropout", value],
             capsys, rf"--dropout must be a rate in \[0, 1\), got {value}")
    assert not out.exists()


def test_llamagen_config_refuses_nan_dropout() -> None:
    from lantern.errors import LanternError
    from lantern.testing import tiny_llamagen_config

    with pytest.raises(LanternError, match=r"resid_dropout_p must be a rate in \[0, 1\], got nan"):
        tiny_llamagen_config(resid_dropout_p=float("nan"))


def test_deeply_nested_generation_json(stack: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import shutil

    model = Path(shutil.copytree(stack, tmp_path / "model"))
    (model / "generation.json").write_text("[" * 100_000 + "]" * 100_000)
    out = tmp_path / "o"
    _refused(["generate", "--model", str(model), "--labels", "0", "--out", str(out), "--no-progress"], capsys,
             rf"generation settings {re.escape(str(model / 'generation.json'))} is not usable JSON: .*nested too "
             "deeply")
    assert not out.exists()


@pytest.mark.parametrize("command", ["generate", "train-target", "build-proximity"])
def test_out_symlink_loop(command: str, stack: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    loop = tmp_path / "loop"
    loop.symlink_to(tmp_path / "loop2")
    (tmp_path / "loop2").symlink_to(loop)
    argv = {
        "generate": ["generate", "--model", str(stack), "--labels", "0", "--no-progress"],
        "train-target": ["train-target", "--codes", str(tmp_path / "codes")],
        "build-proximity": ["build-proximity", "--tokenizer", str(stack / "tokenizer")],
    }[command]
    _refused([*argv, "--out", str(loop)], capsys, rf"--out: {re.escape(str(loop))} is a symbolic link loop")
    assert loop.is_symlink() and sorted(p.name for p in tmp_path.iterdir()) == ["loop", "loop2"]


def _point_past_the_end(weights: Path) -> None:
    """Rewrite ``weights``' header so that its last tensor is twice as long: a consistent header
    whose offsets point past the end of the file (a truncated download)."""
    raw = weights.read_bytes()
    size = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + size])
    name = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][1])
    start, end = header[name]["data_offsets"]
    header[name]["shape"][0] *= 2
    header[name]["data_offsets"] = [start, end + (end - start)]
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    weights.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + size :])


@pytest.mark.slow
def test_chameleon_weights_header_past_the_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = make_tiny_chameleon_folder(tmp_path / "model")
    _point_past_the_end(model / "model.safetensors")
    capsys.readouterr()  # the folder writer's progress bars
    out = tmp_path / "o"
    _refused(["generate", "--model", str(model), "--prompt", "a cat", "--out", str(out), "--no-progress"], capsys,
             rf"--model: {re.escape(str(model / 'model.safetensors'))} is not a readable safetensors file")
    assert not out.exists()


# ----------------------------------------------------------------------------------------------
# Finding 12: unbounded numbers
# ----------------------------------------------------------------------------------------------


def test_gsd_group_at_most_the_vocabulary(stack: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "o"
    _refused(["generate", "--model", str(stack), "--labels", "0", "--method", "gsd", "--gsd-group", "1000000000000",
              "--out", str(out), "--no-progress"], capsys,
             r"--gsd-group must be at most the vocabulary size \(64 codes\), got 1000000000000")
    assert not out.exists()


@pytest.mark.parametrize("steps", ["9223372036854775808", "10000001"])
def test_train_steps_bounded(steps: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from lantern.validate import MAX_TRAIN_STEPS

    out = tmp_path / "target"
    _refused(["train-target", "--codes", str(tmp_path / "codes"), "--out", str(out), "--steps", steps], capsys,
             rf"--steps must be at most {MAX_TRAIN_STEPS:,} \(one run\), got {steps}")
    assert not out.exists()


# ----------------------------------------------------------------------------------------------
# Finding 7: a LlamaGen drafter laid out for another target
# ----------------------------------------------------------------------------------------------


def test_llamagen_drafter_of_another_grid(stack: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The probe's case the other way round (a 16-token drafter on a 4-token target, to share the
    module's stack): old lantern clamped the drafter's positions and ran with rc 0."""
    from lantern.models.drafter import DrafterConfig, EagleDrafterModel
    from lantern.models.llamagen import LlamaGen

    target = LlamaGen.from_pretrained(stack / "target").config
    drafter = tmp_path / "d16"
    EagleDrafterModel(DrafterConfig.for_target(target, block_size=16)).save_pretrained(drafter)
    out = tmp_path / "o"
    _refused(["generate", "--model", str(stack), "--labels", "0", "--method", "sd", "--tree", "chain:2",
              "--drafter", str(drafter), "--out", str(out), "--no-progress"], capsys,
             rf"drafter {re.escape(str(drafter))} does not fit this LlamaGen target: block_size 16 \(image tokens, "
             r"grid 4x4; the target has 4, grid 2x2\)")
    assert not out.exists()


def test_check_drafter_layout_names_each_mismatch() -> None:
    from lantern.drafters.checks import check_drafter_layout
    from lantern.errors import LanternError
    from lantern.models.drafter import DrafterConfig
    from lantern.testing import tiny_llamagen_config

    target = tiny_llamagen_config(block_size=64)
    check_drafter_layout(DrafterConfig.for_target(target), target, "d")  # its own drafter fits
    bad = DrafterConfig.for_target(target, block_size=16, target_cls_token_num=3)
    with pytest.raises(LanternError, match=r"drafter d does not fit .*block_size 16 \(image tokens, grid 4x4; the "
                                           r"target has 64, grid 8x8\); target_cls_token_num 3 \(the target has 1 "
                                           r"condition tokens\)"):
        check_drafter_layout(bad, target, "d")


# ----------------------------------------------------------------------------------------------
# Finding 4: --resume of a finished run; strict JSON
# ----------------------------------------------------------------------------------------------


def _tiny_tokenizer_run(folder: Path, out: Path, *extra: str) -> int:
    return main(["train-tokenizer", "--data", str(folder), "--labels-file", str(folder / "labels.csv"),
                 "--codebook-size", "16", "--ch", "8", "--ch-mult", "1,2", "--z-channels", "8", "--norm-groups", "4",
                 "--steps", "2", "--checkpoint-every", "2", "--batch-size", "2", "--eval-images", "2",
                 "--no-progress", "--precision", "fp32", "--out", str(out), *extra])


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_resume_of_a_finished_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from conftest import image_folder

    folder = image_folder(tmp_path / "imgs", n=4)
    out = tmp_path / "tok"
    assert _tiny_tokenizer_run(folder, out) == 0
    before = _snapshot(out)
    capsys.readouterr()
    assert _tiny_tokenizer_run(folder, out, "--resume") == 0
    assert capsys.readouterr().out.startswith(f"nothing to do: {out} holds a finished tokenizer run of 2 steps")
    assert _snapshot(out) == before  # provenance.json, weights and checkpoints untouched
    # Killed after its last checkpoint, before the final save: resuming runs no step, and the
    # provenance records the undefined final loss as null (strict JSON), not NaN.
    (out / "provenance.json").unlink()
    assert _tiny_tokenizer_run(folder, out, "--resume") == 0
    text = (out / "provenance.json").read_text()
    assert "NaN" not in text and json.loads(text)["metrics"]["final_train_loss"] is None


def test_write_json_is_strict(tmp_path: Path) -> None:
    from lantern.io import finite_or_null, write_json

    with pytest.raises(ValueError, match="Out of range float values are not JSON compliant"):
        write_json(tmp_path / "a.json", {"loss": float("nan")})
    assert list(tmp_path.iterdir()) == []  # nothing half-written
    write_json(tmp_path / "b.json", finite_or_null({"loss": float("nan"), "xs": [1.5, float("inf")], "n": 3}))
    assert json.loads((tmp_path / "b.json").read_text()) == {"loss": None, "xs": [1.5, None], "n": 3}


# ----------------------------------------------------------------------------------------------
# Finding 5: a full disk while writing safetensors
# ----------------------------------------------------------------------------------------------

DISK_FULL = 'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })'


def _disk_full_after(monkeypatch: pytest.MonkeyPatch, good_writes: int) -> None:
    """safetensors' writer fails, as on a full disk, after ``good_writes`` successful files."""
    import safetensors.torch
    from safetensors import SafetensorError

    real, calls = safetensors.torch.save_file, [0]

    def save_file(*args: object, **kwargs: object) -> None:
        calls[0] += 1
        if calls[0] > good_writes:
            raise SafetensorError(DISK_FULL)
        real(*args, **kwargs)

    monkeypatch.setattr(safetensors.torch, "save_file", save_file)


@pytest.mark.slow
def test_disk_full_in_a_training_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    from conftest import image_folder

    folder = image_folder(tmp_path / "imgs", n=4)
    out = tmp_path / "tok"
    _disk_full_after(monkeypatch, good_writes=1)  # the step-2 checkpoint is written, step 4's is not
    assert _tiny_tokenizer_run(folder, out, "--steps", "4") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and re.match(
        rf"lantern: error: --out: could not write checkpoint {re.escape(str(out / 'checkpoints' / 'step-00000004'))}: "
        r"No space left on device; training stopped before step 4 was saved", err), err
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00000002"]  # no .tmp-step left
    assert not (out / "model.safetensors").exists()


def test_disk_full_in_build_proximity(stack: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sub" / "table.safetensors"
    _disk_full_after(monkeypatch, good_writes=0)
    _refused(["build-proximity", "--tokenizer", str(stack / "tokenizer"), "--k-max", "8", "--out", str(out)], capsys,
             rf"--out: could not write {re.escape(str(out))}: No space left on device .*; nothing was written")
    assert not (tmp_path / "sub").exists()  # neither the file, its staging name nor the folder made for it


def test_save_safetensors_keeps_other_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import safetensors.torch
    import torch
    from safetensors import SafetensorError

    from lantern.io import save_safetensors

    def broken(*args: object, **kwargs: object) -> None:
        raise SafetensorError("some tensor is not contiguous")

    monkeypatch.setattr(safetensors.torch, "save_file", broken)
    with pytest.raises(SafetensorError, match="not contiguous"):  # a bug, not a user's disk: kept as it is
        save_safetensors({"a": torch.zeros(2)}, tmp_path / "a.safetensors")


# ----------------------------------------------------------------------------------------------
# Finding 1: CPU out of memory
# ----------------------------------------------------------------------------------------------

CPU_OOM = ("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: you tried to "
           "allocate 4000000000000 bytes. Error code 12 (Cannot allocate memory)")


def test_cpu_allocator_failure_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    import lantern.testing

    def allocate(*args: object, **kwargs: object) -> None:
        raise RuntimeError(CPU_OOM)

    monkeypatch.setattr(lantern.testing, "make_random_stack", allocate)
    out = tmp_path / "stack"
    _refused(["make-random-stack", "--out", str(out)], capsys,
             r"^lantern: error: out of memory: .*you tried to allocate 4000000000000 bytes.*; try a smaller "
             r"--batch-size")
    assert not out.exists() and list(tmp_path.iterdir()) == []  # no staging folder left either


def test_other_runtime_errors_keep_their_traceback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import lantern.testing

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

    monkeypatch.setattr(lantern.testing, "make_random_stack", broken)
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):  # a bug in lantern, not the user's memory
        main(["make-random-stack", "--out", str(tmp_path / "stack")])


@pytest.mark.parametrize(("flag", "value", "message"), [
    ("--vocab", "1000000000", r"--vocab must be in 2\.\.131072 for a random smoke-test stack, got 1000000000"),
    ("--grid", "100000", r"--grid must be in 1\.\.128 for a random smoke-test stack, got 100000"),
])
def test_make_random_stack_sizes_bounded(flag: str, value: str, message: str, tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    _refused(["make-random-stack", "--out", str(tmp_path / "stack"), flag, value], capsys, message)
    assert list(tmp_path.iterdir()) == []


def test_codebook_checked_against_free_memory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    import lantern.validate

    monkeypatch.setattr(lantern.validate, "available_memory", lambda device: 2**30)  # 1 GiB free
    _refused(["train-tokenizer", "--data", "digits", "--out", str(tmp_path / "tok"), "--codebook-size",
              "10000000000"], capsys,
             r"--codebook-size: the codebook \(with its gradient and optimiser state\) needs about 1192\.1 GiB, more "
             r"than the 1\.0 GiB of memory free on this machine; use a smaller --codebook-size")
    assert list(tmp_path.iterdir()) == []
