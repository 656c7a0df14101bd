"""Chameleon VQGAN: transformers parity, the original key layout, checkpoint loading, decoding."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import fake_class, save_with_fake_modules

from lantern.errors import CheckpointError, LanternError
from lantern.io import LanternWarning
from lantern.models.chameleon_vq import (
    ChameleonVQConfig,
    ChameleonVQGAN,
    config_to_transformers,
    extract_model_state,
    to_pil,
    to_transformers_state,
)

# Downsample factor 2: a 16 x 16 image is an 8 x 8 grid. Attention at resolution 8 puts AttnBlocks
# in encoder level 1 and decoder level 1 besides ``mid``; z_channels != embed_dim so swapped
# quant convs cannot load.
TINY = ChameleonVQConfig(embed_dim=8, n_embed=16, z_channels=16, resolution=16, ch=32, ch_mult=(1, 2),
                         num_res_blocks=1, attn_resolutions=(8,))

TINY_YAML = """\
model:
  base_learning_rate: 4.5e-06
  target: taming.models.vqgan.VQModel
  params:
    embed_dim: 8
    n_embed: 16
    ddconfig:
      double_z: false
      z_channels: 16
      resolution: 16
      in_channels: 3
      out_ch: 3
      ch: 32
      ch_mult:
      - 1
      - 2
      num_res_blocks: 1
      attn_resolutions:
      - 8
      dropout: 0.0
    lossconfig:
      target: taming.modules.losses.vqperceptual.VQLPIPSWithDiscriminator
      params:
        disc_start: 0
