"""``lantern convert-llamagen``: official LlamaGen checkpoints (which do not say their model or
image size) become a stack folder whose model is the checkpoint's, bit for bit."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

import lantern
from lantern.cli.main import main
from lantern.errors import LanternError
from lantern.models.llamagen import GPT_CONFIGS, LlamaGen, llamagen_config, official_config, official_image_size
from lantern.models.vq import VQ_CONFIGS, VQConfig, VQModel, official_vq_config
from lantern.targets.proximity import ProximityTable, build_proximity
from lantern.testing import tiny_llamagen

# A tiny VQ as LlamaGen builds them (32 groups per GroupNorm): 3 levels = 4x downsampling.
TINY_VQ = VQConfig(codebook_size=256, codebook_embed_dim=8, z_channels=32, ch=32, ch_mult=(1, 1, 2), num_res_blocks=1)


@pytest.mark.parametrize("name", list(GPT_CONFIGS))
def test_every_llamagen_model_is_read_from_its_weights_shapes(name: str) -> None:
    """c2i at 256 and 384 px, t2i at 512: the weights' shapes give back the config exactly."""
    for overrides, size in (({}, 256), ({"block_size": 576}, 384),
                            ({"model_type": "t2i", "cls_token_num": 120, "block_size": 1024}, 512)):
        config = llamagen_config(name, **overrides)
        with torch.device("meta"):  # shapes only: no memory for the 7B
            state = LlamaGen(config).state_dict()
        assert official_config(state, size) == config, (name, overrides)
        assert official_config(state, size, gpt_model=name) == config


def test_shapes_that_differ_from_the_named_model_are_kept() -> None:
    """Fewer KV heads, another FFN width, other class and code counts: what the weights say wins
    over the named model's defaults (power: the named defaults alone would not load them)."""
    config = llamagen_config("GPT-B", n_kv_head=4, ffn_hidden=1536, num_classes=10, vocab_size=4096)
    with torch.device("meta"):
        state = LlamaGen(config).state_dict()
    read = official_config(state, 256)
    assert (read.kv_heads, read.hidden_ffn, read.num_classes, read.vocab_size) == (4, 1536, 10, 4096)
    assert read.hidden_ffn != llamagen_config("GPT-B").hidden_ffn
    with pytest.raises(LanternError, match=r"its weights have width 768 and 12 layers, GPT-L has 1024 and 24"):
        official_config(state, 256, gpt_model="GPT-L")
    with pytest.raises(LanternError, match=r"width 64, 2 layers\) are none of LlamaGen's models"):
        official_config(tiny_llamagen().state_dict(), 32)
    with pytest.raises(LanternError, match=r"image size 250 is not a positive multiple of the VQ's downsampling"):
        official_config(state, 250)


@pytest.mark.parametrize("name", list(VQ_CONFIGS))
def test_the_vq_config_is_read_from_its_weights(name: str) -> None:
    with torch.device("meta"):
        assert official_vq_config(VQModel(VQ_CONFIGS[name]).state_dict()) == VQ_CONFIGS[name]
    assert official_vq_config(VQModel(TINY_VQ).state_dict()) == TINY_VQ
    with pytest.raises(LanternError, match=r"has no quantize.embedding.weight: not LlamaGen VQ weights"):
        official_vq_config(tiny_llamagen().state_dict(), "VQ checkpoint x.pt")


def test_the_image_size_comes_from_training_args_then_the_file_name(tmp_path: Path) -> None:
    assert official_image_size(Path("c2i_L_384.pt")) == 384
    assert official_image_size(Path("t2i_XL_stage1_256.pt")) == 256
    assert official_image_size(Path("c2i_XXL_384.pt"), argparse.Namespace(image_size=256)) == 256  # args win
    with pytest.raises(LanternError, match=r"0655000.pt: the image size is not in the file .* give it"):
        official_image_size(Path("results/003-GPT-XL/checkpoints/0655000.pt"))


