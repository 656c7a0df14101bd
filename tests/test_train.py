"""Training pipelines at micro scale: the shared loop, tokenizer, code extraction and target.

Every run here takes seconds. Exact resume is checked bit for bit: a run stopped after a
checkpoint and resumed must end with the same weights as an uninterrupted run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import image_folder
from safetensors.torch import load_file, save_file

from lantern.cli.main import main
from lantern.errors import LanternError
from lantern.models.llamagen import LlamaGen
from lantern.models.vq import VQConfig, VQModel
from lantern.train.codes import CodeSet, load_code_dir
from lantern.train.llamagen import TargetRecipe, target_config_for, train_target
from lantern.train.loop import LoopConfig, RunOptions, batch_indices, latest_checkpoint, lr_lambda
from lantern.train.tokenizer import TokenizerRecipe, psnr, train_tokenizer

TINY_VQ = dict(codebook_size=64, codebook_embed_dim=8, ch=16, ch_mult=(1, 2), z_channels=16, num_res_blocks=1,
               norm_groups=8)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return image_folder(tmp_path_factory.mktemp("images") / "imgs")


def _datasets(folder: Path):  # noqa: ANN202
    from lantern.data import load_dataset

    kw = dict(labels_file=str(folder / "labels.csv"))
    return load_dataset(str(folder), "train", **kw), load_dataset(str(folder), "test", **kw)


def _state(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


def _assert_same_weights(a: Path, b: Path) -> None:
    sa, sb = _state(a), _state(b)
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), f"{k} differs between the resumed and the uninterrupted run"


# ----------------------------------------------------------------------------------------------
# Loop helpers
# ----------------------------------------------------------------------------------------------


def test_batch_indices_cover_each_epoch_once_and_are_deterministic() -> None:
    n, bs = 10, 4
    seq = torch.cat([batch_indices(3, s, bs, n) for s in range(5)])  # 20 ids = 2 epochs
    assert sorted(seq[:10].tolist()) == list(range(10))
    assert sorted(seq[10:].tolist()) == list(range(10))
    assert not torch.equal(seq[:10], seq[10:])  # a fresh permutation each epoch
    assert torch.equal(batch_indices(3, 2, bs, n), seq[8:12])  # any step is computable on its own
    assert not torch.equal(batch_indices(4, 0, bs, n), batch_indices(3, 0, bs, n))
    # a batch larger than the data set wraps through several epochs
    assert batch_indices(0, 0, 7, 3).numel() == 7


def test_lr_schedule_warmup_then_decay_to_min() -> None:
    cfg = LoopConfig(steps=100, warmup_steps=10, lr=1.0, min_lr_ratio=0.1, schedule="cosine")
    f = lr_lambda(cfg)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    assert f(10) == pytest.approx(1.0)
    assert f(100) == pytest.approx(0.1)
    values = [f(s) for s in range(10, 101)]
    assert all(a >= b - 1e-12 for a, b in zip(values, values[1:], strict=False))
    lin = lr_lambda(LoopConfig(steps=100, warmup_steps=0, schedule="linear", min_lr_ratio=0.0))
    assert lin(50) == pytest.approx(0.5)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(steps=0), "--steps"),
        (dict(batch_size=-1), "--batch-size"),
        (dict(lr=0.0), "--lr"),
        (dict(schedule="step"), "--schedule"),
        (dict(precision="fp16"), "--precision"),
    ],
)
def test_loop_config_rejects_bad_values(kwargs: dict, match: str) -> None:
    with pytest.raises(LanternError, match=match):
        LoopConfig(**kwargs)


def test_psnr_known_values() -> None:
    x = torch.zeros(1, 1, 4, 4)
    assert psnr(x, x + 0.2)[0] == pytest.approx(10 * np.log10(1 / 0.01), rel=1e-5)  # error 0.1 in [0, 1] units


# ----------------------------------------------------------------------------------------------
# Tokenizer
# ----------------------------------------------------------------------------------------------


def _loop(**kw) -> LoopConfig:  # noqa: ANN003
    base = dict(steps=12, batch_size=4, lr=2e-3, warmup_steps=2, checkpoint_every=4, log_every=2, precision="fp32")
    base.update(kw)
    return LoopConfig(**base)


@pytest.mark.slow
def test_tokenizer_trains_loads_and_reports(folder: Path, tmp_path: Path) -> None:
    train, test = _datasets(folder)
    recipe = TokenizerRecipe(restart_every=3, eval_images=8)
    result = train_tokenizer(VQConfig(**TINY_VQ), train, test, recipe, _loop(steps=40),
                             RunOptions(tmp_path / "tok", progress=False, command="test"))
    assert result.finished
    vq = VQModel.from_pretrained(tmp_path / "tok")
    assert vq.config.codebook_size == 64
    images, _ = __import__("lantern.data", fromlist=["batch_images"]).batch_images(test, [0])
    assert vq.decode(vq.encode(images)).shape == images.shape
    m = result.metrics
    assert 0 < m["codebook_usage"] <= 1 and m["psnr"] > 12.0, m  # a constant grey image scores ~8 dB here
    prov = json.loads((tmp_path / "tok" / "provenance.json").read_text())
    assert prov["command"] == "test" and prov["data_fingerprint"] == train.fingerprint()
    assert prov["metrics"]["psnr"] == pytest.approx(m["psnr"])
    assert prov["git_commit"]
    cfg = json.loads((tmp_path / "tok" / "train_config.json").read_text())
    assert cfg["loop"]["steps"] == 40 and cfg["task"]["model"]["codebook_size"] == 64
    log = [json.loads(line) for line in (tmp_path / "tok" / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == list(range(2, 41, 2))
    assert log[-1]["recon"] < log[0]["recon"]


@pytest.mark.slow
def test_tokenizer_resume_is_exact(folder: Path, tmp_path: Path) -> None:
    train, test = _datasets(folder)
    recipe = TokenizerRecipe(restart_every=3, eval_images=4)  # restarts cross the checkpoint boundary
    cfg, loop = VQConfig(**TINY_VQ), _loop(precision="bf16")
    part = RunOptions(tmp_path / "part", progress=False)
    train_tokenizer(cfg, train, test, recipe, loop, RunOptions(tmp_path / "full", progress=False))
    stopped = train_tokenizer(cfg, train, test, recipe, loop, replace(part, stop_after=8))
    assert not stopped.finished and not (tmp_path / "part" / "model.safetensors").exists()
    assert latest_checkpoint(tmp_path / "part").name == "step-00000008"
    resumed = train_tokenizer(cfg, train, test, recipe, loop, replace(part, resume=True))
    assert resumed.resumed_from == 8 and resumed.steps_run == 4
    _assert_same_weights(tmp_path / "full", tmp_path / "part")


def test_resume_with_incompatible_config_names_the_field(folder: Path, tmp_path: Path) -> None:
    train, test = _datasets(folder)
    recipe = TokenizerRecipe(restart_every=3, eval_images=4)
    run = RunOptions(tmp_path / "r", progress=False)
    resume = replace(run, resume=True)
    train_tokenizer(VQConfig(**TINY_VQ), train, test, recipe, _loop(), replace(run, stop_after=4))
    with pytest.raises(LanternError, match=r"loop.lr: checkpoint 0.002, now 0.001"):
        train_tokenizer(VQConfig(**TINY_VQ), train, test, recipe, _loop(lr=1e-3), resume)
    other = VQConfig(**{**TINY_VQ, "codebook_size": 32})
    with pytest.raises(LanternError, match=r"task.model.codebook_size: checkpoint 64, now 32"):
        train_tokenizer(other, train, test, recipe, _loop(), resume)
    with pytest.raises(LanternError, match="already holds training checkpoints; pass --resume"):
        train_tokenizer(VQConfig(**TINY_VQ), train, test, recipe, _loop(), run)
    # checkpoint_every may change on resume: it does not change the result
    train_tokenizer(VQConfig(**TINY_VQ), train, test, recipe, _loop(checkpoint_every=6), resume)


# ----------------------------------------------------------------------------------------------
# Codes and target
# ----------------------------------------------------------------------------------------------


def _pattern_codes(n: int, classes: int = 3, length: int = 16, vocab: int = 32, seed: int = 0) -> CodeSet:
    """Class c repeats a class-specific 4-token motif with a little noise: learnable, not trivial."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.arange(n) % classes
    motifs = torch.randint(vocab, (classes, 4), generator=torch.Generator().manual_seed(99))
    codes = motifs[labels].repeat(1, length // 4)
    noise = torch.rand(codes.shape, generator=g) < 0.15
    codes[noise] = torch.randint(vocab, (int(noise.sum()),), generator=g)
    meta = {"vocab_size": vocab, "grid": 4, "num_classes": classes, "class_names": ["a", "b", "c"][:classes]}
    return CodeSet(codes, labels, meta)


def _tiny_target_config(codes: CodeSet):  # noqa: ANN202
    return target_config_for(codes, dim=32, n_layer=2, n_head=2, multiple_of=16, token_dropout_p=0.0,
                             resid_dropout_p=0.0, ffn_dropout_p=0.0)


@pytest.mark.slow
def test_target_learns_beats_unigram_and_loads(tmp_path: Path) -> None:
    train, test = _pattern_codes(96), _pattern_codes(24, seed=1)
    result = train_target(_tiny_target_config(train), train, test, TargetRecipe(class_dropout=0.1),
                          _loop(steps=120, batch_size=16, lr=3e-3, warmup_steps=10, checkpoint_every=60),
                          RunOptions(tmp_path / "t", progress=False))
    m = result.metrics
    # The unigram baseline is ~4.4 bits (11 distinct frequent tokens + noise); the motif makes most
    # tokens predictable, so a trained model must be far below it.
    assert m["unigram_bits_per_token"] > 3.5
    assert m["test_bits_per_token"] < m["unigram_bits_per_token"] - 1.5, m
    assert 0 < m["mean_top1_prob"] <= 1
    model = LlamaGen.from_pretrained(tmp_path / "t")
    assert model.config.vocab_size == 32 and model.config.block_size == 16 and model.config.num_classes == 3


def test_target_resume_is_exact_with_class_dropout(tmp_path: Path) -> None:
    train, test = _pattern_codes(40), _pattern_codes(8, seed=1)
    cfg = target_config_for(train, dim=32, n_layer=2, n_head=2, multiple_of=16)  # with dropout 0.1
    loop = _loop(steps=10, batch_size=8, checkpoint_every=3, precision="bf16")
    recipe = TargetRecipe(class_dropout=0.5)
    train_target(cfg, train, test, recipe, loop, RunOptions(tmp_path / "full", progress=False))
    train_target(cfg, train, test, recipe, loop, RunOptions(tmp_path / "part", progress=False, stop_after=6))
    train_target(cfg, train, test, recipe, loop, RunOptions(tmp_path / "part", progress=False, resume=True))
    _assert_same_weights(tmp_path / "full", tmp_path / "part")


def test_target_rejects_codes_that_do_not_fit(tmp_path: Path) -> None:
    train = _pattern_codes(8)
    cfg = target_config_for(train, dim=32, n_layer=1, n_head=2, multiple_of=16, vocab_size=16)
    with pytest.raises(LanternError, match="32-entry codebook but the model's vocab_size is 16"):
        train_target(cfg, train, train, TargetRecipe(), _loop(), RunOptions(tmp_path / "x", progress=False))
    bad = CodeSet(train.codes, train.labels + 5, train.meta)
    with pytest.raises(LanternError, match="label 5 is outside the model's 3 classes"):
        train_target(_tiny_target_config(train), bad, train, TargetRecipe(), _loop(),
                     RunOptions(tmp_path / "y", progress=False))


def test_codeset_round_trip_and_unigram(tmp_path: Path) -> None:
    s = _pattern_codes(10)
    s.save(tmp_path / "c.safetensors")
    t = CodeSet.load(tmp_path / "c.safetensors")
    assert torch.equal(t.codes, s.codes) and torch.equal(t.labels, s.labels) and t.meta == s.meta
    assert t.fingerprint() == s.fingerprint()
    uniform = CodeSet(torch.arange(32).repeat(4).reshape(8, 16), torch.zeros(8, dtype=torch.long),
                      {"vocab_size": 32})
    assert uniform.unigram_bits(uniform) == pytest.approx(5.0, abs=1e-9)  # 32 equiprobable tokens
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(LanternError, match=r"code set .*junk\.safetensors is not a readable safetensors file"):
        CodeSet.load(tmp_path / "junk.safetensors")
    save_file({"codes": s.codes.to(torch.int32)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(LanternError, match=r"other\.safetensors is not a lantern code set"):
        CodeSet.load(tmp_path / "other.safetensors")


# ----------------------------------------------------------------------------------------------
# Command line: the whole chain on a folder of images
# ----------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_cli_tokenizer_codes_target_chain(folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    common = ["--data", str(folder), "--labels-file", str(folder / "labels.csv"), "--no-progress"]
    tiny = ["--codebook-size", "64", "--ch", "16", "--ch-mult", "1,2", "--z-channels", "16", "--norm-groups", "8"]
    assert main(["train-tokenizer", *common, *tiny, "--out", str(tmp_path / "tok"), "--steps", "6",
                 "--batch-size", "4", "--eval-images", "4"]) == 0
    assert main(["extract-codes", "--tokenizer", str(tmp_path / "tok"), *common, "--out",
                 str(tmp_path / "codes")]) == 0
    train = load_code_dir(tmp_path / "codes", "train")
    test = load_code_dir(tmp_path / "codes", "test")
    assert train.codes.shape == (11, 64) and test.codes.shape == (1, 64)  # 16 px / 2 = 8x8 grid
    assert train.labels.tolist() == [i % 3 for i in range(12) if i != 9]  # image 9 is the held-out one
    vq = VQModel.from_pretrained(tmp_path / "tok")
    from lantern.data import batch_images, load_dataset

    images, _ = batch_images(load_dataset(str(folder), "test", labels_file=str(folder / "labels.csv")), [0])
    assert torch.equal(vq.encode(images), test.codes)
    assert train.meta["tokenizer_codebook_sha256"] and train.meta["num_classes"] == 3
    assert main(["train-target", "--codes", str(tmp_path / "codes"), "--out", str(tmp_path / "target"), "--dim",
                 "32", "--n-layer", "1", "--n-head", "2", "--multiple-of", "16", "--steps", "4", "--batch-size",
                 "4", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "test_bits_per_token" in out and "unigram_bits_per_token" in out
    assert LlamaGen.from_pretrained(tmp_path / "target").config.block_size == 64
    assert main(["make-drafter-data", "--target", str(tmp_path / "target"), "--codes", str(tmp_path / "codes"),
                 "--out", str(tmp_path / "ddata"), "--max-sequences", "6", "--no-progress"]) == 0
    from lantern.train.drafter import DrafterData

    data = DrafterData.load(tmp_path / "ddata" / "train")
    assert len(data) == 6 and data.hidden.shape == (6, 65, 32)
    assert main(["train-drafter", "--target", str(tmp_path / "target"), "--data", str(tmp_path / "ddata"), "--out",
                 str(tmp_path / "drafter"), "--steps", "3", "--batch-size", "2", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "top1" in out and "mean_accepted" in out
    from lantern.models.drafter import EagleDrafterModel

    assert EagleDrafterModel.from_pretrained(tmp_path / "drafter").config.hidden_size == 32
    assert main(["make-drafter-data", "--target", str(tmp_path / "target"), "--codes", str(tmp_path / "codes"),
                 "--out", str(tmp_path / "ddata2"), "--max-sequences", "0"]) == 2


def test_the_final_evaluation_is_announced(folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """The held-out evaluation after the last step has no bar (train-drafter's decodes images for
    some 20 s); with progress on, a line says what is running (a probe, 2026-11-30)."""
    tiny = ["--codebook-size", "64", "--ch", "16", "--ch-mult", "1,2", "--z-channels", "16", "--norm-groups", "8"]
    argv = ["train-tokenizer", "--data", str(folder), *tiny, "--steps", "2", "--batch-size", "4", "--eval-images", "4"]
    assert main([*argv, "--out", str(tmp_path / "a")]) == 0
    assert "lantern: evaluating the tokenizer on its held-out split\n" in capsys.readouterr().err
    assert main([*argv, "--out", str(tmp_path / "b"), "--no-progress"]) == 0
    assert "evaluating" not in capsys.readouterr().err


def test_a_warning_is_one_lantern_line(folder: Path, tmp_path: Path) -> None:
    """``--resume`` on a folder without checkpoints warns and starts at step 0; the warning read
    ``.../loop.py:498: LanternWarning: ...`` and then the source line that raised it (a probe,
    2026-11-30). From the command line it is one ``lantern: warning:`` line."""
    argv = ["-m", "lantern.cli", "train-tokenizer", "--data", str(folder), "--codebook-size", "64", "--ch", "16",
            "--ch-mult", "1,2", "--z-channels", "16", "--norm-groups", "8", "--steps", "1", "--batch-size", "4",
            "--eval-images", "2", "--no-progress", "--resume", "--out", str(tmp_path / "new")]
    res = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).resolve().parents[1])
    assert res.returncode == 0, res.stderr
    assert res.stderr == f"lantern: warning: --resume: {tmp_path / 'new'} holds no checkpoint of this run; starting " \
                         "it at step 0\n"


def test_cli_bad_inputs(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["train-tokenizer", "--data", str(tmp_path / "nope"), "--out", str(tmp_path / "o")]) == 2
    assert "nope" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["train-tokenizer", "--data", str(tmp_path / "empty"), "--out", str(tmp_path / "o")]) == 2
    assert "no .png/.jpg/.jpeg files" in capsys.readouterr().err
    # one image: nothing for the test split, refused before any step (it trained, then crashed)
    from PIL import Image

    (tmp_path / "one").mkdir()
    Image.new("RGB", (16, 16), (9, 80, 200)).save(tmp_path / "one" / "a.png")
    assert main(["train-tokenizer", "--data", str(tmp_path / "one"), "--out", str(tmp_path / "o")]) == 2
    assert "--data: the test split is empty (1 training image(s))" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
    assert main(["train-target", "--codes", str(tmp_path / "nocodes"), "--out", str(tmp_path / "o")]) == 2
    assert "extract-codes" in capsys.readouterr().err
    # a folder of something else: the flag is named (it read "code set not found: .../train.safetensors")
    assert main(["train-target", "--codes", str(tmp_path / "empty"), "--out", str(tmp_path / "o")]) == 2
    assert f"--codes: {tmp_path / 'empty'} has no train.safetensors: not a code set folder" in capsys.readouterr().err
    assert main(["extract-codes", "--tokenizer", str(tmp_path / "empty"), "--data", "digits", "--out",
                 str(tmp_path / "o")]) == 2
    assert f"--tokenizer: {tmp_path / 'empty'} has no config.json: not a VQ tokenizer" in capsys.readouterr().err
    assert not (tmp_path / "o" / "model.safetensors").exists()


@pytest.mark.slow
def test_killed_training_resumes_to_the_same_weights(folder: Path, tmp_path: Path) -> None:
    """A real SIGKILL mid-run: the last complete checkpoint is intact and resuming matches."""
    args = ["-m", "lantern.cli", "train-tokenizer", "--data", str(folder), "--codebook-size", "64", "--ch", "16",
            "--ch-mult", "1,2", "--z-channels", "16", "--norm-groups", "8", "--steps", "60", "--batch-size", "4",
            "--checkpoint-every", "5", "--eval-images", "2", "--no-progress", "--precision", "fp32"]
    env = dict(os.environ)
    cwd = Path(__file__).resolve().parents[1]
    proc = subprocess.Popen([sys.executable, *args, "--out", str(tmp_path / "killed")], env=env, cwd=cwd,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while (ckpt := latest_checkpoint(tmp_path / "killed")) is None or ckpt.name < "step-00000010":
        assert time.time() < deadline and proc.poll() is None, "training did not reach a checkpoint"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (tmp_path / "killed" / "model.safetensors").exists()
    for out, extra in (("killed", ["--resume"]), ("full", [])):
        subprocess.run([sys.executable, *args, "--out", str(tmp_path / out), *extra], env=env, cwd=cwd, check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _assert_same_weights(tmp_path / "full", tmp_path / "killed")


def test_training_on_auto_threads_follows_other_processes(folder: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """``--threads auto`` (the default): on a CPU, every 10 s of readings the trainer's intra-op
    threads follow the cores other processes leave free (here one of 2 kept busy: 1 thread), said
    in one line; ``--threads 2`` keeps 2 whatever the load."""
    import itertools

    from lantern import machine

    looks = itertools.count()

    def busy_one_core() -> machine.Reading:  # every reading 10 s after the last; others 1 CPU-s per s
        t = 10.0 * next(looks)
        return machine.Reading(wall=t, load1=1.0, cpus=2, machine_cpu=1000.0 + t, own_cpu=0.0)

    monkeypatch.setattr(machine, "read_machine", busy_one_core)
    monkeypatch.setattr(machine, "_seconds", lambda: float("inf"))  # the readings' clock decides
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # conftest's 1 would decide the count
    seen: list[int] = []
    original = torch.set_num_threads
    monkeypatch.setattr(torch, "set_num_threads", lambda n: (seen.append(n), original(n)))
    tiny = ["--codebook-size", "64", "--ch", "16", "--ch-mult", "1,2", "--z-channels", "16", "--norm-groups", "8"]
    before = torch.get_num_threads()
    original(2)
    try:
        for flag, expected in (("auto", 1), ("2", 2)):
            seen.clear()
            assert main(["train-tokenizer", "--data", str(folder), *tiny, "--out", str(tmp_path / flag), "--steps",
                         "3", "--batch-size", "4", "--eval-images", "4", "--no-progress", "--threads", flag]) == 0
            assert seen[:1] == [expected], (flag, seen)
            assert torch.get_num_threads() == 2  # given back
        assert capsys.readouterr().err.count("training on 1 thread") == 1
    finally:
        original(before)
