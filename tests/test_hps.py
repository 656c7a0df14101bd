"""HPS v2 (``lantern.eval.hps``): OpenCLIP's state dict renamed into transformers' CLIP gives the
scores OpenCLIP's own forward gives, written out here as OpenCLIP computes it (``nn.MultiheadAttention``
on the stacked ``in_proj``, ``x @ proj``, the text pooled at its highest token id)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_clip
from torch import nn

from lantern.errors import LanternError
from lantern.eval.metrics import CLIP_MEAN, CLIP_STD

pytest.importorskip("transformers")  # an optional extra ([t2i]); CI installs it, so this never skips there

WIDTH, HEADS, PATCH, SIZE, PROJ, VOCAB, CONTEXT = 16, 2, 16, 32, 8, 13, 77  # tiny_clip's towers


def _open_clip_state(seed: int = 0) -> dict[str, torch.Tensor]:
    """An OpenCLIP ``CLIP`` state dict of tiny_clip's shapes (one block per tower)."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape: int, scale: float = 0.3) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    def block(prefix: str) -> dict[str, torch.Tensor]:
        return {f"{prefix}ln_1.weight": 1 + r(WIDTH, scale=0.1), f"{prefix}ln_1.bias": r(WIDTH, scale=0.1),
                f"{prefix}attn.in_proj_weight": r(3 * WIDTH, WIDTH), f"{prefix}attn.in_proj_bias": r(3 * WIDTH),
                f"{prefix}attn.out_proj.weight": r(WIDTH, WIDTH), f"{prefix}attn.out_proj.bias": r(WIDTH),
                f"{prefix}ln_2.weight": 1 + r(WIDTH, scale=0.1), f"{prefix}ln_2.bias": r(WIDTH, scale=0.1),
                f"{prefix}mlp.c_fc.weight": r(2 * WIDTH, WIDTH), f"{prefix}mlp.c_fc.bias": r(2 * WIDTH),
                f"{prefix}mlp.c_proj.weight": r(WIDTH, 2 * WIDTH), f"{prefix}mlp.c_proj.bias": r(WIDTH)}

    grid = (SIZE // PATCH) ** 2
    return {"visual.class_embedding": r(WIDTH), "visual.positional_embedding": r(grid + 1, WIDTH),
            "visual.conv1.weight": r(WIDTH, 3, PATCH, PATCH, scale=0.05),
            "visual.ln_pre.weight": 1 + r(WIDTH, scale=0.1), "visual.ln_pre.bias": r(WIDTH, scale=0.1),
            **block("visual.transformer.resblocks.0."),
            "visual.ln_post.weight": 1 + r(WIDTH, scale=0.1), "visual.ln_post.bias": r(WIDTH, scale=0.1),
            "visual.proj": r(WIDTH, PROJ),
            "token_embedding.weight": r(VOCAB, WIDTH), "positional_embedding": r(CONTEXT, WIDTH),
            **block("transformer.resblocks.0."),
            "ln_final.weight": 1 + r(WIDTH, scale=0.1), "ln_final.bias": r(WIDTH, scale=0.1),
            "text_projection": r(WIDTH, PROJ), "logit_scale": torch.tensor(4.6052)}


def _block(x: torch.Tensor, sd: dict[str, torch.Tensor], prefix: str, mask: torch.Tensor | None) -> torch.Tensor:
    """OpenCLIP's ResidualAttentionBlock: pre-norm nn.MultiheadAttention, then c_fc, GELU, c_proj."""
    attn = nn.MultiheadAttention(WIDTH, HEADS, batch_first=True)
    attn.load_state_dict({"in_proj_weight": sd[f"{prefix}attn.in_proj_weight"],
                          "in_proj_bias": sd[f"{prefix}attn.in_proj_bias"],
                          "out_proj.weight": sd[f"{prefix}attn.out_proj.weight"],
                          "out_proj.bias": sd[f"{prefix}attn.out_proj.bias"]})
    h = F.layer_norm(x, (WIDTH,), sd[f"{prefix}ln_1.weight"], sd[f"{prefix}ln_1.bias"])
    x = x + attn.eval()(h, h, h, need_weights=False, attn_mask=mask)[0]
    h = F.layer_norm(x, (WIDTH,), sd[f"{prefix}ln_2.weight"], sd[f"{prefix}ln_2.bias"])
    h = F.linear(F.gelu(F.linear(h, sd[f"{prefix}mlp.c_fc.weight"], sd[f"{prefix}mlp.c_fc.bias"])),
                 sd[f"{prefix}mlp.c_proj.weight"], sd[f"{prefix}mlp.c_proj.bias"])
    return x + h


@torch.no_grad()
def _open_clip_scores(sd: dict[str, torch.Tensor], images: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """HPS as OpenCLIP computes it: ``encode_image`` / ``encode_text``, normalised, their dot product."""
    x = F.interpolate(images, size=(SIZE, SIZE), mode="bicubic", align_corners=False, antialias=True)
    x = ((x.clamp(-1, 1) + 1) / 2 - torch.tensor(CLIP_MEAN).view(1, 3, 1, 1)) / torch.tensor(CLIP_STD).view(1, 3, 1, 1)
    x = F.conv2d(x, sd["visual.conv1.weight"], stride=PATCH).flatten(2).transpose(1, 2)
    x = torch.cat([sd["visual.class_embedding"].expand(x.shape[0], 1, WIDTH), x], 1) + sd["visual.positional_embedding"]
    x = F.layer_norm(x, (WIDTH,), sd["visual.ln_pre.weight"], sd["visual.ln_pre.bias"])
    x = _block(x, sd, "visual.transformer.resblocks.0.", None)
    image = F.layer_norm(x[:, 0], (WIDTH,), sd["visual.ln_post.weight"], sd["visual.ln_post.bias"]) @ sd["visual.proj"]
    length = ids.shape[1]
    t = sd["token_embedding.weight"][ids] + sd["positional_embedding"][:length]
    t = _block(t, sd, "transformer.resblocks.0.", torch.full((length, length), float("-inf")).triu(1))
    t = F.layer_norm(t, (WIDTH,), sd["ln_final.weight"], sd["ln_final.bias"])
    text = t[torch.arange(ids.shape[0]), ids.argmax(-1)] @ sd["text_projection"]
    return (F.normalize(image, dim=-1) * F.normalize(text, dim=-1)).sum(-1)


def test_hps_scores_are_open_clips_cosines(tmp_path: Path) -> None:
    from lantern.eval.hps import HpsScorer

    folder = tiny_clip(tmp_path / "vit-h-14", hidden_act="gelu")
    sd = _open_clip_state()
    torch.save({"state_dict": sd}, tmp_path / "HPS_v2.1_compressed.pt")  # hpsv2's layout
    scorer = HpsScorer(tmp_path / "HPS_v2.1_compressed.pt", folder)
    assert scorer.name == "HPS HPS_v2.1_compressed.pt on vit-h-14"
    g = torch.Generator().manual_seed(1)
    images = torch.rand(6, 3, 24, 24, generator=g) * 2 - 1
    prompts = ["a kite over a beach", "two dogs", "a red car", "a cat", "a red cat", "two kite"]
    ids = scorer.tokenizer(prompts, padding=True, return_tensors="pt")["input_ids"]
    expected = _open_clip_scores(sd, images, ids)
    got = scorer.scores(images, prompts, batch_size=4)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=0)
    assert (expected < 0).any() and (expected > 0).any()  # a plain cosine: no clamp, no scale
    assert not torch.allclose(scorer.scores(images, prompts[::-1]), got)  # each image against its own prompt
    # a DistributedDataParallel save ("module." before every key) and safetensors read the same: the
    # same bits at the same batch size (a GEMM's rounding may follow the batch: 4 + 2 rows against 6)
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in sd.items()}, tmp_path / "hps.safetensors")
    torch.save({f"module.{k}": v for k, v in sd.items()}, tmp_path / "ddp.pt")
    for name in ("hps.safetensors", "ddp.pt"):
        same_batches = HpsScorer(tmp_path / name, folder).scores(images, prompts, batch_size=4)
        torch.testing.assert_close(same_batches, got, atol=0, rtol=0)