@pytest.fixture
def tiny_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tiny named model, so that a whole conversion runs in a test (the real ones are 0.1-7B)."""
    monkeypatch.setitem(GPT_CONFIGS, "GPT-T", {"n_layer": 2, "n_head": 4, "dim": 64})


def _official_files(folder: Path, target: LlamaGen, vq: VQModel, gpt_name: str, **args: object) -> tuple[Path, Path]:
    """Files laid out as LlamaGen's training writes them: weights under 'model', its args beside."""
    folder.mkdir(parents=True, exist_ok=True)
    gpt, tok = folder / gpt_name, folder / "vq_ds4_c2i.pt"
    state = {f"_orig_mod.{k}": v for k, v in target.state_dict().items()}  # a compiled model's keys
    torch.save({"model": state, "optimizer": {}, "steps": 10, **({"args": argparse.Namespace(**args)} if args else {})},
               gpt)
    torch.save({"model": vq.state_dict(), "optimizer": {}}, tok)
    return gpt, tok


def test_a_converted_stack_decodes_as_the_checkpoints_model(tiny_named: None, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    torch.manual_seed(0)
    target, vq = tiny_llamagen(seed=1), VQModel(TINY_VQ).eval()
    gpt, tok = _official_files(tmp_path / "dl", target, vq, "c2i_T.pt", image_size=32, gpt_model="GPT-T")
    out = tmp_path / "stack"
    assert main(["convert-llamagen", "--gpt-ckpt", str(gpt), "--vq-ckpt", str(tok), "--out", str(out),
                 "--no-progress"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == (f"wrote {out}: GPT-T c2i at 32 px (64 image tokens), "
                                                        "custom tokenizer")
    converted = LlamaGen.from_pretrained(out / "target")
    assert (converted.config.block_size, converted.config.num_classes, converted.config.vocab_size) == (64, 10, 256)
    for k, v in target.state_dict().items():
        assert torch.equal(converted.state_dict()[k], v), k
    # LlamaGen's sampling defaults; top_k 2000 keeps a 256-code book whole, so it says 256
    assert json.loads((out / "generation.json").read_text()) == {"cfg_scale": 4.0, "top_k": 256, "temperature": 1.0,
                                                                 "top_p": 1.0}
    provenance = json.loads((out / "provenance.json").read_text())
    assert (provenance["gpt_model"], provenance["image_size"], provenance["gpt_ckpt"]["file"]) == ("GPT-T", 32,
                                                                                                   "c2i_T.pt")
    table = ProximityTable.load(out / "proximity.safetensors")
    built = build_proximity(vq.quantize.embedding.weight, 255)
    assert torch.equal(table.neighbours, built.neighbours) and table.codebook_sha256 == built.codebook_sha256

    # The same model saved by hand decodes the same codes: greedy and sampled, exact and relaxed
    # (sjd-coupled-lantern reads the proximity table).
    by_hand = tmp_path / "by_hand"
    target.save_pretrained(by_hand / "target")
    vq.save_pretrained(by_hand / "tokenizer")
    a, b = lantern.load(out), lantern.load(by_hand, proximity=out / "proximity.safetensors")
    for settings in ({"method": "ar", "temperature": 0.0, "cfg_scale": 4.0},
                     {"method": "sjd-coupled", "top_k": 50, "cfg_scale": 2.0},
                     {"method": "sjd-coupled-lantern", "top_k": 0, "cfg_scale": 1.0}):
        assert torch.equal(a(labels=[1, 7], seed=3, **settings).codes, b(labels=[1, 7], seed=3, **settings).codes)
    # Without a cfg_scale it samples with LlamaGen's defaults, the hand-saved stack with lantern's.
    assert a(labels=[1], seed=3).config["sampling"]["cfg_scale"] == 4.0


def test_a_text_to_image_checkpoint_and_what_the_flags_override(tiny_named: None, tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    torch.manual_seed(0)
    target = tiny_llamagen(seed=2, model_type="t2i", cls_token_num=8, caption_dim=16, block_size=256)
    gpt, tok = _official_files(tmp_path / "dl", target, VQModel(TINY_VQ).eval(), "t2i_T_stage1_256.pt")
    out = tmp_path / "stack"
    # No args in the file: the image size is its name's (256 px: 64 x 64 codes with this 4x VQ) ...
    argv = ["convert-llamagen", "--gpt-ckpt", str(gpt), "--vq-ckpt", str(tok), "--out", str(out), "--no-progress",
            "--no-proximity"]
    assert main(argv) == 0
    assert f"wrote {out}: GPT-T t2i at 256 px (4096 image tokens)" in capsys.readouterr().out
    assert LlamaGen.from_pretrained(out / "target").config.block_size == 4096
    # ... unless given (the weights cannot tell: only the rotary table follows the grid).
    assert main([*argv, "--image-size", "64", "--overwrite"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed == [f"wrote {out}: GPT-T t2i at 64 px (256 image tokens), custom tokenizer",
                       f"text-to-image: put the T5 encoder (google/flan-t5-xl) at {out / 't5'}, or pass --t5 DIR"]
    config = LlamaGen.from_pretrained(out / "target").config
    assert (config.model_type, config.cls_token_num, config.caption_dim) == ("t2i", 8, 16)
    assert json.loads((out / "generation.json").read_text())["cfg_scale"] == 7.5
    assert not (out / "proximity.safetensors").exists()


@pytest.mark.parametrize("case,message", [
    ("missing", "--gpt-ckpt: no such file"),
    ("swapped", "has no tok_embeddings.weight: not LlamaGen GPT weights"),
    ("vocab", "predicts 512 codes, --vq-ckpt"),
    ("model", "--gpt-model must be one of GPT-B"),
    ("size", "--image-size must be a positive number of pixels, got 0"),
    # trained without class dropout: 11 rows are 11 classes and no null class, not 10 and the null one
    ("no-null", "its training args say 11 classes, its class embedding has 11 rows for 10 classes and the null "
                "class (trained with class_dropout_prob 0: there is no null-class row"),
])
def test_bad_input_is_one_line_and_writes_nothing(tiny_named: None, tmp_path: Path, case: str, message: str,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    target = tiny_llamagen(seed=1, vocab_size=512 if case == "vocab" else 256)
    args = {"num_classes": 11, "class_dropout_prob": 0.0} if case == "no-null" else {"num_classes": 10}
    gpt, tok = _official_files(tmp_path / "dl", target, VQModel(TINY_VQ).eval(), "c2i_T.pt", image_size=32, **args)
    argv = {"missing": ["--gpt-ckpt", str(tmp_path / "none.pt"), "--vq-ckpt", str(tok)],
            "swapped": ["--gpt-ckpt", str(tok), "--vq-ckpt", str(tok)],
            "model": ["--gpt-ckpt", str(gpt), "--vq-ckpt", str(tok), "--gpt-model", "GPT-Q"],
            "size": ["--gpt-ckpt", str(gpt), "--vq-ckpt", str(tok), "--image-size", "0"]}.get(
        case, ["--gpt-ckpt", str(gpt), "--vq-ckpt", str(tok)])
    out = tmp_path / "stack"
    assert main(["convert-llamagen", *argv, "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lantern: error: ") and err.count("\n") == 1 and message in err, err
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == ["dl"]


def test_a_drafter_is_checked_against_the_model_and_copied_in(tiny_named: None, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """``--drafter``: the converted stack drafts with it as a run given ``drafter=`` would; one made
    for another grid (LANTERN's Stage I drafter beside a Stage II target) is refused before anything is written."""
    from lantern.models.drafter import DrafterConfig, EagleDrafterModel

    torch.manual_seed(0)
    target, vq = tiny_llamagen(seed=1), VQModel(TINY_VQ).eval()
    gpt, tok = _official_files(tmp_path / "dl", target, vq, "c2i_T.pt", image_size=32)
    EagleDrafterModel(DrafterConfig.for_target(target.config)).save_pretrained(tmp_path / "dl" / "drafter")
    other = tiny_llamagen(seed=1, block_size=16).config
    EagleDrafterModel(DrafterConfig.for_target(other)).save_pretrained(tmp_path / "dl" / "other")
    argv = ["convert-llamagen", "--gpt-ckpt", str(gpt), "--vq-ckpt", str(tok), "--no-progress"]
    assert main([*argv, "--out", str(tmp_path / "bad"), "--drafter", str(tmp_path / "dl" / "other")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "block_size 16" in err and not (tmp_path / "bad").exists(), err
    out = tmp_path / "stack"
    assert main([*argv, "--out", str(out), "--drafter", str(tmp_path / "dl" / "drafter")]) == 0
    settings = {"method": "lantern", "lantern_delta": 0.2, "top_k": 0, "cfg_scale": 1.0}
    given = lantern.load(tmp_path / "stack", drafter=tmp_path / "dl" / "drafter")
    codes = lantern.load(out)(labels=[2, 5], seed=1, **settings).codes
    assert torch.equal(codes, given(labels=[2, 5], seed=1, **settings).codes)
