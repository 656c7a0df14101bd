"""Chameleon's VQGAN image tokenizer (encoder, quantizer *and decoder*), loading Meta's original files.

transformers' ``ChameleonVQVAE`` ships only the encoder and quantizer, so generated image codes of
Chameleon, Anole and Lumina-mGPT cannot become pixels with it. This module re-implements the
"Make-a-Scene" / taming-transformers VQGAN that Meta released as ``tokenizer/vqgan.ckpt`` +
``tokenizer/vqgan.yaml``, with submodule names equal to the checkpoint's keys so the original
``state_dict`` loads with ``strict=True`` (after dropping training-only keys).

Facts and where they come from:

* Architecture and key names -- ``facebookresearch/chameleon`` ``chameleon/inference/vqgan.py``
  (header: "taken from taming-transformers ... taming/models/vqgan.py"); the same file is
  ``Alpha-VLLM/Lumina-mGPT`` ``lumina_mgpt/model/chameleon_vae_ori/vqgan.py`` (Anole reuses
  Chameleon's ``chameleon/inference`` code). ``VQModel`` holds ``encoder``, ``decoder``,
  ``quantize`` (``VectorQuantizer2``: ``quantize.embedding`` = ``nn.Embedding(n_embed, embed_dim)``,
  init uniform(-1/n_embed, 1/n_embed)), ``quant_conv`` (1x1, z_channels -> embed_dim) and
  ``post_quant_conv`` (1x1, embed_dim -> z_channels). ``Encoder``: ``conv_in``,
  ``down.{i}.block.{j}`` (``num_res_blocks`` per level), ``down.{i}.attn.{j}`` (only where the
  current resolution is in ``attn_resolutions``), ``down.{i}.downsample.conv`` (all but the last
  level; pad right/bottom by 1 then 3x3 stride 2), ``mid.block_1 / attn_1 / block_2`` (``attn_1``
  always present), ``norm_out``, ``conv_out``. ``Decoder``: ``conv_in``, the same ``mid``,
  ``up.{i}.block.{j}`` (``num_res_blocks + 1`` per level, run from the deepest level ``i = L-1``
  down to 0), ``up.{i}.attn.{j}``, ``up.{i}.upsample.conv`` (all levels but 0; nearest x2 then
  3x3), ``norm_out``, ``conv_out``. ``ResnetBlock``: ``norm1, conv1, norm2, conv2`` and a 1x1
  ``nin_shortcut`` only when channels change (no ``temb_proj``: ``temb_ch = 0``). ``AttnBlock``:
  ``norm, q, k, v, proj_out`` (single head, softmax(q k^T / sqrt(C))). GroupNorm: 32 groups,
  eps 1e-6, affine; nonlinearity x * sigmoid(x). The decoder output is not squashed (no tanh).
* Decode path -- same file: ``quantize.get_codebook_entry(codes, (B, h, w, D))`` =
  embedding lookup, view ``[B, h, w, D]``, permute to ``[B, D, h, w]``; then ``post_quant_conv``
  then ``decoder`` -> image in ~[-1, 1]. Codes are raster order (``min_encoding_indices`` of the
  ``[B, h, w, D]``-permuted latents).
* Pixels -- ``chameleon/inference/image_tokenizer.py`` (also Lumina-mGPT's copy):
  ``_pil_from_chw_tensor`` does ``(clamp(x, -1, 1) + 1) / 2 * 255`` then ``astype(uint8)``
  (truncation, not rounding); :func:`to_pil` reproduces that. Inputs are ``x / 255 * 2 - 1``.
  ``pil_from_img_toks`` decodes a 32 x 32 grid (Chameleon/Anole, 512 px); Lumina-mGPT passes
  ``h_latent_dim, w_latent_dim`` for non-square grids (:meth:`ChameleonVQGAN.decode_grid`).
* Config file -- ``image_tokenizer.py`` reads ``yaml.safe_load(f)["model"]["params"]`` and deletes
  ``lossconfig``; the transformers conversion script (``convert_chameleon_weights_to_hf.py``, copy
  in Lumina-mGPT ``lumina_mgpt/model/chameleon/``) flattens ``params["ddconfig"]`` and drops
  ``ckpt_path`` and ``lossconfig``, renaming ch->base_channels, out_ch->out_channels,
  n_embed->num_embeddings, ch_mult->channel_multiplier, double_z->double_latent,
  z_channels->latent_channels. So ``params`` = ``{embed_dim, n_embed, ddconfig, lossconfig,
  ckpt_path, ...}`` and ``ddconfig`` = ``{double_z, z_channels, resolution, in_channels, out_ch,
  ch, ch_mult, num_res_blocks, attn_resolutions, dropout}``.
* Real sizes -- the converted config of the released VQGAN (Hugging Face
  ``leloy/Anole-7b-v0.1-vqvae-hf/config.json``, which keeps the yaml's own names beside the
  renamed ones; ``sihwanpark/LANTERN-Lumina-mGPT-7B-768`` ``vq_config`` agrees): embed_dim 256,
  n_embed 8192, double_z false, z_channels 256, resolution 512, in_channels 3, out_ch 3, ch 128,
  ch_mult [1, 1, 2, 2, 4], num_res_blocks 2, attn_resolutions [] (attention only in ``mid``),
  dropout 0.0 -> 16x downsampling, 512 px <-> 32 x 32 = 1024 codes. transformers'
  ``ChameleonVQVAEConfig`` defaults match (``attn_resolutions=None`` builds the same modules).
* Checkpoint -- a PyTorch-Lightning checkpoint: the weights are under ``["state_dict"]``
  (``VQModel.init_from_ckpt`` and the conversion script both read that key). Taming's training
  ``VQModel`` also registers ``self.loss`` (LPIPS + discriminator), so ``loss.*`` keys are
  expected there and are dropped here; the reference loaders use ``strict=False`` and the
  conversion script copies every key not containing "decoder", so the exact extra keys in Meta's
  file are not visible from public code -- anything else unexpected is reported, not ignored.
* transformers mapping -- the conversion script stores ``model.vqmodel.{k}`` for every original
  key except decoder keys: identity names for ``encoder.*``, ``quantize.embedding.weight``,
  ``quant_conv.*``, ``post_quant_conv.*`` (:func:`to_transformers_state`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, TypeGuard

import torch
import torch.nn.functional as F
from PIL import Image
from torch import Tensor, nn

from lantern.errors import CheckpointError, LanternError, check
from lantern.io import load_checkpoint, load_state_dict_strict
from lantern.models import vq as vq_blocks
from lantern.models.vq import Downsample, Upsample, _conv1, _conv3

if TYPE_CHECKING:
    from transformers import ChameleonVQVAEConfig

# GroupNorm settings hard-coded in taming's ``Normalize`` (and so in Meta's checkpoint).
NORM_GROUPS = 32
NORM_EPS = 1e-6
DEFAULT_CONFIG_NAME = "vqgan.yaml"
# Training-only entries of a taming ``VQModel`` state dict (perceptual loss + discriminator).
IGNORED_PREFIXES: tuple[str, ...] = ("loss.",)
# Top-level submodules whose keys transformers' ``ChameleonVQVAE`` also has (no decoder).
_TRANSFORMERS_PREFIXES = ("encoder.", "quantize.", "quant_conv.", "post_quant_conv.")


# --------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------

_POSITIVE_INT_FIELDS = ("embed_dim", "n_embed", "z_channels", "resolution", "in_channels", "out_ch",
                        "ch", "num_res_blocks")
_TOP_LEVEL_FIELDS = ("embed_dim", "n_embed")
# taming ``Encoder``/``Decoder`` options absent from Chameleon's yaml; accepted only at these
# defaults because the modules here implement exactly that behaviour.
_TAMING_DEFAULTS: dict[str, Any] = {"resamp_with_conv": True, "give_pre_end": False, "tanh_out": False,
                                    "use_linear_attn": False, "attn_type": "vanilla"}


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _as_tuple(value: Any) -> Any:
    # yaml and JSON give lists; tuples keep the frozen config hashable.
    return tuple(value) if isinstance(value, list | tuple) else value


@dataclass(frozen=True)
class ChameleonVQConfig(vq_blocks.VQGANShape):
    """The ``vqgan.yaml`` fields (``embed_dim``, ``n_embed`` and ``ddconfig``); defaults = Meta's release."""

    CONFIG_NAME: ClassVar[str] = "VQGAN config"

    embed_dim: int = 256
    n_embed: int = 8192
    double_z: bool = False
    resolution: int = 512
    out_ch: int = 3
    attn_resolutions: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "ch_mult", _as_tuple(self.ch_mult))
        object.__setattr__(self, "attn_resolutions", _as_tuple(self.attn_resolutions))
        for name in _POSITIVE_INT_FIELDS:
            value = getattr(self, name)
            check(_is_int(value) and value >= 1, f"ChameleonVQConfig.{name} must be an integer >= 1, got {value!r}")
        # double_z is the KL-autoencoder layout (mean + log-variance); quant_conv expects z_channels.
        check(self.double_z is False,
              f"ChameleonVQConfig.double_z must be false for a VQGAN, got {self.double_z!r}")
        self._check_int_tuple("ch_mult", allow_empty=False)
        self._check_int_tuple("attn_resolutions", allow_empty=True)
        check(isinstance(self.dropout, int | float) and not isinstance(self.dropout, bool)
              and 0.0 <= self.dropout < 1.0, f"ChameleonVQConfig.dropout must be in [0, 1), got {self.dropout!r}")
        for i, m in enumerate(self.ch_mult):
            check(self.ch * m % NORM_GROUPS == 0,
                  f"ChameleonVQConfig: ch * ch_mult[{i}] = {self.ch * m} must be divisible by {NORM_GROUPS} "
                  f"(the VQGAN's GroupNorm uses {NORM_GROUPS} groups)")
        f = self.downsample_factor
        check(self.resolution % f == 0,
              f"ChameleonVQConfig.resolution ({self.resolution}) must be a multiple of the downsample factor {f}")

    def _check_int_tuple(self, name: str, allow_empty: bool) -> None:
        value = getattr(self, name)
        ok = isinstance(value, tuple) and (allow_empty or len(value) > 0)
        check(ok and all(_is_int(v) and v >= 1 for v in value),
              f"ChameleonVQConfig.{name} must be a {'' if allow_empty else 'non-empty '}list of integers >= 1, "
              f"got {value!r}")

    @property
    def downsample_factor(self) -> int:
        """Image pixels per code along each side (16 for the released VQGAN)."""
        return 2 ** (len(self.ch_mult) - 1)

    @classmethod
    def from_yaml_dict(cls, obj: Any, source: str = "VQGAN config") -> ChameleonVQConfig:
        """Build from the parsed original layout ``{model: {params: {embed_dim, n_embed, ddconfig}}}``."""
        params = _get_mapping(obj, ("model", "params"), source)
        ddconfig = _get_mapping(params, ("ddconfig",), f"{source} model.params")
        flat = {name: params[name] for name in _TOP_LEVEL_FIELDS if name in params}
        dd_fields = [f.name for f in fields(cls) if f.name not in _TOP_LEVEL_FIELDS]
        _check_taming_options(ddconfig, set(dd_fields), source)
        flat.update({name: ddconfig[name] for name in dd_fields if name in ddconfig})
        missing = [f.name for f in fields(cls) if f.name not in flat]
        check(not missing, f"{source} lacks {', '.join(missing)} (expected under model.params: embed_dim, "
                           f"n_embed; under model.params.ddconfig: {', '.join(dd_fields)})")
        return cls(**flat)

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str]) -> ChameleonVQConfig:
        """Read Chameleon's ``tokenizer/vqgan.yaml`` (needs PyYAML)."""
        path = Path(path)
        check(path.is_file(), f"VQGAN config not found: {path} (expected Chameleon's tokenizer/vqgan.yaml)")
        try:
            import yaml
        except ImportError:
            raise LanternError(f"reading {path} needs PyYAML: pip install pyyaml") from None
        try:
            obj = yaml.safe_load(path.read_text())
        except (yaml.YAMLError, UnicodeDecodeError) as e:
            raise LanternError(f"VQGAN config {path} is not valid YAML: {e}") from None
        return cls.from_yaml_dict(obj, f"VQGAN config {path}")


