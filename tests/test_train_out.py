"""What a training command may write over, and what its run folder may hold (a bad-input probe of
the training commands, 2026-11-29).

Old behaviour, each asserted against below: a trainer wrote its model files into any non-empty
``--out``, an input model folder included (``train-drafter --target t --out t`` replaced the
target); the same command again over a finished run whose checkpoints were pruned retrained and
replaced it; ``extract-codes`` / ``make-drafter-data`` / ``generate`` with ``--overwrite`` and
``--out`` equal to (or a parent of) an input deleted the input; ``--resume`` of a finished run
ignored changed settings; a copied checkpoint folder (``step-N.bak``) or a tampered step broke or
misled every resume; a refusal to resume listed every difference on its own line (56 lines for a
run of another kind); a resumed run logged its steps after the checkpoint twice; ``--grad-clip
inf`` and ``--multiple-of 0`` ended in tracebacks."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch

from lantern.cli.main import main

TOKENIZER = ["--data", "digits", "--steps", "3", "--batch-size", "4", "--ch", "8", "--z-channels", "8",
             "--norm-groups", "4", "--codebook-size", "32", "--num-samples", "64", "--eval-samples", "16",
             "--eval-images", "16", "--checkpoint-every", "2", "--no-progress"]
TARGET = ["--dim", "32", "--n-layer", "1", "--n-head", "2", "--multiple-of", "16", "--batch-size", "4",
          "--no-progress"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny tokenizer, its codes, and a target trained on them (3 steps, a checkpoint at 2)."""
    root = tmp_path_factory.mktemp("runs")
    assert main(["train-tokenizer", *TOKENIZER, "--out", str(root / "tok")]) == 0
    assert main(["extract-codes", "--tokenizer", str(root / "tok"), "--data", "digits", "--num-samples", "64",
                 "--eval-samples", "16", "--out", str(root / "codes"), "--no-progress"]) == 0
    assert main(["train-target", "--codes", str(root / "codes"), *TARGET, "--steps", "3", "--checkpoint-every", "2",
                 "--out", str(root / "tgt")]) == 0
    return {"tok": root / "tok", "codes": root / "codes", "tgt": root / "tgt"}


def _digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _one_line(capsys: pytest.CaptureFixture[str], needle: str) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("lantern: error: ") and "\n" not in err and needle in err, err
    return err


def _target(codes: Path, out: Path, *extra: str) -> int:
    return main(["train-target", "--codes", str(codes), *TARGET, "--steps", "2", "--out", str(out), *extra])


