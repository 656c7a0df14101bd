"""``lantern generate`` on a Chameleon-family folder (tiny random model laid out like a download)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from lantern.cli.main import main
from lantern.errors import LanternError
from lantern.testing import make_tiny_chameleon_folder

pytest.importorskip("transformers")
pytest.importorskip("yaml")


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_chameleon_folder(tmp_path_factory.mktemp("chameleon") / "model")


def _generate(folder: Path, out: Path, *extra: str) -> int:
    return main(["generate", "--model", str(folder), "--prompt", "a red car", "--prompt", "a cat", "--out", str(out),
                 "--no-progress", "--image-size", "64", *extra])


def test_greedy_methods_agree_and_write_outputs(folder: Path, tmp_path: Path) -> None:
    """Greedy AR and greedy exact speculative decoding give the same codes through the CLI; the
    images have the VQGAN's size (4 x 4 codes x 2 px per code here) and run.json says what ran."""
    codes = {}
    for method, extra in (("ar", []), ("sd", ["--tree", "chain:3"]), ("sd-static", ["--tree", "static:mc_sim_7b_63"])):
        out = tmp_path / method
        assert _generate(folder, out, "--method", method, "--temperature", "0", *extra) == 0
        codes[method] = np.load(out / "codes.npy")
    assert codes["ar"].shape == (2, 16)
    assert (codes["sd"] == codes["ar"]).all() and (codes["sd-static"] == codes["ar"]).all()
    run = json.loads((tmp_path / "sd" / "run.json").read_text())
    assert run["layout"] == {"name": "lumina-mgpt", "height": 4, "width": 4, "pixel_size": [64, 64]}
    assert run["sampling"]["cfg_scale"] == 3.0  # from the folder's generation.json
    assert run["stats"]["drafter_forwards"] > 0
    assert Image.open(tmp_path / "sd" / "0001_prompt1.png").size == (8, 8)


def test_training_free_methods_through_the_cli(folder: Path, tmp_path: Path) -> None:
    """Coupled SJD (greedy: AR's codes) and GSD / relaxed coupled SJD (sampled) on a Lumina folder,
    whose row ends fall inside the Jacobi windows; run.json records the settings."""
    assert _generate(folder, tmp_path / "ar", "--method", "ar", "--temperature", "0") == 0
    ar = np.load(tmp_path / "ar" / "codes.npy")
    for coupling in ("maximal", "gumbel"):
        out = tmp_path / coupling
        assert _generate(folder, out, "--method", "sjd-coupled", "--sjd-window", "6", "--sjd-coupling", coupling,
                         "--temperature", "0") == 0
        assert (np.load(out / "codes.npy") == ar).all(), coupling
    for method, mode in (("gsd", "group"), ("sjd-coupled-lantern++", "relative")):
        out = tmp_path / method
        assert _generate(folder, out, "--method", method, "--sjd-window", "4", "--seed", "3") == 0
        run = json.loads((out / "run.json").read_text())
        assert run["method"]["relaxation"]["mode"] == mode and run["method"]["jacobi"]["window"] == 4
        assert np.load(out / "codes.npy").shape == (2, 16)