def _get_mapping(obj: Any, keys: tuple[str, ...], source: str) -> Mapping[str, Any]:
    for depth, key in enumerate(keys):
        where = ".".join(keys[:depth]) or "top level"
        check(isinstance(obj, Mapping) and key in obj, f"{source} has no '{key}' mapping at {where}")
        obj = obj[key]
    check(isinstance(obj, Mapping), f"{source}: '{'.'.join(keys)}' must be a mapping, got {type(obj).__name__}")
    return obj


def _check_taming_options(ddconfig: Mapping[str, Any], known: set[str], source: str) -> None:
    unknown = sorted(k for k in ddconfig if k not in known and k not in _TAMING_DEFAULTS)
    check(not unknown, f"{source}: unknown ddconfig keys {', '.join(unknown)}")
    changed = sorted(k for k, v in _TAMING_DEFAULTS.items() if k in ddconfig and ddconfig[k] != v)
    got = ", ".join(f"{k}={ddconfig[k]!r}" for k in changed)
    want = ", ".join(f"{k}={_TAMING_DEFAULTS[k]!r}" for k in changed)
    check(not changed, f"{source}: ddconfig {got} is not supported (Chameleon's VQGAN uses {want})")


# --------------------------------------------------------------------------------------------
# Building blocks (attribute names are the original checkpoint's key names)
# --------------------------------------------------------------------------------------------