def test_hps_scores_are_what_open_clips_own_model_gives(tmp_path: Path) -> None:
    """OpenCLIP's own ``CLIP`` (open_clip 3.3.0, its random weights and its scores stored by
    scripts/make_hps_reference.py: open_clip needs torchvision, which cannot share this venv) at
    tiny_clip's shapes: its state dict, renamed, gives the scores its encode_image / encode_text do."""
    import numpy as np

    from lantern.eval.hps import HpsScorer

    with np.load(Path(__file__).parent / "data" / "hps_reference.npz", allow_pickle=False) as ref:
        state = {k[len("state/"):]: torch.from_numpy(ref[k]) for k in ref.files if k.startswith("state/")}
        images, scores, prompts = torch.from_numpy(ref["images"]), torch.from_numpy(ref["scores"]), ref["prompts"]
    torch.save({"state_dict": state}, tmp_path / "hps.pt")
    got = HpsScorer(tmp_path / "hps.pt", tiny_clip(tmp_path / "clip", hidden_act="gelu")).scores(images,
                                                                                                prompts.tolist())
    torch.testing.assert_close(got, scores, atol=2e-5, rtol=0)
    assert len(set(scores.tolist())) == 4  # power: every image-prompt pair scores its own value


def test_a_file_that_is_not_open_clips_vit_is_named(tmp_path: Path) -> None:
    from lantern.eval.hps import HpsScorer

    folder = tiny_clip(tmp_path / "clip", hidden_act="gelu")
    with pytest.raises(LanternError, match=r"^--hps: no such file .*none\.pt \(HPS_v2\.1_compressed\.pt\)$"):
        HpsScorer(tmp_path / "none.pt", folder)
    torch.save({"state_dict": _open_clip_state()}, tmp_path / "hps.pt")
    with pytest.raises(LanternError, match=r"^--hps-clip: no such folder .*none \(a ViT-H-14 CLIP folder"):
        HpsScorer(tmp_path / "hps.pt", tmp_path / "none")
    torch.save({"state_dict": {**_open_clip_state(), "visual.attn_pool.query": torch.zeros(1)}}, tmp_path / "coca.pt")
    with pytest.raises(LanternError, match=r"^--hps: key 'visual\.attn_pool\.query' is not part of an OpenCLIP "):
        HpsScorer(tmp_path / "coca.pt", folder)
    wide = {k: v for k, v in _open_clip_state().items() if k != "ln_final.bias"}
    torch.save(wide, tmp_path / "cut.pt")
    with pytest.raises(LanternError, match=r"match the model: missing keys: text_model\.final_layer_norm\.bias"):
        HpsScorer(tmp_path / "cut.pt", folder)
    torch.save({"state_dict": [1, 2]}, tmp_path / "list.pt")
    with pytest.raises(LanternError, match=r"holds no state dict of tensors"):
        HpsScorer(tmp_path / "list.pt", folder)