def test_lantern_sampled_run(folder: Path, tmp_path: Path) -> None:
    """LANTERN++ with sampling: codes in range, and a second run with the same seed is identical."""
    args = ("--method", "lantern++", "--tree", "chain:3", "--lantern-k", "4", "--lantern-lambda", "3", "--seed", "7")
    assert _generate(folder, tmp_path / "a", *args) == 0
    assert _generate(folder, tmp_path / "b", *args) == 0
    a, b = np.load(tmp_path / "a" / "codes.npy"), np.load(tmp_path / "b" / "codes.npy")
    assert (a == b).all() and a.min() >= 0 and a.max() < 16
    run = json.loads((tmp_path / "a" / "run.json").read_text())
    assert run["method"]["relaxation"]["k"] == 4 and run["method"]["relaxation"]["lam"] == 3.0


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--image-size", "100"], "multiple of 32"),
        # Lumina-mGPT's grid tokens grow with the size: past the (tiny) model's vocabulary, refused (was an IndexError)
        (["--image-size", "2048"], "--image-size 2048: the layout's token 8868 (its image size and grid) is past this "
                                   "model's vocabulary (8832 tokens)"),
        (["--image-size", "64", "--image-width", "2048"], "--image-size 64 --image-width 2048: the layout's token 8868 "
                                                          "(its image size and grid) is past this model's vocabulary"),
        (["--layout", "anole", "--image-size", "768"], "Anole generates 512 x 512"),
        (["--vq", "/nonexistent/vqgan.ckpt"], "--vq: no such file"),
        (["--t5", "/tmp"], "--t5 is not used"),
        (["--method", "sd", "--drafter", "/nonexistent"], "--drafter: no such folder /nonexistent"),
        (["--method", "sd", "--sjd-window", "auto"], "--sjd-window auto needs a --method with that window"),
    ],
)
def test_bad_input(folder: Path, tmp_path: Path, extra: list[str], message: str,
                   capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert _generate(folder, out, *extra) == 2
    assert message in capsys.readouterr().err
    assert not (out / "codes.npy").exists()


def test_released_drafter_folder(folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--drafter FOLDER`` holding a drafter in LANTERN's released layout (Chameleon config.json +
    pytorch_model.bin, recognised from its files): greedy codes equal AR's; the other release's
    drafter, and a released drafter on a LlamaGen stack, are refused with one line."""
    from lantern.models.chameleon import load_chameleon
    from lantern.models.chameleon_drafter import save_released_drafter
    from lantern.testing import make_random_stack, tiny_released_drafter

    lm = load_chameleon(folder, dtype=torch.float32)
    save_released_drafter(tiny_released_drafter(lm, "lumina-mgpt"), tmp_path / "lumina", "pytorch_model.bin")
    save_released_drafter(tiny_released_drafter(lm, "anole"), tmp_path / "anole")
    greedy = ("--temperature", "0")
    assert _generate(folder, tmp_path / "ar", "--method", "ar", *greedy) == 0
    assert _generate(folder, tmp_path / "sd", "--method", "sd", "--tree", "chain:3", "--drafter",
                     str(tmp_path / "lumina"), *greedy) == 0
    assert (np.load(tmp_path / "sd" / "codes.npy") == np.load(tmp_path / "ar" / "codes.npy")).all()
    run = json.loads((tmp_path / "sd" / "run.json").read_text())
    assert run["stats"]["drafter_forwards"] > 0
    # run.json names the drafter read and its format (the folder's own drafter/ too, which no flag names)
    assert run["drafter"] == {"path": str(tmp_path / "lumina"), "format": "LANTERN's released Chameleon drafter"}
    assert "drafter" not in json.loads((tmp_path / "ar" / "run.json").read_text())
    assert _generate(folder, tmp_path / "own", "--method", "lantern", *greedy) == 0
    run = json.loads((tmp_path / "own" / "run.json").read_text())
    assert run["drafter"] == {"path": str(folder / "drafter"), "format": "lantern EAGLE drafter"}
    assert run["proximity"] == str(folder / "proximity.safetensors")
    assert _generate(folder, tmp_path / "x", "--method", "sd", "--drafter", str(tmp_path / "anole")) == 2
    assert "Anole release's drafter (q_norm rows), the run's layout is lumina-mgpt" in capsys.readouterr().err
    stack = make_random_stack(tmp_path / "stack", grid=4)
    assert main(["generate", "--model", str(stack), "--labels", "1", "--method", "sd", "--tree", "chain:3",
                 "--drafter", str(tmp_path / "lumina"), "--out", str(tmp_path / "y"), "--no-progress"]) == 2
    assert "released Chameleon-family drafters" in capsys.readouterr().err


def test_labels_and_missing_layout(folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--model", str(folder), "--labels", "1", "--out", str(tmp_path / "o")]) == 2
    assert "pass --prompt" in capsys.readouterr().err
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in folder.iterdir():
        if f.is_file() and f.name != "generation.json":
            (bare / f.name).symlink_to(f)
    assert main(["generate", "--model", str(bare), "--prompt", "a cat", "--out", str(tmp_path / "o2")]) == 2
    assert "pass --layout" in capsys.readouterr().err


def test_layout_flags_refused_for_llamagen(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from lantern.testing import make_random_stack

    stack = make_random_stack(tmp_path / "stack", grid=2)
    assert main(["generate", "--model", str(stack), "--labels", "1", "--layout", "anole",
                 "--out", str(tmp_path / "o")]) == 2
    assert "only used with Chameleon-family models" in capsys.readouterr().err


def test_build_proximity_from_vqgan_checkpoint(folder: Path, tmp_path: Path) -> None:
    """``build-proximity --tokenizer vqgan.ckpt`` reads the release's Lightning checkpoint."""
    from lantern.models.chameleon_vq import ChameleonVQGAN
    from lantern.targets.proximity import ProximityTable

    out = tmp_path / "prox.safetensors"
    assert main(["build-proximity", "--tokenizer", str(folder / "vqgan.ckpt"), "--k-max", "5", "--out", str(out)]) == 0
    table = ProximityTable.load(out)
    codebook = ChameleonVQGAN.from_checkpoint(folder / "vqgan.ckpt").codebook()
    table.validate(codebook)
    d = torch.cdist(codebook, codebook)
    d.fill_diagonal_(float("inf"))
    assert table.neighbours[:, 0].long().tolist() == d.argmin(1).tolist()


def _prompts(n: int, seed: int) -> list[str]:
    import random

    from lantern.testing import TINY_WORDS

    rng = random.Random(seed)
    return [" ".join(rng.choice(TINY_WORDS) for _ in range(rng.randint(1, 5))) for _ in range(n)]


@pytest.mark.slow
def test_trained_drafter_beats_its_initialisation(folder: Path, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """``train-chameleon-drafter`` on self-distilled images: held-out top-1 and accept probability
    rise well above the untrained drafter's, the folder loads, and through ``generate`` it makes
    greedy speculative decoding take more tokens per forward while still giving AR's codes.
    (Measured: held-out top-1 0.06 -> 0.73, accept probability 0.38 -> 0.80, greedy tokens per
    forward 1.0 -> 2.0.)"""
    from lantern.decoding.config import SamplingConfig
    from lantern.methods import MethodConfig
    from lantern.models.chameleon import layout_by_name
    from lantern.models.drafter import EagleDrafterModel
    from lantern.run import run_conditions
    from lantern.targets.chameleon_stack import init_chameleon_drafter, load_chameleon_stack
    from lantern.train.chameleon_drafter import teacher_forced_features, teacher_forced_metrics
    from lantern.train.drafter import _FrozenHead

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(_prompts(40, 0)) + "\n")
    out = tmp_path / "drafter"
    rc = main(["train-chameleon-drafter", "--model", str(folder), "--image-size", "64", "--prompts", str(prompts),
               "--num-per-prompt", "2", "--eval-prompts", "8", "--out", str(out), "--steps", "300",
               "--batch-size", "16", "--lr", "3e-3", "--warmup-steps", "10", "--precision", "fp32",
               "--dtype", "float32", "--no-progress"])
    assert rc == 0
    report = capsys.readouterr().out
    trained_top1 = float(report.split("top1 ")[1].split(",")[0])
    # the untrained drafter on fresh held-out data
    stack = load_chameleon_stack(folder, layout_by_name("lumina-mgpt", 64), dtype=torch.float32)
    fresh = _prompts(6, 1)
    sampling = SamplingConfig(temperature=1.0, top_k=8, cfg_scale=3.0)
    codes = run_conditions(stack, stack.encode(fresh), 5, sampling, MethodConfig()).codes
    feats = teacher_forced_features(stack, stack.tokenize(fresh), codes)
    head = _FrozenHead(stack.model.image_head)
    both = torch.cat([codes, codes])
    before = teacher_forced_metrics(init_chameleon_drafter(stack.model, stack.layout), head, feats, both, 3)
    after = teacher_forced_metrics(EagleDrafterModel.from_pretrained(out), head, feats, both, 3)
    print(f"held-out top1 {before['top1']:.2f} -> {after['top1']:.2f}, "
          f"accept {before['accept_prob']:.2f} -> {after['accept_prob']:.2f}")
    assert trained_top1 > 0.6
    assert after["top1"] > before["top1"] + 0.25 and after["accept_prob"] > before["accept_prob"] + 0.2
    # through the CLI: greedy sd with the trained drafter = AR, with more tokens per forward
    runs = {}
    for method, extra in (("ar", []), ("sd", ["--tree", "chain:4", "--drafter", str(out)])):
        assert _generate(folder, tmp_path / method, "--method", method, "--temperature", "0", *extra) == 0
        runs[method] = json.loads((tmp_path / method / "run.json").read_text())["stats"]
        runs[method]["codes"] = np.load(tmp_path / method / "codes.npy")
    assert (runs["sd"]["codes"] == runs["ar"]["codes"]).all()
    print(f"greedy sd tokens/forward {runs['sd']['mean_accepted']:.2f}")
    assert runs["sd"]["mean_accepted"] > 1.5


def test_a_batch_whose_cache_cannot_fit_is_refused_before_decoding(
    folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import lantern.validate

    capsys.readouterr()
    monkeypatch.setattr(lantern.validate, "available_memory", lambda device: 1000)
    assert _generate(folder, tmp_path / "o", "--batch-size", "8") == 2
    last = capsys.readouterr().err.splitlines()[-1]  # (transformers' loading bar comes first)
    assert last.startswith("lantern: error: --batch-size: decoding 2 images together needs about")  # 2 prompts
    assert last.endswith("more than the 1000 bytes free on cpu; use a smaller --batch-size")
    assert not (tmp_path / "o").exists()


def test_training_features_are_kept_on_disk_and_removed(folder: Path, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """``train-chameleon-drafter`` keeps the teacher-forced features in files under ``--feature-dir``
    (memory-mapped, not in memory), each row the features of its image and stream (training images
    conditional then unconditional, then the held-out ones), and removes them when the run ends; a
    disk too small for them is refused in one line before any image is generated."""
    import lantern.train.chameleon_drafter as cd
    from lantern.decoding.config import SamplingConfig
    from lantern.models.chameleon import layout_by_name
    from lantern.targets.chameleon_stack import load_chameleon_stack
    from lantern.train.loop import LoopConfig, RunOptions

    stack = load_chameleon_stack(folder, layout_by_name("lumina-mgpt", 64), dtype=torch.float32)
    prompts = _prompts(5, 0)
    sampling = SamplingConfig(temperature=1.0, top_k=8, cfg_scale=3.0)
    seen: dict[str, Any] = {}

    def inspect(task: Any, loop: Any, options: Any) -> str:
        seen["task"] = task
        seen["files"] = sorted(p.name for p in (tmp_path / "feats").glob("*/*"))
        return "trained"

    monkeypatch.setattr(cd, "train", inspect)
    loop, options = LoopConfig(steps=1, batch_size=2, seed=4), RunOptions(out=tmp_path / "drafter", progress=False)
    kwargs: dict[str, Any] = dict(sampling=sampling, num_per_prompt=2, eval_prompts=1, batch_size=3,
                                  feature_dir=tmp_path / "feats")
    assert cd.train_chameleon_drafter(stack, prompts, loop, options, **kwargs) == "trained"
    task = seen["task"]
    assert seen["files"] == ["test.bf16", "train.bf16"]
    assert task.hidden.untyped_storage().filename.startswith(str(tmp_path / "feats"))
    assert list(task.hidden.shape) == [16, 3 + 16, stack.model.hidden_size] and task.test_hidden.shape[0] == 4
    assert not (tmp_path / "feats").exists()  # the temporary folder is gone, and the folder made for it
    # rows against a direct recomputation, batch by batch as the run made them: images 0..9 (8 for
    # training, 2 held out), conditional and unconditional streams
    conditions = stack.encode([p for p in prompts for _ in range(2)])
    codes = torch.cat([task.codes[:8], task.test_codes[:2]])
    cond, uncond = [], []
    for lo in range(0, 10, 3):
        h = cd.stack_features(stack, conditions.rows(lo, lo + 3), codes[lo : lo + 3], 3.0).to(torch.bfloat16)
        cond.append(h[: h.shape[0] // 2])
        uncond.append(h[h.shape[0] // 2 :])
    c, u = torch.cat(cond), torch.cat(uncond)
    assert torch.equal(task.hidden, torch.cat([c[:8], u[:8]]))
    assert torch.equal(task.test_hidden, torch.cat([c[8:], u[8:]]))
    # a disk without room: refused before self-distillation
    full = shutil.disk_usage(tmp_path)._replace(free=1000)
    monkeypatch.setattr(cd.shutil, "disk_usage", lambda path: full)
    monkeypatch.setattr(cd, "run_conditions", lambda *a, **k: pytest.fail("images were generated"))
    with pytest.raises(LanternError, match=r"^drafter training needs 0\.\d+ GB for its features in .*feats, which has "
                                           r"0\.00 GB free: pass --feature-dir on a larger disk, or fewer prompts$"):
        cd.train_chameleon_drafter(stack, prompts, loop, options, **kwargs)


def test_drafter_training_refuses_its_out_before_generating_images(folder: Path, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """``train-chameleon-drafter`` generates every training image before it trains (hours on a
    real target). Refusals that need no image come first: before, a changed-settings ``--resume``,
    a run left without ``--resume`` and an ``--out`` holding other files were refused only after
    all the images were made. A failed run also leaves no ``--feature-dir`` folder it created."""
    import lantern.train.chameleon_drafter as cd
    from lantern.decoding.config import SamplingConfig
    from lantern.models.chameleon import layout_by_name
    from lantern.targets.chameleon_stack import load_chameleon_stack
    from lantern.train.loop import LoopConfig, RunOptions

    stack = load_chameleon_stack(folder, layout_by_name("lumina-mgpt", 64), dtype=torch.float32)
    prompts, sampling = _prompts(3, 0), SamplingConfig(temperature=1.0, top_k=8, cfg_scale=3.0)
    out = tmp_path / "drafter"
    loop = LoopConfig(steps=4, batch_size=2, seed=4, checkpoint_every=1)
    kwargs: dict[str, Any] = dict(sampling=sampling, eval_prompts=1, batch_size=2)
    stopped = cd.train_chameleon_drafter(stack, prompts, loop, RunOptions(out, progress=False, stop_after=1), **kwargs)
    assert not stopped.finished and [p.name for p in (out / "checkpoints").iterdir()] == ["step-00000001"]
    monkeypatch.setattr(cd, "run_conditions", lambda *a, **k: pytest.fail("images were generated"))

    def refused(options: RunOptions, pattern: str, **extra: Any) -> None:
        with pytest.raises(LanternError, match=pattern):
            cd.train_chameleon_drafter(stack, prompts, extra.pop("loop", loop), options, **{**kwargs, **extra})

    other_lr = LoopConfig(steps=4, batch_size=2, seed=4, checkpoint_every=1, lr=1e-3)
    refused(RunOptions(out, resume=True, progress=False), r"^cannot resume from .*step-00000001: the settings "
            r"differ from the run's: loop\.lr: checkpoint .*, now 0\.001; resume with", loop=other_lr)
    refused(RunOptions(out, resume=True, progress=False), r"^cannot resume .*: task\.recipe\.",
            recipe=cd.DrafterRecipe(noise_width=0.5))
    refused(RunOptions(out, progress=False), r"^--out .*drafter already holds training checkpoints; pass --resume")
    files = tmp_path / "files"
    files.mkdir()
    (files / "notes.txt").write_text("mine")
    refused(RunOptions(files, progress=False), r"^--out .*files is not empty and holds no training run")
    # a disk without room, under a --feature-dir that did not exist: refused, and nothing is left
    full = shutil.disk_usage(tmp_path)._replace(free=1000)
    monkeypatch.setattr(cd.shutil, "disk_usage", lambda path: full)
    refused(RunOptions(tmp_path / "fresh", progress=False), r"^drafter training needs .* GB for its features",
            feature_dir=tmp_path / "a" / "b")
    assert not (tmp_path / "a").exists() and not (tmp_path / "fresh").exists()


def test_a_folders_image_size_comes_from_its_generation_json(folder: Path, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """Lumina-mGPT comes as 512, 768 and 1024 models whose weights do not say which: a folder's
    generation.json may say (before: the key was refused, and every folder decoded at 768 unless
    --image-size was passed)."""
    from lantern.api import chameleon_layout

    assert json.loads((folder / "generation.json").read_text())["image_size"] == 64
    assert main(["generate", "--model", str(folder), "--prompt", "a cat", "--out", str(tmp_path / "o"), "--no-progress",
                 "--temperature", "0"]) == 0
    assert json.loads((tmp_path / "o" / "run.json").read_text())["layout"]["pixel_size"] == [64, 64]
    assert chameleon_layout(folder, None, 96).pixel_size == (96, 96)  # the flag wins
    assert chameleon_layout(folder, "anole", None).pixel_size == (512, 512)  # the file's size is its layout's
    for size, why in ((30, "--image-size must be a positive multiple of 32, got 30"), (True, None), (0, None)):
        copy = tmp_path / f"bad{size}"
        shutil.copytree(folder, copy)
        settings = json.loads((copy / "generation.json").read_text())
        (copy / "generation.json").write_text(json.dumps({**settings, "image_size": size}))
        with pytest.raises(LanternError) as e:
            chameleon_layout(copy, None, None)
        if why is None:
            assert str(e.value) == (f"{copy / 'generation.json'}: image_size: expected a positive integer (pixels a "
                                    f"side, or the height), got {size!r}")
        else:
            assert str(e.value) == f"{copy / 'generation.json'}: image_size: 30 does not fit the lumina-mgpt layout " \
                                   f"({why})"
        if why is not None:  # a size the layout refuses is read only when no --image-size is given
            assert chameleon_layout(copy, None, 64).pixel_size == (64, 64)
    # a wide image: the file's height and width together; a flag's height alone is square; a flag's
    # width alone goes with the file's height
    wide = tmp_path / "wide"
    shutil.copytree(folder, wide)
    settings = json.loads((wide / "generation.json").read_text())
    (wide / "generation.json").write_text(json.dumps({**settings, "image_width": 128}))
    assert chameleon_layout(wide, None, None).pixel_size == (64, 128)
    assert (chameleon_layout(wide, None, None).height, chameleon_layout(wide, None, None).width) == (4, 8)
    assert chameleon_layout(wide, None, 96).pixel_size == (96, 96)
    assert chameleon_layout(wide, None, None, 32).pixel_size == (64, 32)
    (wide / "generation.json").write_text(json.dumps({**settings, "image_width": 48}))
    with pytest.raises(LanternError) as e:
        chameleon_layout(wide, None, None)
    assert str(e.value) == (f"{wide / 'generation.json'}: image_size: 64, image_width: 48 does not fit the "
                            "lumina-mgpt layout (--image-width must be a positive multiple of 32, got 48)")
    (wide / "generation.json").write_text(json.dumps({**settings, "image_width": "wide"}))
    with pytest.raises(LanternError, match=r"image_width: expected a positive integer \(pixels\), got 'wide'"):
        chameleon_layout(wide, None, None)


def test_a_default_top_k_too_large_for_the_codebook_names_where_it_came_from(
        folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A small model's codebook can be smaller than the family's top_k (Lumina-mGPT's 2000). The
    user never gave --top-k: the error names the value's origin (before: only "top_k (2000)",
    read as a flag the user had not passed). A given top_k of any valid size still runs."""
    import lantern

    copy = tmp_path / "model"
    shutil.copytree(folder, copy)
    settings = json.loads((copy / "generation.json").read_text())
    settings.pop("top_k")
    (copy / "generation.json").write_text(json.dumps(settings))
    argv = ["generate", "--model", str(copy), "--prompt", "a cat", "--out", str(tmp_path / "o"), "--no-progress"]
    assert main(argv) == 2
    assert capsys.readouterr().err == ("lantern: error: --top-k: top_k (2000, from the Chameleon-family default) is "
                                       "larger than the vocabulary (16 image tokens); give a top_k of at most 16\n")
    assert not (tmp_path / "o").exists()
    with pytest.raises(LanternError, match=r"top_k \(2000, from the Chameleon-family default\)"):
        lantern.load(copy)(prompts=["a cat"])
    (copy / "generation.json").write_text(json.dumps({**settings, "top_k": 17}))
    assert main(argv) == 2
    assert f"top_k (17, from {copy / 'generation.json'})" in capsys.readouterr().err
    assert main([*argv, "--top-k", "16"]) == 0
    assert json.loads((tmp_path / "o" / "run.json").read_text())["sampling"]["top_k"] == 16


def test_a_drafter_trained_for_the_other_layout_is_named(folder: Path, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """A drafter trained on an Anole model, given to a Lumina-mGPT run: its training record says
    so (before: "target_cls_token_num 3 (target needs 4)", a RoPE offset a user cannot act on)."""
    drafter = tmp_path / "drafter"
    shutil.copytree(folder / "drafter", drafter)
    argv = ["generate", "--model", str(folder), "--prompt", "a cat", "--out", str(tmp_path / "o"), "--no-progress",
            "--method", "lantern", "--drafter", str(drafter)]
    (drafter / "drafter_training.json").write_text(json.dumps({"layout": "lumina-mgpt"}))
    assert main(argv) == 0  # its own layout's record
    for layout, why in (("anole", "a Chameleon-family model (layout 'anole'), not for the lumina-mgpt layout of "
                                  "this run: use a drafter trained on this model (`lantern train-chameleon-drafter`), "
                                  "or pass --layout anole if this model is laid out so"),
                        ("janus", "a Janus model, not for the lumina-mgpt layout of this run: use a drafter trained "
                                  "on this model (`lantern train-chameleon-drafter`)")):
        (drafter / "drafter_training.json").write_text(json.dumps({"layout": layout}))
        assert main([*argv, "--overwrite"]) == 2
        assert capsys.readouterr().err == f"lantern: error: --drafter {drafter} was trained for {why}\n"


def test_a_drafter_and_a_model_given_in_each_others_place_are_named(folder: Path, tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """Both are Chameleon folders. A released drafter as --model was refused for a missing
    tokenizer; the model as --drafter was read whole (gigabytes) before being refused for a missing
    drafter key, or for a missing model.safetensors when sharded."""
    from lantern.models.chameleon import load_chameleon
    from lantern.models.chameleon_drafter import save_released_drafter
    from lantern.testing import tiny_released_drafter

    drafter = tmp_path / "anole_drafter"
    save_released_drafter(tiny_released_drafter(load_chameleon(folder, dtype=torch.float32), "anole"), drafter,
                          "pytorch_model.bin")
    capsys.readouterr()
    assert _generate(drafter, tmp_path / "o") == 2
    assert capsys.readouterr().err == (f"lantern: error: --model: {drafter} holds one Chameleon layer and no "
                                       "tokenizer, as LANTERN's released drafters (jadohu/anole_drafter) do: pass it "
                                       "as --drafter, and the model it drafts for as --model\n")
    assert _generate(folder, tmp_path / "o", "--method", "sd", "--drafter", str(folder)) == 2
    layers = json.loads((folder / "config.json").read_text())["num_hidden_layers"]
    assert capsys.readouterr().err == (f"lantern: error: --drafter: {folder} is a Chameleon model ({layers} layers, "
                                       "with tokenizer.json), not a drafter: pass it as --model\n")
    assert not (tmp_path / "o").exists()


def test_the_original_emu3_release_is_pointed_at_its_conversion(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "Emu3-Gen").mkdir()
    (tmp_path / "Emu3-Gen" / "config.json").write_text(json.dumps(
        {"model_type": "Emu3", "auto_map": {"AutoModelForCausalLM": "modeling_emu3.Emu3ForCausalLM"}}))
    assert _generate(tmp_path / "Emu3-Gen", tmp_path / "o") == 2
    assert capsys.readouterr().err.endswith(
        "use a transformers-native conversion of the model (BAAI/Emu3-Gen-hf, or transformers' "
        "convert_emu3_weights_to_hf.py)\n")