# The taming building blocks (same parameter names, GroupNorm eps 1e-6) are LlamaGen's VQ's; the
# Chameleon VQGAN always uses 32 norm groups.


def _norm(channels: int) -> nn.GroupNorm:
    return vq_blocks._norm(channels, NORM_GROUPS)


def _resnet(c_in: int, c_out: int, dropout: float) -> vq_blocks.ResnetBlock:
    return vq_blocks.ResnetBlock(c_in, c_out, NORM_GROUPS, dropout)


def _attn(channels: int) -> vq_blocks.AttnBlock:
    return vq_blocks.AttnBlock(channels, NORM_GROUPS)


class _Level(nn.Module):
    """One resolution level: ``block`` (res blocks), ``attn`` (one per block or none), resampler."""

    def __init__(self, c_in: int, c_out: int, n_blocks: int, with_attn: bool, resample: str | None,
                 dropout: float) -> None:
        super().__init__()
        chans = [c_in] + [c_out] * n_blocks
        self.block = nn.ModuleList(_resnet(chans[i], chans[i + 1], dropout) for i in range(n_blocks))
        self.attn = nn.ModuleList(_attn(c_out) for _ in range(n_blocks if with_attn else 0))
        if resample == "down":
            self.downsample = Downsample(c_out)
        elif resample == "up":
            self.upsample = Upsample(c_out)

    def forward(self, x: Tensor) -> Tensor:
        return vq_blocks.run_level(self, self.block, x)


