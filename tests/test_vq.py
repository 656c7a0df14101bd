"""LlamaGen VQ tokenizer: official key layout, coding conventions, loading and saving."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
import torch.nn.functional as F

from lantern.errors import CheckpointError, LanternError
from lantern.models import vq
from lantern.models.vq import (
    VQ_CONFIGS,
    AttnBlock,
    Downsample,
    VQConfig,
    VQModel,
    extract_state_dict,
    to_pil,
    vq_config,
)

# Downsample factor 4: a 16x16 image is a 4x4 grid = 16 codes.
TINY = VQConfig(
    codebook_size=256,
    codebook_embed_dim=8,
    z_channels=32,
    ch=32,
    ch_mult=(1, 2, 2),
    num_res_blocks=1,
    norm_groups=8,
)


@pytest.fixture(scope="module")
def tiny() -> VQModel:
    torch.manual_seed(0)
    model = VQModel(TINY).eval()
    with torch.no_grad():
        # Trained codebooks are not unit norm; make sure nothing relies on that.
        w = model.quantize.embedding.weight
        w.copy_(torch.randn_like(w) * torch.rand(w.shape[0], 1) * 3)
    return model


def _images(n: int = 2, size: int = 16, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, 3, size, size, generator=g) * 2 - 1


def _codes(n: int = 2, count: int = 16, seed: int = 2) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, TINY.codebook_size, (n, count), generator=g)


# ------------------------------------------------------------------------------------------
# Official key layout ([LlamaGen code] vq_model.py), checked on the meta device without allocating weights
# ------------------------------------------------------------------------------------------


def _res_keys(prefix: str, shortcut: bool) -> list[str]:
    parts = ["norm1", "conv1", "norm2", "conv2"] + (["nin_shortcut"] if shortcut else [])
    return [f"{prefix}.{p}.{wb}" for p in parts for wb in ("weight", "bias")]


def _attn_keys(prefix: str) -> list[str]:
    return [f"{prefix}.{p}.{wb}" for p in ("norm", "q", "k", "v", "proj_out")
            for wb in ("weight", "bias")]


def _wb(prefix: str) -> list[str]:
    return [f"{prefix}.weight", f"{prefix}.bias"]


def _expected_vq16_keys() -> set[str]:
    """The VQ-16 key list written out from [LlamaGen code] vq_model.py, independently of the model code."""
    keys = _wb("encoder.conv_in") + _wb("encoder.norm_out") + _wb("encoder.conv_out")
    enc_shortcut = {(2, 0), (4, 0)}  # 128->256 and 256->512
    for i in range(5):
        for j in range(2):
            keys += _res_keys(f"encoder.conv_blocks.{i}.res.{j}", (i, j) in enc_shortcut)
        if i < 4:
            keys += _wb(f"encoder.conv_blocks.{i}.downsample.conv")
    keys += [k for j in range(2) for k in _attn_keys(f"encoder.conv_blocks.4.attn.{j}")]
    dec_shortcut = {(1, 0), (3, 0)}  # 512->256 and 256->128
    for i in range(5):
        for j in range(3):
            keys += _res_keys(f"decoder.conv_blocks.{i}.res.{j}", (i, j) in dec_shortcut)
        if i < 4:
            keys += _wb(f"decoder.conv_blocks.{i}.upsample.conv")
    keys += [k for j in range(3) for k in _attn_keys(f"decoder.conv_blocks.0.attn.{j}")]
    for side in ("encoder", "decoder"):
        keys += _res_keys(f"{side}.mid.0", False) + _attn_keys(f"{side}.mid.1")
        keys += _res_keys(f"{side}.mid.2", False)
    keys += _wb("decoder.conv_in") + _wb("decoder.norm_out") + _wb("decoder.conv_out")
    keys += _wb("quant_conv") + _wb("post_quant_conv")
    keys += ["quantize.embedding.weight", "quantize.codebook_used"]
    return set(keys)


def test_vq16_state_dict_matches_official_layout() -> None:
    with torch.device("meta"):
        model = VQModel(VQConfig())
    sd = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    expected = _expected_vq16_keys()
    assert len(sd) == 344 == len(expected)
    assert set(sd) == expected
    shapes = {
        "encoder.conv_in.weight": (128, 3, 3, 3),
        "encoder.conv_blocks.0.downsample.conv.weight": (128, 128, 3, 3),
        "encoder.conv_blocks.2.res.0.nin_shortcut.weight": (256, 128, 1, 1),
        "encoder.conv_blocks.4.res.0.nin_shortcut.weight": (512, 256, 1, 1),
        "encoder.conv_blocks.4.attn.0.q.weight": (512, 512, 1, 1),
        "encoder.mid.1.proj_out.weight": (512, 512, 1, 1),
        "encoder.norm_out.weight": (512,),
        "encoder.conv_out.weight": (256, 512, 3, 3),
        "quant_conv.weight": (8, 256, 1, 1),
        "quantize.embedding.weight": (16384, 8),
        "quantize.codebook_used": (65536,),
        "post_quant_conv.weight": (256, 8, 1, 1),
        "decoder.conv_in.weight": (512, 256, 3, 3),
        "decoder.conv_blocks.0.attn.2.proj_out.weight": (512, 512, 1, 1),
        "decoder.conv_blocks.1.res.0.conv1.weight": (256, 512, 3, 3),
        "decoder.conv_blocks.1.res.0.nin_shortcut.weight": (256, 512, 1, 1),
        "decoder.conv_blocks.3.upsample.conv.weight": (128, 128, 3, 3),
        "decoder.conv_blocks.4.res.2.conv2.weight": (128, 128, 3, 3),
        "decoder.conv_out.weight": (3, 128, 3, 3),
    }
    for key, shape in shapes.items():
        assert sd[key] == shape, key
    assert "decoder.conv_blocks.4.upsample.conv.weight" not in sd
    assert "encoder.conv_blocks.4.downsample.conv.weight" not in sd
    assert "encoder.conv_blocks.1.res.0.nin_shortcut.weight" not in sd  # 128 -> 128
    assert sum(v.numel() for v in model.state_dict().values()) - 65536 == 71_883_403


def test_named_configs() -> None:
    assert vq_config("VQ-16") == VQConfig()
    assert vq_config("VQ-16").downsample_factor == 16
    assert vq_config("VQ-8").downsample_factor == 8
    assert VQ_CONFIGS["VQ-8"].ch_mult == (1, 2, 2, 4)
    with pytest.raises(LanternError, match="VQ-16"):
        vq_config("VQ-32")


# ------------------------------------------------------------------------------------------
# Config validation
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"ch": 30}, "norm_groups"),
        ({"ch_mult": ()}, "ch_mult"),
        ({"ch_mult": (1, 0)}, "ch_mult"),
        ({"codebook_size": 0}, "codebook_size"),
        ({"codebook_embed_dim": 2.5}, "codebook_embed_dim"),
        ({"num_res_blocks": True}, "num_res_blocks"),
        ({"codebook_l2_norm": 1}, "codebook_l2_norm"),
        ({"dropout": 1.0}, "dropout"),
    ],
)
def test_bad_config_values_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(LanternError, match=field):
        VQConfig(**kwargs)


def test_config_dict_round_trip_and_unknown_keys() -> None:
    d = TINY.to_dict()
    assert d["ch_mult"] == [1, 2, 2]
    json.dumps(d)
    assert VQConfig.from_dict(d) == TINY
    with pytest.raises(LanternError, match="chmult"):
        VQConfig.from_dict({**d, "chmult": [1]})


# ------------------------------------------------------------------------------------------
# Coding conventions
# ------------------------------------------------------------------------------------------


def test_encode_decode_shapes(tiny: VQModel) -> None:
    codes = tiny.encode(_images())
    assert codes.shape == (2, 16) and codes.dtype == torch.int64
    assert 0 <= int(codes.min()) and int(codes.max()) < TINY.codebook_size
    images = tiny.decode(codes)
    assert images.shape == (2, 3, 16, 16)


def test_codebook_is_normalised_at_use_time(tiny: VQModel) -> None:
    raw = tiny.quantize.embedding.weight
    assert not torch.allclose(raw.norm(dim=1), torch.ones(TINY.codebook_size))
    torch.testing.assert_close(tiny.codebook(), F.normalize(raw, dim=-1))
    torch.testing.assert_close(tiny.codebook().norm(dim=1), torch.ones(TINY.codebook_size))


def test_embed_codes_and_decode_follow_the_official_lookup(tiny: VQModel) -> None:
    codes = _codes()
    b, n, g = codes.shape[0], codes.shape[1], 4
    vectors = F.normalize(tiny.quantize.embedding.weight, dim=-1)[codes.reshape(-1)]  # [B*N, 8]
    manual = vectors.reshape(b, g, g, 8).permute(0, 3, 1, 2).contiguous()  # [B, 8, g, g]
    assert n == g * g
    torch.testing.assert_close(tiny.embed_codes(codes), manual, rtol=0, atol=0)
    with torch.no_grad():
        expected = tiny.decoder(tiny.post_quant_conv(manual))
    torch.testing.assert_close(tiny.decode(codes), expected, rtol=0, atol=0)


def _brute_force_nearest(z: torch.Tensor, book: torch.Tensor) -> list[int]:
    out = []
    for vec in F.normalize(z, dim=-1):
        dists = [float(((vec - e) ** 2).sum()) for e in F.normalize(book, dim=-1)]
        out.append(min(range(len(dists)), key=dists.__getitem__))
    return out


@pytest.mark.parametrize("max_elements", [1 << 24, 300])  # one block, then many row chunks
def test_quantisation_picks_nearest_normalised_vector(
    tiny: VQModel, monkeypatch: pytest.MonkeyPatch, max_elements: int
) -> None:
    monkeypatch.setattr(vq, "_MAX_DISTANCE_ELEMENTS", max_elements)
    z = torch.randn(2, 8, 2, 3, generator=torch.Generator().manual_seed(3)) * 5  # [B, D, h, w]
    zq, codes = tiny.quantize_latents(z)
    flat = z.permute(0, 2, 3, 1).reshape(-1, 8)  # row-major over (h, w)
    expected = _brute_force_nearest(flat, tiny.quantize.embedding.weight.detach())
    assert codes.shape == (2, 6)
    assert codes.reshape(-1).tolist() == expected
    torch.testing.assert_close(zq, tiny.codebook()[codes].reshape(2, 2, 3, 8).permute(0, 3, 1, 2))


def test_quantisation_without_l2_norm_uses_raw_codebook() -> None:
    torch.manual_seed(4)
    model = VQModel(VQConfig(**{**TINY.to_dict(), "codebook_l2_norm": False}))
    book = model.quantize.embedding.weight.detach()
    torch.testing.assert_close(model.codebook(), book)
    z = torch.randn(1, 8, 2, 2) * 0.01
    _, codes = model.quantize_latents(z)
    flat = z.permute(0, 2, 3, 1).reshape(-1, 8)
    assert codes.reshape(-1).tolist() == torch.cdist(flat, book).argmin(dim=1).tolist()


def test_forward_losses_and_straight_through_gradients(tiny: VQModel) -> None:
    x = _images(1)
    recon, losses, codes = tiny(x)
    assert recon.shape == x.shape
    assert set(losses) == {"codebook", "commitment"}
    torch.testing.assert_close(losses["commitment"], 0.25 * losses["codebook"])
    assert torch.equal(codes, tiny.encode(x))
    tiny.zero_grad()
    (F.mse_loss(recon, x) + sum(losses.values())).backward()
    assert tiny.encoder.conv_in.weight.grad is not None  # through the straight-through estimator
    assert tiny.quantize.embedding.weight.grad is not None  # through the codebook loss
    tiny.zero_grad()


def test_usage_window_records_codes_in_training_only() -> None:
    model = VQModel(TINY)
    x = _images(1)
    model.eval()
    model(x)
    assert not model.quantize.codebook_used.any()
    model.train()
    _, _, codes = model(x)
    assert model.quantize.codebook_used[-16:].tolist() == codes.reshape(-1).float().tolist()


def test_attention_and_downsample_math() -> None:
    """Pin the conventions that strict key loading cannot check."""
    torch.manual_seed(5)
    attn = AttnBlock(16, 8).eval()
    x = torch.randn(2, 16, 3, 5)
    h = attn.norm(x)
    q, k, v = (m(h).reshape(2, 16, 15) for m in (attn.q, attn.k, attn.v))  # [B, C, HW]
    w = torch.softmax(q.transpose(1, 2) @ k / 4.0, dim=-1)  # [B, HW_q, HW_k], 1/sqrt(16)
    expected = x + attn.proj_out((v @ w.transpose(1, 2)).reshape(2, 16, 3, 5))
    with torch.no_grad():
        torch.testing.assert_close(attn(x), expected)

    down = Downsample(4)
    y = torch.randn(1, 4, 8, 8)
    padded = F.pad(y, (0, 1, 0, 1))  # right and bottom only
    with torch.no_grad():
        torch.testing.assert_close(down(y), F.conv2d(padded, down.conv.weight, down.conv.bias, 2))


# ------------------------------------------------------------------------------------------
# Bad inputs
# ------------------------------------------------------------------------------------------


def test_decode_rejects_non_square_and_out_of_range_codes(tiny: VQModel) -> None:
    with pytest.raises(LanternError, match="square"):
        tiny.decode(_codes(count=15))
    with pytest.raises(LanternError, match="codes must be in"):
        tiny.decode(torch.full((1, 4), TINY.codebook_size))
    with pytest.raises(LanternError, match=r"\[B, N\]"):
        tiny.decode(torch.zeros(16, dtype=torch.long))


def test_encode_rejects_bad_image_shapes(tiny: VQModel) -> None:
    with pytest.raises(LanternError, match="multiples of 4"):
        tiny.encode(torch.zeros(1, 3, 18, 16))
    with pytest.raises(LanternError, match="images must be"):
        tiny.encode(torch.zeros(3, 16, 16))


# ------------------------------------------------------------------------------------------
# Files
# ------------------------------------------------------------------------------------------


def test_save_and_load_pretrained_round_trip(tiny: VQModel, tmp_path) -> None:
    tiny.save_pretrained(tmp_path / "vq")
    config = json.loads((tmp_path / "vq" / "config.json").read_text())
    assert config["model_type"] == "lantern-vq" and config["ch_mult"] == [1, 2, 2]
    loaded = VQModel.from_pretrained(tmp_path / "vq")
    assert loaded.config == TINY
    codes = _codes()
    torch.testing.assert_close(loaded.decode(codes), tiny.decode(codes), rtol=0, atol=0)


def test_from_pretrained_rejects_other_model_types(tiny: VQModel, tmp_path) -> None:
    folder = tiny.save_pretrained(tmp_path / "vq")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "llamagen"}))
    with pytest.raises(LanternError, match="lantern-vq"):
        VQModel.from_pretrained(folder)


def test_official_checkpoint_loads_and_ignores_training_extras(tiny: VQModel, tmp_path) -> None:
    path = tmp_path / "vq_ds16_c2i.pt"
    torch.save(
        {
            "model": tiny.state_dict(),
            "optimizer": {},
            "discriminator": {"w": torch.zeros(2)},
            "steps": 3,
            "args": argparse.Namespace(x=1),
        },
        path,
    )
    loaded = VQModel.from_official_checkpoint(path, config=TINY)
    assert not loaded.training
    codes = _codes()
    torch.testing.assert_close(loaded.decode(codes), tiny.decode(codes), rtol=0, atol=0)
    x = _images()
    assert torch.equal(loaded.encode(x), tiny.encode(x))


def _save_broken(tiny: VQModel, path, mutate) -> None:
    sd = dict(tiny.state_dict())
    mutate(sd)
    torch.save({"model": sd}, path)


def test_official_checkpoint_with_missing_key(tiny: VQModel, tmp_path) -> None:
    path = tmp_path / "missing.pt"
    _save_broken(tiny, path, lambda sd: sd.pop("decoder.conv_out.bias"))
    with pytest.raises(CheckpointError, match=r"missing keys: decoder\.conv_out\.bias"):
        VQModel.from_official_checkpoint(path, config=TINY)


def test_official_checkpoint_without_the_usage_window_loads(tiny: VQModel, tmp_path) -> None:
    """LlamaGen's VQ trained with codebook_show_usage=False has no quantize.codebook_used (a
    training statistic): it loads, with an empty window, and decodes as the model it came from."""
    path = tmp_path / "no_usage.pt"
    _save_broken(tiny, path, lambda sd: sd.pop("quantize.codebook_used"))
    loaded = VQModel.from_official_checkpoint(path, config=TINY)
    assert not loaded.quantize.codebook_used.any()
    codes = _codes()
    assert torch.equal(loaded.decode(codes), tiny.decode(codes))


def test_official_checkpoint_with_mis_shaped_key(tiny: VQModel, tmp_path) -> None:
    path = tmp_path / "misshaped.pt"

    def shrink(sd: dict) -> None:
        sd["quantize.embedding.weight"] = torch.zeros(128, 8)

    _save_broken(tiny, path, shrink)
    with pytest.raises(CheckpointError, match=r"mis-shaped keys: quantize\.embedding\.weight"):
        VQModel.from_official_checkpoint(path, config=TINY)


def test_official_checkpoint_for_the_wrong_config(tiny: VQModel, tmp_path) -> None:
    path = tmp_path / "tiny.pt"
    torch.save({"model": tiny.state_dict()}, path)
    with pytest.raises(CheckpointError):
        VQModel.from_official_checkpoint(path, config="VQ-8")
    with pytest.raises(LanternError, match="not found"):
        VQModel.from_official_checkpoint(tmp_path / "absent.pt", config=TINY)


def test_extract_state_dict_container_order() -> None:
    a, b, c = ({"w": torch.full((1,), float(i))} for i in range(3))
    assert extract_state_dict({"model": a, "state_dict": b, "ema": c}) is not a  # a copy
    assert extract_state_dict({"model": a, "state_dict": b, "ema": c})["w"].item() == 0
    assert extract_state_dict({"state_dict": b, "ema": c, "steps": 1})["w"].item() == 1
    assert extract_state_dict(c)["w"].item() == 2  # raw state dict
    assert extract_state_dict({"model": a, "ema": c}, key="ema")["w"].item() == 2
    with pytest.raises(CheckpointError, match="ema, steps"):
        extract_state_dict({"ema": c, "steps": 1})  # the EMA copy is never picked implicitly
    with pytest.raises(CheckpointError, match="expected a dict"):
        extract_state_dict([a])
    with pytest.raises(CheckpointError, match="not a state dict"):
        extract_state_dict({"model": {"w": 1}})


# ------------------------------------------------------------------------------------------
# Images
# ------------------------------------------------------------------------------------------


def test_to_pil_values_and_modes() -> None:
    x = torch.zeros(2, 3, 2, 2)
    x[0, :, 0, 0] = torch.tensor([-1.0, 1.0, 0.5])  # -> 0, 255, round(191.25) = 191
    x[0, :, 0, 1] = torch.tensor([-3.0, 3.0, 0.0])  # clamped -> 0, 255; 0 -> 127.5 -> 128
    images = to_pil(x)
    assert len(images) == 2 and images[0].mode == "RGB" and images[0].size == (2, 2)
    assert images[0].getpixel((0, 0)) == (0, 255, 191)
    assert images[0].getpixel((1, 0)) == (0, 255, 128)
    gray = to_pil(torch.full((1, 1, 3, 4), -0.5))  # 0.25 * 255 = 63.75 -> 64
    assert gray[0].mode == "L" and gray[0].size == (4, 3) and gray[0].getpixel((2, 1)) == 64
    with pytest.raises(LanternError):
        to_pil(torch.zeros(1, 2, 4, 4))