def test_bench_reports_each_rows_hps(t2i_stack: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """``bench --hps FILE --hps-clip DIR``: every row's mean HPS of its images against their own
    prompts (a planted scorer, the length of each prompt, shows which prompts reach it)."""
    import json

    from lantern.cli.main import main
    from lantern.eval.hps import HpsScorer
    from lantern.targets.base import prompts_for

    clip = tiny_clip(tmp_path / "clip", hidden_act="gelu")
    torch.save({"state_dict": _open_clip_state()}, tmp_path / "hps.pt")
    seen: list[int] = []

    def planted(self: HpsScorer, images: torch.Tensor, prompts: list[str], batch_size: int = 64) -> torch.Tensor:
        seen.append(images.shape[0])
        return torch.tensor([float(len(p)) for p in prompts])

    monkeypatch.setattr(HpsScorer, "scores", planted)
    argv = ["bench", "--methods", "ar,sjd-coupled", "--num-images", "4", "--speed-images", "2", "--batch-size", "4",
            "--num-real", "4", "--curve-images", "0", "--no-ar-spread", "--no-progress", "--hps",
            str(tmp_path / "hps.pt"), "--hps-clip", str(clip)]
    assert main([*argv, "--model", str(t2i_stack), "--feature-net", f"clip:{clip}", "--out", str(tmp_path / "b")]) == 0
    rows = json.loads((tmp_path / "b" / "bench.json").read_text())
    want = sum(len(p) for p in prompts_for(4)) / 4
    assert [r["hps"] for r in rows] == [want, want] and seen == [4, 4]
    assert "| HPS |" in (tmp_path / "b" / "bench.md").read_text()
    assert json.loads((tmp_path / "b" / "run.json").read_text())["hps"] == "HPS hps.pt on clip"
    capsys.readouterr()
    assert main([*argv, "--model", "digits", "--out", str(tmp_path / "c")]) == 2
    assert capsys.readouterr().err == ("lantern: error: --hps: digits is class-conditional: a preference score "
                                       "needs prompts\n")
    assert main([*argv, "--no-quality", "--model", str(t2i_stack), "--out", str(tmp_path / "d")]) == 2
    assert "--hps is a quality metric: drop --no-quality" in capsys.readouterr().err
    assert main([*argv[:-2], "--model", str(t2i_stack), "--out", str(tmp_path / "e")]) == 2
    assert "--hps FILE needs --hps-clip DIR" in capsys.readouterr().err