class _Mid(nn.Module):
    """``block_1 -> attn_1 -> block_2`` at the lowest resolution (attention always present)."""

    def __init__(self, channels: int, dropout: float) -> None:
        super().__init__()
        self.block_1 = _resnet(channels, channels, dropout)
        self.attn_1 = _attn(channels)
        self.block_2 = _resnet(channels, channels, dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.block_2(self.attn_1(self.block_1(x)))


class Encoder(nn.Module):
    """Image ``[B, in_channels, H, W]`` -> latent ``[B, z_channels, H/f, W/f]``."""

    def __init__(self, cfg: ChameleonVQConfig) -> None:
        super().__init__()
        widths = [cfg.ch * m for m in cfg.ch_mult]
        last = len(widths) - 1
        self.conv_in = _conv3(cfg.in_channels, cfg.ch)
        self.down = nn.ModuleList()
        c_in, res = cfg.ch, cfg.resolution
        for i, c_out in enumerate(widths):
            self.down.append(_Level(c_in, c_out, cfg.num_res_blocks, res in cfg.attn_resolutions,
                                    "down" if i != last else None, cfg.dropout))
            c_in, res = c_out, (res // 2 if i != last else res)
        self.mid = _Mid(c_in, cfg.dropout)
        self.norm_out = _norm(c_in)
        self.conv_out = _conv3(c_in, cfg.z_channels)

    def forward(self, x: Tensor) -> Tensor:
        h = self.conv_in(x)
        for level in self.down:
            h = level(h)
        return self.conv_out(F.silu(self.norm_out(self.mid(h))))


class Decoder(nn.Module):
    """Latent ``[B, z_channels, h, w]`` -> image ``[B, out_ch, f*h, f*w]`` (not clamped).

    ``up[i]`` is level ``i`` as in the checkpoint (``up[0]`` is full resolution); they run from
    ``up[L-1]`` down to ``up[0]``, and attention placement follows the resolution a
    ``resolution``-pixel image would have at that level.
    """

    def __init__(self, cfg: ChameleonVQConfig) -> None:
        super().__init__()
        widths = [cfg.ch * m for m in cfg.ch_mult]
        c_in, res = widths[-1], cfg.resolution // cfg.downsample_factor
        self.conv_in = _conv3(cfg.z_channels, c_in)
        self.mid = _Mid(c_in, cfg.dropout)
        levels: list[_Level] = []
        for i in reversed(range(len(widths))):
            levels.append(_Level(c_in, widths[i], cfg.num_res_blocks + 1, res in cfg.attn_resolutions,
                                 "up" if i != 0 else None, cfg.dropout))
            c_in, res = widths[i], (res * 2 if i != 0 else res)
        self.up = nn.ModuleList(reversed(levels))
        self.norm_out = _norm(c_in)
        self.conv_out = _conv3(c_in, cfg.out_ch)

    def forward(self, z: Tensor) -> Tensor:
        h = self.mid(self.conv_in(z))
        for level in reversed(self.up):
            h = level(h)
        return self.conv_out(F.silu(self.norm_out(h)))


class VectorQuantizer(nn.Module):
    """Nearest codebook vector by squared L2 distance (taming's ``VectorQuantizer2``, no remap)."""

    def __init__(self, n_embed: int, embed_dim: int) -> None:
        super().__init__()
        self.embedding = nn.Embedding(n_embed, embed_dim)
        nn.init.uniform_(self.embedding.weight, -1.0 / n_embed, 1.0 / n_embed)  # taming's init

    def nearest(self, vectors: Tensor) -> Tensor:  # [M, D] -> [M] int64
        """Argmin of ``|z|^2 + |e|^2 - 2 z.e`` (the original expansion, so the same ties), in float32."""
        return vq_blocks.nearest_codes(vectors, self.embedding.weight)


# --------------------------------------------------------------------------------------------
# The tokenizer
# --------------------------------------------------------------------------------------------


class ChameleonVQGAN(nn.Module):
    """Chameleon's VQGAN: ``encode`` images to raster-order codes, ``decode`` codes to images."""

    def __init__(self, config: ChameleonVQConfig | None = None) -> None:
        super().__init__()
        self.config = cfg = config if config is not None else ChameleonVQConfig()
        self.encoder, self.decoder = Encoder(cfg), Decoder(cfg)
        self.quantize = VectorQuantizer(cfg.n_embed, cfg.embed_dim)
        self.quant_conv = _conv1(cfg.z_channels, cfg.embed_dim)
        self.post_quant_conv = _conv1(cfg.embed_dim, cfg.z_channels)
        self.eval()  # a frozen tokenizer; dropout is 0 in the release anyway

    @property
    def downsample_factor(self) -> int:
        return self.config.downsample_factor

    @property
    def _weight(self) -> Tensor:  # device and dtype of the model
        return self.quant_conv.weight

    # ---- encoding -----------------------------------------------------------------------

    def encode_latents(self, images: Tensor) -> Tensor:  # [B, 3, H, W] -> [B, D, H/f, W/f]
        """Continuous latents after ``quant_conv`` (what the quantizer snaps to the codebook)."""
        self._check_images(images)
        return self.quant_conv(self.encoder(images.to(self._weight)))

    def quantize_latents(self, z: Tensor) -> tuple[Tensor, Tensor]:
        """``z [B, D, h, w]`` -> ``(zq [B, D, h, w], codes [B, h*w])``, codes in raster order."""
        b, d, h, w = z.shape
        codes = self.quantize.nearest(z.permute(0, 2, 3, 1).reshape(b * h * w, d)).reshape(b, h * w)
        return self._lookup(codes, h, w).to(z.dtype), codes

    @torch.no_grad()
    def encode(self, images: Tensor) -> Tensor:  # [B, 3, H, W] in [-1, 1] -> [B, h*w] int64
        """Codebook indices of a batch of images, row-major over the ``H/f x W/f`` grid."""
        return self.quantize_latents(self.encode_latents(images))[1]

    # ---- decoding -----------------------------------------------------------------------

    def codebook(self) -> Tensor:  # [V, D]
        """The raw codebook ``quantize.embedding.weight`` (Chameleon does not normalise it)."""
        return self.quantize.embedding.weight

    def embed_codes(self, codes: Tensor, h: int | None = None, w: int | None = None) -> Tensor:
        """``codes [B, h*w]`` -> latents ``[B, D, h, w]``; a square grid when ``h, w`` are omitted."""
        h, w = self._check_codes(codes, h, w)
        return self._lookup(codes, h, w)

    def _lookup(self, codes: Tensor, h: int, w: int) -> Tensor:  # [B, h*w] -> [B, D, h, w]
        vectors = self.codebook()[codes.reshape(-1).to(self._weight.device)]  # [B*h*w, D]
        return vectors.reshape(codes.shape[0], h, w, -1).permute(0, 3, 1, 2).contiguous()

    def decode_latents(self, zq: Tensor) -> Tensor:  # [B, D, h, w] -> [B, 3, f*h, f*w]
        """``post_quant_conv`` then the decoder (differentiable)."""
        return self.decoder(self.post_quant_conv(zq.to(self._weight)))

    @torch.no_grad()
    def decode(self, codes: Tensor) -> Tensor:  # [B, g*g] -> [B, 3, f*g, f*g] in ~[-1, 1]
        """Images for square grids of codes (N = g*g, raster order); not clamped."""
        return self.decode_latents(self.embed_codes(codes))

    @torch.no_grad()
    def decode_grid(self, codes: Tensor, h: int, w: int) -> Tensor:  # [B, h*w] -> [B, 3, f*h, f*w]
        """Images for ``h x w`` grids of codes (Lumina-mGPT's non-square sizes)."""
        return self.decode_latents(self.embed_codes(codes, h, w))

    # ---- checks -------------------------------------------------------------------------

    def _check_images(self, images: Tensor) -> None:
        c, f = self.config.in_channels, self.downsample_factor
        check(images.ndim == 4 and images.shape[1] == c, f"images must be [B, {c}, H, W], got {tuple(images.shape)}")
        check(images.shape[2] % f == 0 and images.shape[3] % f == 0,
              f"image height and width must be multiples of {f}, got {tuple(images.shape[2:])}")

    def _check_codes(self, codes: Tensor, h: int | None, w: int | None) -> tuple[int, int]:
        """Validate ``codes [B, N]`` and return the grid ``(h, w)`` with ``h * w == N``."""
        check(isinstance(codes, Tensor) and codes.ndim == 2, f"codes must be [B, N], got shape "
              f"{tuple(codes.shape) if isinstance(codes, Tensor) else type(codes).__name__}")
        check(not codes.is_floating_point() and not codes.is_complex() and codes.dtype != torch.bool,
              f"codes must be an integer tensor, got {codes.dtype}")
        n = codes.shape[1]
        h, w = self._grid(n, h, w)
        if codes.numel() > 0:
            lo, hi, size = int(codes.min()), int(codes.max()), self.config.n_embed
            check(lo >= 0 and hi < size, f"codes must be in [0, {size}), got range [{lo}, {hi}]")
        return h, w

    @staticmethod
    def _grid(n: int, h: int | None, w: int | None) -> tuple[int, int]:
        if h is None and w is None:
            g = math.isqrt(n)
            check(n > 0 and g * g == n, f"decode needs a square grid of codes; N = {n} is not a perfect square "
                                        f"(use decode_grid(codes, h, w) for an h x w grid)")
            return g, g
        check(_is_int(h) and _is_int(w) and h >= 1 and w >= 1,
              f"grid height and width must be integers >= 1, got h={h!r}, w={w!r}")
        assert h is not None and w is not None
        check(h * w == n, f"a {h} x {w} grid needs {h * w} codes per row, got N = {n}")
        return h, w

    # ---- files --------------------------------------------------------------------------

    @classmethod
    def from_checkpoint(cls, ckpt_path: str | os.PathLike[str], config_path: str | os.PathLike[str] | None = None,
                        dtype: torch.dtype | None = None,
                        ignore_prefixes: tuple[str, ...] = IGNORED_PREFIXES, *,
                        trust_checkpoint: bool | None = None) -> ChameleonVQGAN:
        """Load Meta's ``vqgan.ckpt`` with its ``vqgan.yaml`` (default: ``vqgan.yaml`` beside the ckpt).

        Keys starting with ``ignore_prefixes`` (training losses) are dropped; every other key must
        match the model exactly in name and shape (:class:`~lantern.errors.CheckpointError`).
        ``trust_checkpoint``: see :func:`read_checkpoint`.
        """
        ckpt_path = Path(ckpt_path)
        check(ckpt_path.is_file(),
              f"VQGAN checkpoint not found: {ckpt_path} (expected Chameleon's tokenizer/vqgan.ckpt)")
        if config_path is None:
            config_path = ckpt_path.with_name(DEFAULT_CONFIG_NAME)
            check(config_path.is_file(), f"VQGAN config not found: {config_path} (Chameleon's release keeps "
                                         f"{DEFAULT_CONFIG_NAME} beside {ckpt_path.name}, in tokenizer/: copy it "
                                         "there)")
        cfg = ChameleonVQConfig.from_yaml(config_path)
        source = f"VQGAN checkpoint {ckpt_path}"
        state = extract_model_state(read_checkpoint(ckpt_path, trust_checkpoint), ignore_prefixes, source)
        model = cls._empty(cfg)
        load_state_dict_strict(model, state, source)
        if dtype is not None:
            model.to(dtype)
        return model.eval()

    @classmethod
    def _empty(cls, config: ChameleonVQConfig) -> ChameleonVQGAN:
        return vq_blocks.empty_model(cls, config)


# --------------------------------------------------------------------------------------------
# Checkpoint reading
# --------------------------------------------------------------------------------------------


def read_checkpoint(path: str | os.PathLike[str], trust_checkpoint: bool | None = None) -> Any:
    """A (Lightning) VQGAN checkpoint on CPU, read by :func:`lantern.io.load_checkpoint`: tensors and
    Lightning's bookkeeping only, unless the user trusts the file (``--trust-checkpoint``)."""
    return load_checkpoint(path, "VQGAN checkpoint", trust=trust_checkpoint)


def extract_model_state(obj: Any, ignore_prefixes: tuple[str, ...] = IGNORED_PREFIXES,
                        source: str = "VQGAN checkpoint") -> dict[str, Tensor]:
    """The model tensors of a Lightning checkpoint (``obj["state_dict"]``) or of a raw state dict.

    Keys starting with any of ``ignore_prefixes`` are dropped.
    """
    check(isinstance(obj, Mapping), f"{source} holds a {type(obj).__name__}, expected a dict")
    state = obj["state_dict"] if "state_dict" in obj else obj
    if not isinstance(state, Mapping) or not state or not all(isinstance(v, Tensor) for v in state.values()):
        top = ", ".join(map(str, list(obj)[:10])) or "(empty)"
        raise CheckpointError(f"{source} has no 'state_dict' of tensors and is not a raw state dict; "
                              f"top-level keys: {top}")
    return {k: v for k, v in state.items() if not str(k).startswith(ignore_prefixes)}


# --------------------------------------------------------------------------------------------
# transformers interop (optional dependency, imported lazily)
# --------------------------------------------------------------------------------------------


def to_transformers_state(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Original keys -> transformers ``ChameleonVQVAE`` keys: same names, decoder (and losses) dropped."""
    out: dict[str, Tensor] = {}
    unknown: list[str] = []
    for key, value in state.items():
        if key.startswith(_TRANSFORMERS_PREFIXES):
            out[key] = value
        elif not key.startswith(("decoder.", *IGNORED_PREFIXES)):
            unknown.append(key)
    check(not unknown, f"state has keys that are neither VQGAN model nor training-loss keys: "
                       f"{', '.join(unknown[:5])}{' ...' if len(unknown) > 5 else ''}")
    return out


def config_to_transformers(cfg: ChameleonVQConfig) -> ChameleonVQVAEConfig:
    """The matching transformers ``ChameleonVQVAEConfig`` (field renames as in its conversion script)."""
    try:
        from transformers import ChameleonVQVAEConfig
    except ImportError:
        raise LanternError("config_to_transformers needs transformers: pip install transformers") from None
    return ChameleonVQVAEConfig(
        embed_dim=cfg.embed_dim,
        num_embeddings=cfg.n_embed,
        double_latent=cfg.double_z,
        latent_channels=cfg.z_channels,
        resolution=cfg.resolution,
        in_channels=cfg.in_channels,
        base_channels=cfg.ch,
        channel_multiplier=list(cfg.ch_mult),
        num_res_blocks=cfg.num_res_blocks,
        attn_resolutions=list(cfg.attn_resolutions),
        dropout=cfg.dropout,
        attn_type="vanilla",
    )


# --------------------------------------------------------------------------------------------
# Images
# --------------------------------------------------------------------------------------------


def to_pil(images: Tensor) -> list[Image.Image]:  # [B, 3, H, W] in ~[-1, 1]
    """RGB PIL images the way Chameleon's ``_pil_from_chw_tensor`` makes them: ``(clamp(x, -1, 1)
    + 1) / 2 * 255`` then a uint8 cast, which truncates (:func:`lantern.images.to_pil`)."""
    from lantern.images import to_pil as images_to_pil

    check(images.ndim == 4 and images.shape[1] == 3, f"images must be [B, 3, H, W], got {tuple(images.shape)}")
    return images_to_pil(images, "truncate")