"""


def _images(n: int = 2, size: int = 16, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, 3, size, size, generator=g) * 2 - 1


def _codes(n: int = 2, count: int = 16, seed: int = 2) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, TINY.n_embed, (n, count), generator=g)


@pytest.fixture(scope="module")
def tiny() -> ChameleonVQGAN:
    torch.manual_seed(0)
    model = ChameleonVQGAN(TINY)
    with torch.no_grad():
        # Move GroupNorm affines and all biases off their defaults so a wrong mapping shows.
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.1)
            elif ".norm" in name and name.endswith(".weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
        # Codebook = real latents (+ noise) so images map to many different codes.
        z = model.encode_latents(_images(4, seed=9)).permute(0, 2, 3, 1).reshape(-1, TINY.embed_dim)
        rows = torch.randperm(z.shape[0])[: TINY.n_embed]
        model.quantize.embedding.weight.copy_(z[rows] + 0.01 * torch.randn(TINY.n_embed, TINY.embed_dim))
    return model.eval()


# ------------------------------------------------------------------------------------------
# 1. Encoder + quantizer parity with transformers' ChameleonVQVAE
# ------------------------------------------------------------------------------------------


def test_encoder_and_codes_match_transformers(tiny: ChameleonVQGAN) -> None:
    transformers = pytest.importorskip("transformers")
    hf = transformers.ChameleonVQVAE(config_to_transformers(TINY)).eval()
    hf.load_state_dict(to_transformers_state(tiny.state_dict()), strict=True)
    images = _images(3, seed=5)
    with torch.no_grad():
        out = hf.encode(images, return_dict=True)
        ours_latent = tiny.encoder(images)
    torch.testing.assert_close(ours_latent, out.last_hidden_state, rtol=1e-4, atol=1e-5)
    codes = tiny.encode(images)
    assert codes.dtype == torch.int64 and codes.shape == (3, 64)
    assert torch.equal(codes, out.image_tokens.reshape(3, -1))
    assert codes.unique().numel() > 4  # the comparison is not between constant code maps


def test_to_transformers_state_drops_decoder_and_losses(tiny: ChameleonVQGAN) -> None:
    state = {**tiny.state_dict(), "loss.discriminator.main.0.weight": torch.zeros(1)}
    mapped = to_transformers_state(state)
    assert not any(k.startswith(("decoder.", "loss.")) for k in mapped)
    assert mapped["quantize.embedding.weight"] is state["quantize.embedding.weight"]
    with pytest.raises(LanternError, match="optimizer.step"):
        to_transformers_state({**state, "optimizer.step": torch.zeros(1)})


# ------------------------------------------------------------------------------------------
# 2. Real-size key layout on the meta device
# ------------------------------------------------------------------------------------------


def _conv(s: dict, name: str, c_out: int, c_in: int, k: int) -> None:
    s[f"{name}.weight"], s[f"{name}.bias"] = (c_out, c_in, k, k), (c_out,)


def _gn(s: dict, name: str, c: int) -> None:
    s[f"{name}.weight"], s[f"{name}.bias"] = (c,), (c,)


def _resnet(s: dict, name: str, c_in: int, c_out: int) -> None:
    _gn(s, f"{name}.norm1", c_in)
    _conv(s, f"{name}.conv1", c_out, c_in, 3)
    _gn(s, f"{name}.norm2", c_out)
    _conv(s, f"{name}.conv2", c_out, c_out, 3)
    if c_in != c_out:
        _conv(s, f"{name}.nin_shortcut", c_out, c_in, 1)


def _mid(s: dict, name: str, c: int) -> None:
    _resnet(s, f"{name}.block_1", c, c)
    _gn(s, f"{name}.attn_1.norm", c)
    for proj in ("q", "k", "v", "proj_out"):
        _conv(s, f"{name}.attn_1.{proj}", c, c, 1)
    _resnet(s, f"{name}.block_2", c, c)


def _release_shapes() -> dict[str, tuple[int, ...]]:
    """taming's VQModel for Chameleon's yaml: ch 128, ch_mult 1,1,2,2,4, 2 res blocks, no level attn."""
    widths, s = [128, 128, 256, 256, 512], {}
    _conv(s, "encoder.conv_in", 128, 3, 3)
    c = 128
    for i, w in enumerate(widths):
        for j in range(2):
            _resnet(s, f"encoder.down.{i}.block.{j}", c, w)
            c = w
        if i < 4:
            _conv(s, f"encoder.down.{i}.downsample.conv", c, c, 3)
    _mid(s, "encoder.mid", 512)
    _gn(s, "encoder.norm_out", 512)
    _conv(s, "encoder.conv_out", 256, 512, 3)
    _conv(s, "decoder.conv_in", 512, 256, 3)
    _mid(s, "decoder.mid", 512)
    for i in (4, 3, 2, 1, 0):
        for j in range(3):
            _resnet(s, f"decoder.up.{i}.block.{j}", c, widths[i])
            c = widths[i]
        if i > 0:
            _conv(s, f"decoder.up.{i}.upsample.conv", c, c, 3)
    _gn(s, "decoder.norm_out", 128)
    _conv(s, "decoder.conv_out", 3, 128, 3)
    s["quantize.embedding.weight"] = (8192, 256)
    _conv(s, "quant_conv", 256, 256, 1)
    _conv(s, "post_quant_conv", 256, 256, 1)
    return s


def _meta_shapes(module: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in module.state_dict().items()}


def test_release_config_builds_the_original_key_layout() -> None:
    with torch.device("meta"):
        model = ChameleonVQGAN(ChameleonVQConfig())
    shapes = _meta_shapes(model)
    assert shapes == _release_shapes()
    counts = {p: sum(k.startswith(p) for k in shapes) for p in ("encoder.", "decoder.", "quantize.", "quant_conv.",
                                                                  "post_quant_conv.")}
    assert counts == {"encoder.": 124, "decoder.": 164, "quantize.": 1, "quant_conv.": 2, "post_quant_conv.": 2}
    assert shapes["quantize.embedding.weight"] == (8192, 256)
    assert shapes["decoder.conv_in.weight"] == (512, 256, 3, 3)
    assert shapes["decoder.conv_out.weight"] == (3, 128, 3, 3)
    assert shapes["post_quant_conv.weight"] == (256, 256, 1, 1)
    assert shapes["decoder.up.3.block.0.nin_shortcut.weight"] == (256, 512, 1, 1)
    assert not any(".attn." in k for k in shapes)  # attn_resolutions = []: attention only in mid
    assert model.downsample_factor == 16 and 512 // model.downsample_factor == 32


def test_release_encoder_keys_equal_transformers() -> None:
    transformers = pytest.importorskip("transformers")
    with torch.device("meta"):
        hf = transformers.ChameleonVQVAE(transformers.ChameleonVQVAEConfig())
        ours = ChameleonVQGAN(ChameleonVQConfig())
    ours_shapes = {k: v for k, v in _meta_shapes(ours).items() if not k.startswith("decoder.")}
    assert ours_shapes == _meta_shapes(hf)


# ------------------------------------------------------------------------------------------
# 3. from_checkpoint
# ------------------------------------------------------------------------------------------


def _write_release(folder: Path, state: dict, extra: dict | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vqgan.yaml").write_text(TINY_YAML)
    ckpt = folder / "vqgan.ckpt"
    torch.save({"state_dict": state, "epoch": 3, "global_step": 1000, **(extra or {})}, ckpt)
    return ckpt


def _lightning_state(model: ChameleonVQGAN) -> dict:
    return {**model.state_dict(), "loss.discriminator.main.0.weight": torch.randn(4, 3, 4, 4),
            "loss.perceptual_loss.lin0.model.1.weight": torch.randn(1, 64, 1, 1)}


def test_from_checkpoint_round_trip(tiny: ChameleonVQGAN, tmp_path: Path) -> None:
    ckpt = _write_release(tmp_path / "plain", _lightning_state(tiny))
    loaded = ChameleonVQGAN.from_checkpoint(ckpt)
    assert loaded.config == TINY and not loaded.training
    codes = _codes()
    assert torch.equal(loaded.decode(codes), tiny.decode(codes))
    assert torch.equal(loaded.encode(_images()), tiny.encode(_images()))


def test_from_checkpoint_reads_lightning_callbacks_without_lightning(tiny: ChameleonVQGAN, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # A Lightning file pickles ModelCheckpoint (as a dict key before Lightning 1.5, else as an object) and
    # an AttributeDict of hyper-parameters: allowed by name, rebuilt inert, without pytorch_lightning.
    callback = fake_class("pytorch_lightning.callbacks.model_checkpoint", "ModelCheckpoint")
    hparams = type("AttributeDict", (dict,), {"__module__": "pytorch_lightning.utilities.parsing"})
    extra = {"callbacks": {callback: {"best_model_score": torch.tensor(0.5)}}, "objects": [callback()],
             "hyper_parameters": hparams(embed_dim=8), "pytorch-lightning_version": "1.4.2"}
    ckpt = save_with_fake_modules([callback, hparams], lambda: _write_release(tmp_path / "l", _lightning_state(tiny),
                                                                                extra), monkeypatch)
    loaded = ChameleonVQGAN.from_checkpoint(ckpt, dtype=torch.float64)
    assert loaded.quant_conv.weight.dtype == torch.float64
    codes = _codes()
    torch.testing.assert_close(loaded.decode(codes).float(), tiny.decode(codes), rtol=1e-4, atol=1e-5)


def test_from_checkpoint_refuses_other_classes_unless_trusted(tiny: ChameleonVQGAN, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    other = fake_class("fake_lightning_callbacks", "ModelCheckpoint")
    ckpt = save_with_fake_modules([other], lambda: _write_release(tmp_path / "l", _lightning_state(tiny),
                                                                    {"callbacks": [other()]}), monkeypatch)
    with pytest.raises(LanternError, match=r"vqgan\.ckpt contains a pickled fake_lightning_callbacks\."
                                           r"ModelCheckpoint.*--trust-checkpoint"):
        ChameleonVQGAN.from_checkpoint(ckpt)
    with pytest.warns(LanternWarning, match="full unpickler"):
        loaded = ChameleonVQGAN.from_checkpoint(ckpt, trust_checkpoint=True)
    assert torch.equal(loaded.decode(_codes()), tiny.decode(_codes()))


def test_from_checkpoint_missing_files(tiny: ChameleonVQGAN, tmp_path: Path) -> None:
    with pytest.raises(LanternError, match="VQGAN checkpoint not found: .*nope.ckpt"):
        ChameleonVQGAN.from_checkpoint(tmp_path / "nope.ckpt")
    ckpt = tmp_path / "alone" / "vqgan.ckpt"
    ckpt.parent.mkdir()
    torch.save({"state_dict": tiny.state_dict()}, ckpt)
    with pytest.raises(LanternError, match=r"VQGAN config not found: .*alone.vqgan.yaml \(Chameleon.s release keeps "
                                           r"vqgan.yaml beside vqgan.ckpt, in tokenizer/: copy it there\)$"):
        ChameleonVQGAN.from_checkpoint(ckpt)
    with pytest.raises(LanternError, match="VQGAN config not found: .*other.yaml"):
        ChameleonVQGAN.from_checkpoint(ckpt, config_path=tmp_path / "other.yaml")


def test_from_checkpoint_names_bad_keys_and_shapes(tiny: ChameleonVQGAN, tmp_path: Path) -> None:
    state = _lightning_state(tiny)
    missing = dict(state)
    del missing["decoder.up.1.attn.0.q.weight"]
    with pytest.raises(CheckpointError, match=r"missing keys: decoder\.up\.1\.attn\.0\.q\.weight"):
        ChameleonVQGAN.from_checkpoint(_write_release(tmp_path / "missing", missing))
    extra = {**state, "decoder.up.0.attn.0.q.weight": torch.zeros(32, 32, 1, 1)}
    with pytest.raises(CheckpointError, match=r"unexpected keys: decoder\.up\.0\.attn\.0\.q\.weight"):
        ChameleonVQGAN.from_checkpoint(_write_release(tmp_path / "extra", extra))
    wrong = {**state, "quantize.embedding.weight": torch.zeros(17, 8)}
    with pytest.raises(CheckpointError, match=r"quantize\.embedding\.weight \(checkpoint \(17, 8\), model \(16, 8\)\)"):
        ChameleonVQGAN.from_checkpoint(_write_release(tmp_path / "wrong", wrong))


def test_checkpoint_without_state_dict_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="no 'state_dict'.*top-level keys: epoch"):
        extract_model_state({"epoch": 3, "optimizer_states": []})


def test_yaml_config_parsing_and_errors(tmp_path: Path) -> None:
    pytest.importorskip("yaml")
    good = tmp_path / "vqgan.yaml"
    good.write_text(TINY_YAML)
    assert ChameleonVQConfig.from_yaml(good) == TINY
    bad = tmp_path / "bad.yaml"
    bad.write_text(TINY_YAML.replace("      num_res_blocks: 1\n", ""))
    with pytest.raises(LanternError, match="lacks num_res_blocks"):
        ChameleonVQConfig.from_yaml(bad)
    bad.write_text(TINY_YAML.replace("double_z: false", "double_z: true"))
    with pytest.raises(LanternError, match="double_z must be false"):
        ChameleonVQConfig.from_yaml(bad)
    bad.write_text(TINY_YAML.replace("dropout: 0.0", "dropout: 0.0\n      tanh_out: true"))
    with pytest.raises(LanternError, match="tanh_out=True is not supported"):
        ChameleonVQConfig.from_yaml(bad)
    with pytest.raises(LanternError, match=r"ch \* ch_mult\[0\] = 48 must be divisible by 32"):
        ChameleonVQConfig(ch=48)
    assert ChameleonVQConfig.from_dict(TINY.to_dict()) == TINY


# ------------------------------------------------------------------------------------------
# 4. Decoding
# ------------------------------------------------------------------------------------------


def test_decode_shapes_and_determinism(tiny: ChameleonVQGAN) -> None:
    codes = _codes(2, 16)
    images = tiny.decode(codes)
    assert images.shape == (2, 3, 8, 8) and images.dtype == torch.float32
    assert torch.equal(images, tiny.decode(codes.clone()))
    other = codes.clone()
    other[:, 5] = (other[:, 5] + 1) % TINY.n_embed
    assert not torch.allclose(tiny.decode(other), images)
    grid = tiny.decode_grid(_codes(1, 6), 2, 3)
    assert grid.shape == (1, 3, 4, 6)


def test_embed_codes_is_raster_order(tiny: ChameleonVQGAN) -> None:
    codes = _codes(1, 6)
    z = tiny.embed_codes(codes, 2, 3)
    assert z.shape == (1, TINY.embed_dim, 2, 3)
    for r in range(2):
        for c in range(3):
            assert torch.equal(z[0, :, r, c], tiny.codebook()[codes[0, r * 3 + c]])


def test_bad_codes_are_rejected(tiny: ChameleonVQGAN) -> None:
    with pytest.raises(LanternError, match=r"codes must be in \[0, 16\), got range \[0, 16\]"):
        tiny.decode(torch.tensor([[0] * 15 + [16]]))
    with pytest.raises(LanternError, match=r"codes must be in \[0, 16\), got range \[-1, 3\]"):
        tiny.decode(torch.tensor([[-1, 3, 2, 1]]))
    with pytest.raises(LanternError, match="N = 8 is not a perfect square"):
        tiny.decode(_codes(1, 8))
    with pytest.raises(LanternError, match="a 2 x 3 grid needs 6 codes per row, got N = 8"):
        tiny.decode_grid(_codes(1, 8), 2, 3)
    with pytest.raises(LanternError, match="integer tensor"):
        tiny.decode(torch.zeros(1, 4))
    with pytest.raises(LanternError, match="multiples of 2"):
        tiny.encode(torch.zeros(1, 3, 15, 16))


def test_to_pil_truncates_like_chameleon() -> None:
    x = torch.full((1, 3, 2, 2), 0.999)  # (1.999 / 2) * 255 = 254.87 -> 254 (truncated, not rounded)
    x[0, 0, 0, 0], x[0, 1, 0, 0] = 5.0, -5.0  # clamped to 255 and 0
    (img,) = to_pil(x)
    assert img.mode == "RGB" and img.size == (2, 2)
    assert img.getpixel((1, 1)) == (254, 254, 254)
    assert img.getpixel((0, 0)) == (255, 0, 254)