def test_a_trainer_never_writes_into_a_folder_that_holds_no_run_of_its_own(
        runs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.json").write_text('{"mine": 1}')
    assert _target(runs["codes"], mine) == 2
    _one_line(capsys, f"--out {mine} is not empty and holds no training run (no train_config.json)")
    assert sorted(p.name for p in mine.iterdir()) == ["config.json"]
    # an input model folder, a training run of another kind: the drafter would replace the target
    target = tmp_path / "tgt"
    shutil.copytree(runs["tgt"], target)
    before = _digest(target)
    assert main(["make-drafter-data", "--target", str(target), "--codes", str(runs["codes"]), "--out",
                 str(tmp_path / "dd"), "--max-sequences", "16", "--max-test-sequences", "4", "--no-progress"]) == 0
    capsys.readouterr()
    assert main(["train-drafter", "--target", str(target), "--data", str(tmp_path / "dd"), "--out", str(target),
                 "--steps", "2", "--batch-size", "4", "--no-progress"]) == 2
    _one_line(capsys, f"--out {target} holds a 'target' training run, not a 'drafter' one")
    assert _digest(target) == before
    # power: an empty folder, or a new one, is trained into
    (tmp_path / "empty").mkdir()
    assert _target(runs["codes"], tmp_path / "empty") == 0
    assert (tmp_path / "empty" / "model.safetensors").is_file()


def test_a_finished_run_is_never_trained_over(runs: dict[str, Path], tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "fin"
    assert _target(runs["codes"], out) == 0  # 2 steps, under --checkpoint-every: no checkpoint is kept
    assert not (out / "checkpoints").exists() or not any((out / "checkpoints").iterdir())
    before = _digest(out)
    capsys.readouterr()
    assert _target(runs["codes"], out, "--lr", "0.5") == 2
    _one_line(capsys, f"--out {out} already holds a finished target run; train into a new --out folder")
    assert _target(runs["codes"], out, "--lr", "0.5", "--resume") == 2
    _one_line(capsys, "holds a finished target run of other settings: loop.lr: checkpoint 0.001, now 0.5")
    assert _target(runs["codes"], out, "--resume") == 0  # the same settings: nothing to do
    assert "nothing to do" in capsys.readouterr().out
    assert main(["train-tokenizer", *TOKENIZER, "--resume", "--out", str(out)]) == 2
    _one_line(capsys, "holds a 'target' training run, not a 'tokenizer' one")
    assert _digest(out) == before


@pytest.mark.parametrize("command", ["extract-codes", "make-drafter-data", "generate", "bench"])
@pytest.mark.parametrize("where", ["same", "parent"])
@pytest.mark.parametrize("spelled", ["absolute", "relative"])
def test_overwrite_never_replaces_what_the_command_reads(runs: dict[str, Path], tmp_path: Path, command: str,
                                                         where: str, spelled: str, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """Relative paths too: ``generate --model m --out m --overwrite`` compared the relative --out
    with the resolved model path, never equal, and deleted the model (a probe, 2026-11-29)."""
    parent = tmp_path / "p"
    parent.mkdir()
    read = {"extract-codes": runs["tok"], "make-drafter-data": runs["codes"], "generate": runs["tgt"],
            "bench": runs["tgt"]}[command]
    copy = parent / read.name
    shutil.copytree(read, copy)
    out = copy if where == "same" else parent
    before = _digest(parent)
    if spelled == "relative":
        monkeypatch.chdir(tmp_path)
        copy, out = copy.relative_to(tmp_path), out.relative_to(tmp_path)
    argv = {
        "extract-codes": ["extract-codes", "--tokenizer", str(copy), "--data", "digits", "--num-samples", "16",
                          "--eval-samples", "4"],
        "make-drafter-data": ["make-drafter-data", "--target", str(runs["tgt"]), "--codes", str(copy),
                              "--max-sequences", "4", "--max-test-sequences", "2"],
        "generate": ["generate", "--model", str(copy), "--labels", "0"],
        "bench": ["bench", "--model", str(copy), "--methods", "ar", "--no-quality"],
    }[command]
    assert main([*argv, "--out", str(out), "--overwrite", "--no-progress"]) == 2
    flag = {"extract-codes": "--tokenizer", "make-drafter-data": "--codes", "generate": "--model",
            "bench": "--model"}[command]
    _one_line(capsys, f"is or holds {flag} {copy}, which this command reads")
    assert _digest(tmp_path / "p") == before


@pytest.mark.parametrize("out", [".", ""])
def test_the_current_folder_is_no_output_folder(tmp_path: Path, out: str, monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """``--out .`` (or an empty --out) was refused only after the run, when the finished folder's
    rename onto the current folder failed ("Device or resource busy")."""
    monkeypatch.chdir(tmp_path)
    assert main(["generate", "--model", "digits", "--labels", "0", "--out", out, "--overwrite", "--no-progress"]) == 2
    _one_line(capsys, "is the current folder, which a finished run's rename cannot replace: name a folder")
    assert list(tmp_path.iterdir()) == []


def test_resume_reads_only_real_checkpoints_and_their_own_step(runs: dict[str, Path], tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    assert _target(runs["codes"], out, "--steps", "6", "--checkpoint-every", "2", "--log-every", "1",
                   "--stop-after", "5") == 0
    checkpoints = out / "checkpoints"
    shutil.rmtree(checkpoints / "step-00000005")  # as if killed after step 5 was logged, before its checkpoint
    latest = sorted(checkpoints.iterdir())[-1]
    assert latest.name == "step-00000004"
    shutil.copytree(latest, checkpoints / f"{latest.name}.bak")  # a user's copy: not a checkpoint
    state = latest / "trainer_state.json"
    saved = state.read_text()
    state.write_text(json.dumps({**json.loads(saved), "step": 6}))  # tampered: it would end the run at once
    capsys.readouterr()
    assert _target(runs["codes"], out, "--steps", "6", "--checkpoint-every", "2", "--log-every", "1",
                   "--resume") == 2
    _one_line(capsys, "says step 6, but the checkpoint is step-00000004")
    state.write_text(saved)
    assert _target(runs["codes"], out, "--steps", "6", "--checkpoint-every", "2", "--log-every", "1", "--lr", "0.1",
                   "--resume") == 2
    _one_line(capsys, "the settings differ from the run's: loop.lr: checkpoint 0.001, now 0.1")
    assert _target(runs["codes"], out, "--steps", "6", "--checkpoint-every", "2", "--log-every", "1",
                   "--resume") == 0
    steps = [json.loads(line)["step"] for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]  # step 5, logged before the stop, once: the resumed run logged it again


@pytest.mark.parametrize(("flags", "needle"), [
    (["--grad-clip", "inf"], "--grad-clip must be a number >= 0 (0 = off), got inf"),
    (["--weight-decay", "inf"], "--weight-decay must be a number >= 0, got inf"),
    (["--multiple-of", "0"], "multiple_of must be a positive integer, got 0"),
    (["--init-std", "-1"], "--init-std must be a positive number, got -1.0"),  # (was accepted: trained as +1)
])
def test_values_that_ended_in_a_traceback_are_one_line(runs: dict[str, Path], tmp_path: Path, flags: list[str],
                                                       needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert _target(runs["codes"], tmp_path / "x", *flags) == 2
    _one_line(capsys, needle)
    assert not (tmp_path / "x").exists()


def test_data_that_would_fill_the_memory_is_refused_by_its_flag(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """Old behaviour: ``--image-size 1000000`` grew to all of the machine's memory (killed by hand),
    a label of 99999999999 made a class list that large (killed by the kernel, no message), and
    ``--eval-samples 0`` was reported as ``num_samples``."""
    from conftest import image_folder

    folder = image_folder(tmp_path / "imgs", n=6)
    labels = folder / "labels.csv"
    base = ["train-tokenizer", "--steps", "1", "--no-progress", "--out", str(tmp_path / "out")]
    cases = [
        (["--data", "digits", "--image-size", "1000000"], "--image-size must be at most 8192 pixels, got 1000000"),
        (["--data", "digits", "--eval-samples", "0"], "--eval-samples must be an integer >= 1, got 0"),
        (["--data", str(folder), "--labels-file", str(folder)], f"labels file {folder} is a folder, not a file"),
    ]
    for argv, needle in cases:
        assert main([*base, *argv]) == 2
        _one_line(capsys, needle)
    labels.write_text(labels.read_text().replace("img00.png,0", "img00.png,99999999999"))
    assert main([*base, "--data", str(folder), "--labels-file", str(labels)]) == 2
    _one_line(capsys, "label 99999999999 is past the largest class id, 999999")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("damage", "needle"), [
    ("negative code", "holds code -1, outside its vocabulary of 32"),
    ("small vocabulary", "holds code {top}, outside its vocabulary of {top}"),  # the largest code, just outside
    ("no num_classes", "its metadata's num_classes must be a positive integer, got None"),
    ("label past the classes", "holds label 10, outside its 10 classes"),
])
def test_a_damaged_code_set_is_one_line(runs: dict[str, Path], tmp_path: Path, damage: str, needle: str,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    """Old behaviour: IndexError (a code past the vocabulary, a negative one) or KeyError
    (``num_classes``) from inside the training step."""
    from lantern.train.codes import SPLIT_FILES, CodeSet

    codes = tmp_path / "codes"
    shutil.copytree(runs["codes"], codes)
    path = codes / SPLIT_FILES["train"]
    data = CodeSet.load(path)
    top = int(data.codes.max())
    assert data.vocab_size == 32 and data.num_classes == 10  # what the cases assume
    if damage == "negative code":
        data.codes[0, 0] = -1
    elif damage == "small vocabulary":
        data.meta["vocab_size"] = top
    elif damage == "no num_classes":
        del data.meta["num_classes"]
    else:
        data.labels[0] = 10
    data.save(path)
    assert _target(codes, tmp_path / "out") == 2
    _one_line(capsys, needle.format(top=top))


@pytest.mark.parametrize(("edit", "needle"), [
    (lambda m: m.update(shards=5), "count or shards is damaged"),
    (lambda m: m["shards"][0].update(file=3), "count or shards is damaged"),
    (lambda m: m["shards"][0].pop("sha256"), "count or shards is damaged"),
    (lambda m: m["target_config"].update(dim="32"), "does not record the target config"),
])
def test_a_hand_edited_drafter_data_meta_is_one_line(runs: dict[str, Path], tmp_path: Path, edit: object,
                                                     needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Old behaviour: TypeError or KeyError from the loader."""
    data = tmp_path / "dd"
    assert main(["make-drafter-data", "--target", str(runs["tgt"]), "--codes", str(runs["codes"]), "--out", str(data),
                 "--max-sequences", "8", "--max-test-sequences", "4", "--no-progress"]) == 0
    meta = json.loads((data / "train" / "meta.json").read_text())
    edit(meta)  # type: ignore[operator]
    (data / "train" / "meta.json").write_text(json.dumps(meta))
    capsys.readouterr()
    assert main(["train-drafter", "--target", str(runs["tgt"]), "--data", str(data), "--out", str(tmp_path / "dr"),
                 "--steps", "2", "--batch-size", "4", "--no-progress"]) == 2
    _one_line(capsys, needle)


def test_more_refusals_name_what_the_user_gave(runs: dict[str, Path], tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """Old behaviour: a batch of 10^8 examples ran for minutes (killed at 300 s); a file that is no
    image was reported with Pillow's in-memory name, ``<_io.BytesIO object at 0x...>``."""
    assert _target(runs["codes"], tmp_path / "x", "--batch-size", "100000000") == 2
    _one_line(capsys, "--batch-size must be at most 65,536 (the global batch), got 100000000")
    images = tmp_path / "imgs"
    images.mkdir()
    (images / "bad.png").write_bytes(b"not a png")
    assert main(["train-tokenizer", "--data", str(images), "--steps", "1", "--no-progress",
                 "--out", str(tmp_path / "y")]) == 2
    err = _one_line(capsys, f"cannot read image {images / 'bad.png'}: cannot identify image file")
    assert "BytesIO" not in err


def test_drafter_metrics_of_no_held_out_images_are_not_a_score() -> None:
    """``train-chameleon-drafter --eval-prompts 0`` holds no image out: its metrics are NaN (null in
    provenance.json), not the 0 it reported before, which reads as a measured score."""
    import math

    import torch

    from lantern.train.chameleon_drafter import teacher_forced_metrics

    module = torch.nn.Linear(2, 2)
    metrics = teacher_forced_metrics(module, module, torch.empty(0, 3, 2), torch.empty(0, 3, dtype=torch.long), 1)
    assert set(metrics) == {"top1", "accept_prob"} and all(math.isnan(v) for v in metrics.values())


def test_resume_of_a_folder_without_a_run_says_it_starts_one(runs: dict[str, Path], tmp_path: Path) -> None:
    """A job script may always pass --resume (the first run starts fresh), but the start is said:
    before, a mistyped --out silently began a new run."""
    from lantern.io import LanternWarning

    with pytest.warns(LanternWarning, match=r"--resume: .*new holds no checkpoint of this run; starting it at step 0"):
        assert _target(runs["codes"], tmp_path / "new", "--resume") == 0
    assert (tmp_path / "new" / "model.safetensors").is_file()


def test_an_optimizer_state_of_another_model_size_is_one_line(runs: dict[str, Path], tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """A checkpoint's ``optimizer.pt`` copied from a run of another width has as many tensors as
    this run's parameters, so torch loads it; the first step then ended in a RuntimeError deep in
    AdamW. Each state tensor's shape is now checked against its parameter's when it is read."""
    ours, other = tmp_path / "ours", tmp_path / "other"
    for out, dim in ((ours, "32"), (other, "64")):
        assert _target(runs["codes"], out, "--dim", dim, "--steps", "3", "--checkpoint-every", "2",
                       "--stop-after", "2") == 0
    step = "checkpoints/step-00000002/optimizer.pt"
    shutil.copyfile(other / step, ours / step)
    capsys.readouterr()
    assert _target(runs["codes"], ours, "--steps", "3", "--checkpoint-every", "2", "--resume") == 2
    _one_line(capsys, f"optimizer state {ours / step} does not fit this run: its exp_avg of "
                      "cls_embedding.embedding_table.weight has shape (11, 64), the parameter (11, 32)")
    assert not (ours / "model.safetensors").exists()
    # power: its own optimizer state resumes
    assert _target(runs["codes"], other, "--dim", "64", "--steps", "3", "--checkpoint-every", "2", "--resume") == 0


@pytest.mark.parametrize(("part", "key", "value", "needle"), [
    ("tokenizer", "ch", "x", "VQConfig.ch must be an integer >= 1, got 'x'"),
    ("target", "dim", "x", "LlamaGen config: dim must be a positive integer, got 'x'"),
    ("drafter", "hidden_size", -3, "drafter config: hidden_size must be a positive integer"),
])
def test_a_hand_edited_model_config_names_its_file(tmp_path: Path, part: str, key: str, value: object,
                                                   needle: str) -> None:
    """A config.json edited by hand was refused as "VQConfig.ch must be ...", naming no file (of
    the three in a model folder). The refusal now starts with the file's path."""
    from lantern.errors import LanternError
    from lantern.models.drafter import EagleDrafterModel
    from lantern.models.llamagen import LlamaGen
    from lantern.models.vq import VQModel
    from lantern.targets.llamagen_stack import preset_dir

    loader = {"tokenizer": VQModel, "target": LlamaGen, "drafter": EagleDrafterModel}[part]
    folder = tmp_path / part
    shutil.copytree(preset_dir("digits") / part, folder)
    assert isinstance(loader.from_pretrained(folder), torch.nn.Module)  # power: the untouched copy loads
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, key: value}))
    with pytest.raises(LanternError) as refused:
        loader.from_pretrained(folder)
    assert str(refused.value) == f"{folder / 'config.json'}: {needle}"


def test_chameleon_drafter_refuses_out_and_eval_prompts_before_the_model_loads(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """A 7B model takes minutes to load: a wrong --out or --eval-prompts is refused first (usage.md
    promises every command checks its --out before loading; a probe, 2026-11-30, found it after)."""
    import lantern.api

    def loaded(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model was loaded before the refusal")

    monkeypatch.setattr(lantern.api, "load_model_stack", loaded)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red car\na cat\n")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    model = tmp_path / "model"  # a Chameleon folder's config alone: nothing may read further
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "chameleon"}')
    base = ["train-chameleon-drafter", "--model", str(model), "--prompts", str(prompts), "--no-progress"]
    assert main([*base, "--eval-prompts", "2", "--out", str(tmp_path / "d")]) == 2
    assert "--eval-prompts must be in [0, 2) for 2 prompts, got 2" in capsys.readouterr().err
    assert main([*base, "--out", str(mine)]) == 2
    assert f"--out {mine} is not empty and holds no training run" in capsys.readouterr().err
    assert (mine / "notes.txt").read_text() == "mine"


def test_an_interrupted_command_says_how_to_continue() -> None:
    """``lantern: interrupted`` alone left a trainer's user to find --resume (a probe, 2026-11-30)."""
    from argparse import Namespace

    from lantern.cli.generate import cmd_generate
    from lantern.cli.main import _continue_hint
    from lantern.cli.train import cmd_train_drafter

    assert _continue_hint(Namespace(func=cmd_train_drafter, out="runs/d")) == \
        " (the same command with --resume continues from the last checkpoint in runs/d)"
    assert _continue_hint(Namespace(func=cmd_generate, resume=True)) == \
        " (the same command continues the job: its recorded images are kept)"
    assert _continue_hint(Namespace(func=cmd_generate, resume=False)) == ""  # all-or-nothing: nothing to continue


@pytest.mark.parametrize("image_size", [None, 64])
def test_codes_of_another_image_size_than_the_tokenizers_get_a_note(runs: dict[str, Path], tmp_path: Path,
                                                                     image_size: int | None,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """Allowed (a VQ encodes any multiple of its downsampling, as LlamaGen's 256-pixel VQ does at
    384), but was silent: a forgotten ``--image-size`` showed only in the trained target's images."""
    size = [] if image_size is None else ["--image-size", str(image_size)]
    assert main(["extract-codes", "--tokenizer", str(runs["tok"]), "--data", "digits", "--num-samples", "8",
                 "--eval-samples", "4", *size, "--out", str(tmp_path / "c"), "--no-progress"]) == 0
    err = capsys.readouterr().err
    if image_size is None:
        assert "note" not in err
    else:
        assert "lantern: note: --tokenizer was trained on 32-pixel images; these codes are of 64-pixel images" in err
        meta = json.loads((tmp_path / "c" / "extract_config.json").read_text())
        assert meta["train"]["image_size"] == 64
