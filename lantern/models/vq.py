"""LlamaGen's VQ image tokenizer (VQ-16 / VQ-8), written to load the official checkpoints strictly.

The module tree mirrors ``FoundationVision/LlamaGen`` ``tokenizer/tokenizer_image/vq_model.py``
([LlamaGen code]) so that ``state_dict()`` keys are exactly the official ones: an official
``vq_ds16_*.pt`` file loads with ``strict=True`` and any drift in the architecture shows up as a
:class:`~lantern.errors.CheckpointError` naming the keys, not as silently wrong images.

Conventions that matter for correctness:

* Codes are row-major (raster) over the ``h x w`` latent grid, as LlamaGen's AR models emit them.
* With ``codebook_l2_norm`` the *stored* codebook is not unit norm: both the latents and the
  codebook are L2-normalised at use time (quantisation and lookup alike).
* Images are ``[B, 3, H, W]`` floats in ``[-1, 1]``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Protocol, TypeVar

import torch
import torch.nn.functional as F
from PIL import Image
from torch import Tensor, nn

from lantern.errors import CheckpointError, LanternError, check
from lantern.io import (
    CONFIG_NAME,
    DictConfig,
    config_of,
    load_checkpoint,
    load_model_folder,
    load_state_dict_strict,
    save_model_folder,
)

MODEL_TYPE = "lantern-vq"
# Length of the official ``quantize.codebook_used`` buffer (a rolling window of recent codes).
USAGE_WINDOW = 65536
# Absent from a checkpoint trained with LlamaGen's codebook_show_usage=False; decoding never reads it.
USAGE_KEY = "quantize.codebook_used"
COMMIT_LOSS_BETA = 0.25
NORM_EPS = 1e-6
# Largest distance block [rows, V] built at once while quantising (elements, float32).
_MAX_DISTANCE_ELEMENTS = 1 << 24
_M = TypeVar("_M", bound=nn.Module)
# Container keys tried in order by :func:`extract_state_dict` (the EMA copy is not preferred).
_STATE_DICT_KEYS = ("model", "state_dict")


# --------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------


_POSITIVE_INT_FIELDS = ("codebook_size", "codebook_embed_dim", "z_channels", "ch",
                        "num_res_blocks", "in_channels", "norm_groups")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class VQGANShape(DictConfig):
    """The convolutional shape every taming-style VQGAN here shares (LlamaGen's VQ, Chameleon's
    VQGAN): latent channels, base width, width multipliers per level, res blocks per level."""

    z_channels: int = 256
    ch: int = 128
    ch_mult: tuple[int, ...] = (1, 1, 2, 2, 4)
    num_res_blocks: int = 2
    in_channels: int = 3
    dropout: float = 0.0


@dataclass(frozen=True)
class VQConfig(VQGANShape):
    """Shape of a LlamaGen VQ tokenizer. Defaults are VQ-16 (16x downsampling, 16384 x 8 codes)."""

    CONFIG_NAME: ClassVar[str] = "VQ config"

    codebook_size: int = 16384
    codebook_embed_dim: int = 8
    codebook_l2_norm: bool = True
    norm_groups: int = 32

    def __post_init__(self) -> None:
        if isinstance(self.ch_mult, list | tuple):  # JSON gives lists; keep the config hashable
            object.__setattr__(self, "ch_mult", tuple(self.ch_mult))
        for name in _POSITIVE_INT_FIELDS:
            value = getattr(self, name)
            check(_is_int(value) and value >= 1,
                  f"VQConfig.{name} must be an integer >= 1, got {value!r}")
        check(isinstance(self.codebook_l2_norm, bool),
              f"VQConfig.codebook_l2_norm must be a bool, got {self.codebook_l2_norm!r}")
        check(isinstance(self.ch_mult, tuple) and len(self.ch_mult) > 0
              and all(_is_int(m) and m >= 1 for m in self.ch_mult),
              f"VQConfig.ch_mult must be a non-empty sequence of integers >= 1, "
              f"got {self.ch_mult!r}")
        check(self.ch % self.norm_groups == 0,
              f"VQConfig.ch ({self.ch}) must be divisible by VQConfig.norm_groups "
              f"({self.norm_groups}) so every GroupNorm splits its channels evenly")
        check(isinstance(self.dropout, int | float) and 0.0 <= self.dropout < 1.0,
              f"VQConfig.dropout must be in [0, 1), got {self.dropout!r}")

    @property
    def downsample_factor(self) -> int:
        """Image pixels per latent cell along each side (16 for VQ-16)."""
        return 2 ** (len(self.ch_mult) - 1)



VQ_CONFIGS: dict[str, VQConfig] = {
    "VQ-16": VQConfig(),
    "VQ-8": VQConfig(ch_mult=(1, 2, 2, 4)),
}


def vq_config(name: str) -> VQConfig:
    """The named LlamaGen tokenizer config (``VQ-16`` or ``VQ-8``)."""
    if name not in VQ_CONFIGS:
        raise LanternError(f"unknown VQ config {name!r}; known: {', '.join(VQ_CONFIGS)}")
    return VQ_CONFIGS[name]


# --------------------------------------------------------------------------------------------
# Building blocks (attribute names are the official checkpoint key names)
# --------------------------------------------------------------------------------------------


def _norm(channels: int, groups: int) -> nn.GroupNorm:
    return nn.GroupNorm(groups, channels, eps=NORM_EPS, affine=True)


def _conv3(c_in: int, c_out: int, stride: int = 1, padding: int = 1) -> nn.Conv2d:
    return nn.Conv2d(c_in, c_out, kernel_size=3, stride=stride, padding=padding)


def _conv1(c_in: int, c_out: int) -> nn.Conv2d:
    return nn.Conv2d(c_in, c_out, kernel_size=1)


class ResnetBlock(nn.Module):
    """Pre-activation residual block; a 1x1 ``nin_shortcut`` exists only when channels change."""

    def __init__(self, c_in: int, c_out: int, groups: int, dropout: float) -> None:
        super().__init__()
        self.norm1 = _norm(c_in, groups)
        self.conv1 = _conv3(c_in, c_out)
        self.norm2 = _norm(c_out, groups)
        self.dropout = nn.Dropout(dropout)
        self.conv2 = _conv3(c_out, c_out)
        self.nin_shortcut = _conv1(c_in, c_out) if c_in != c_out else None

    def forward(self, x: Tensor) -> Tensor:  # [B, c_in, H, W] -> [B, c_out, H, W]
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(self.dropout(F.silu(self.norm2(h))))
        skip = x if self.nin_shortcut is None else self.nin_shortcut(x)
        return skip + h


class AttnBlock(nn.Module):
    """Single-head self-attention over all spatial positions, with 1x1-conv projections."""

    def __init__(self, channels: int, groups: int) -> None:
        super().__init__()
        self.norm = _norm(channels, groups)
        self.q = _conv1(channels, channels)
        self.k = _conv1(channels, channels)
        self.v = _conv1(channels, channels)
        self.proj_out = _conv1(channels, channels)

    def forward(self, x: Tensor) -> Tensor:  # [B, C, H, W] -> [B, C, H, W]
        b, c, h, w = x.shape
        hn = self.norm(x)

        def tokens(t: Tensor) -> Tensor:  # [B, C, H, W] -> [B, 1, H*W, C]
            return t.reshape(b, 1, c, h * w).transpose(2, 3)

        # softmax(q k^T / sqrt(C)) v, the same math as LlamaGen's bmm version.
        out = F.scaled_dot_product_attention(tokens(self.q(hn)), tokens(self.k(hn)),
                                             tokens(self.v(hn)))
        out = out.transpose(2, 3).reshape(b, c, h, w)
        return x + self.proj_out(out)


class Downsample(nn.Module):
    """Halve H and W: zero-pad right/bottom by one, then a 3x3 stride-2 conv (no padding)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = _conv3(channels, channels, stride=2, padding=0)

    def forward(self, x: Tensor) -> Tensor:  # [B, C, H, W] -> [B, C, H/2, W/2]
        return self.conv(F.pad(x, (0, 1, 0, 1), mode="constant", value=0.0))


class Upsample(nn.Module):
    """Double H and W: nearest-neighbour x2, then a 3x3 conv."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = _conv3(channels, channels)

    def forward(self, x: Tensor) -> Tensor:  # [B, C, H, W] -> [B, C, 2H, 2W]
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


class _Level(nn.Module):
    """One resolution level: ``res`` blocks, optional ``attn`` after each, optional resampler."""

    def __init__(self, c_in: int, c_out: int, n_blocks: int, with_attn: bool,
                 resample: type[Downsample] | type[Upsample] | None, cfg: VQConfig) -> None:
        super().__init__()
        chans = [c_in] + [c_out] * n_blocks
        self.res = nn.ModuleList(
            ResnetBlock(chans[i], chans[i + 1], cfg.norm_groups, cfg.dropout)
            for i in range(n_blocks)
        )
        self.attn = nn.ModuleList(
            AttnBlock(c_out, cfg.norm_groups) for _ in range(n_blocks if with_attn else 0)
        )
        if resample is Downsample:
            self.downsample = Downsample(c_out)
        elif resample is Upsample:
            self.upsample = Upsample(c_out)

    def forward(self, x: Tensor) -> Tensor:
        return run_level(self, self.res, x)


def empty_model(cls: Callable[[Any], _M], config: Any) -> _M:
    """An uninitialised CPU model (skips random init; every tensor is then loaded strictly)."""
    with torch.device("meta"):
        model = cls(config)
    return model.to_empty(device="cpu")


class Level(Protocol):
    """A VQGAN resolution level (LlamaGen's, Chameleon's): its attention blocks, one per res block or
    none, and a ``downsample`` or ``upsample`` module when it resamples."""

    attn: nn.ModuleList


def run_level(level: Level, blocks: nn.ModuleList, x: Tensor) -> Tensor:
    """One resolution level of a VQGAN encoder / decoder: each res block (then its attention, if the
    level has any), then the level's resampler, if any."""
    for i, block in enumerate(blocks):
        x = block(x)
        if len(level.attn) > 0:
            x = level.attn[i](x)
    if hasattr(level, "downsample"):
        x = level.downsample(x)
    if hasattr(level, "upsample"):
        x = level.upsample(x)
    return x


def _mid(channels: int, cfg: VQConfig) -> nn.ModuleList:
    return nn.ModuleList([
        ResnetBlock(channels, channels, cfg.norm_groups, cfg.dropout),
        AttnBlock(channels, cfg.norm_groups),
        ResnetBlock(channels, channels, cfg.norm_groups, cfg.dropout),
    ])


class Encoder(nn.Module):
    """Image -> ``z_channels`` latent at 1/``downsample_factor`` resolution.

    Attention only at the last (lowest-resolution) level; every level but the last downsamples.
    """

    def __init__(self, cfg: VQConfig) -> None:
        super().__init__()
        widths = [cfg.ch * m for m in cfg.ch_mult]
        last = len(widths) - 1
        self.conv_in = _conv3(cfg.in_channels, cfg.ch)
        self.conv_blocks = nn.ModuleList(
            _Level([cfg.ch, *widths][i], widths[i], cfg.num_res_blocks, i == last,
                   Downsample if i != last else None, cfg)
            for i in range(len(widths))
        )
        self.mid = _mid(widths[-1], cfg)
        self.norm_out = _norm(widths[-1], cfg.norm_groups)
        self.conv_out = _conv3(widths[-1], cfg.z_channels)

    def forward(self, x: Tensor) -> Tensor:  # [B, 3, H, W] -> [B, z_channels, H/f, W/f]
        h = self.conv_in(x)
        for level in self.conv_blocks:
            h = level(h)
        for block in self.mid:
            h = block(h)
        return self.conv_out(F.silu(self.norm_out(h)))


class Decoder(nn.Module):
    """``z_channels`` latent -> image. Levels run widest-first; the first has attention.

    ``conv_blocks[j]`` is official level ``L-1-j`` (``num_res_blocks + 1`` res blocks); all but
    the last upsample.
    """

    def __init__(self, cfg: VQConfig) -> None:
        super().__init__()
        widths = [cfg.ch * m for m in reversed(cfg.ch_mult)]
        last = len(widths) - 1
        self.conv_in = _conv3(cfg.z_channels, widths[0])
        self.mid = _mid(widths[0], cfg)
        self.conv_blocks = nn.ModuleList(
            _Level([widths[0], *widths][j], widths[j], cfg.num_res_blocks + 1, j == 0,
                   Upsample if j != last else None, cfg)
            for j in range(len(widths))
        )
        self.norm_out = _norm(widths[-1], cfg.norm_groups)
        self.conv_out = _conv3(widths[-1], cfg.in_channels)

    def forward(self, z: Tensor) -> Tensor:  # [B, z_channels, g, g] -> [B, 3, f*g, f*g]
        h = self.conv_in(z)
        for block in self.mid:
            h = block(h)
        for level in self.conv_blocks:
            h = level(h)
        return self.conv_out(F.silu(self.norm_out(h)))


@torch.no_grad()
def nearest_codes(vectors: Tensor, book: Tensor) -> Tensor:  # [M, D], [V, D] -> [M] int64
    """Argmin of squared L2 distance, in float32, over row chunks of at most [rows, V] (both
    LlamaGen's VQ and Chameleon's VQGAN quantize this way)."""
    book = book.float()
    book_sq = book.pow(2).sum(dim=1)  # [V]
    rows = max(1, _MAX_DISTANCE_ELEMENTS // book.shape[0])
    out = [_nearest_chunk(chunk.float(), book, book_sq) for chunk in vectors.split(rows)]
    return torch.cat(out) if out else vectors.new_zeros(0, dtype=torch.long)


def _nearest_chunk(z: Tensor, book: Tensor, book_sq: Tensor) -> Tensor:  # [m, D] -> [m]
    # ||z||^2 + ||e||^2 - 2 z.e, the same expansion (and so the same ties) as LlamaGen and taming.
    d = z.pow(2).sum(dim=1, keepdim=True) + book_sq - 2.0 * (z @ book.t())  # [m, V]
    return d.argmin(dim=1)


class VectorQuantizer(nn.Module):
    """Nearest-codebook-vector lookup; with ``l2_norm`` on unit-normalised vectors (cosine)."""

    codebook_used: Tensor

    def __init__(self, size: int, dim: int, l2_norm: bool) -> None:
        super().__init__()
        self.l2_norm = l2_norm
        self.embedding = nn.Embedding(size, dim)
        # Official init; trained checkpoints overwrite it (and are not unit norm).
        nn.init.uniform_(self.embedding.weight, -1.0 / size, 1.0 / size)
        if l2_norm:
            with torch.no_grad():
                self.embedding.weight.copy_(F.normalize(self.embedding.weight, dim=-1))
        # Rolling window of recently used codes (official training statistic); kept so the
        # official files load strictly and fine-tuning keeps the same meaning.
        self.register_buffer("codebook_used", torch.zeros(USAGE_WINDOW))

    def codebook(self) -> Tensor:  # [V, D], the vectors latents are compared with / decoded from
        w = self.embedding.weight
        return F.normalize(w, p=2, dim=-1) if self.l2_norm else w

    def prepare(self, z: Tensor) -> Tensor:  # [M, D] -> [M, D] (normalised when l2_norm)
        return F.normalize(z, p=2, dim=-1) if self.l2_norm else z

    def nearest(self, vectors: Tensor) -> Tensor:  # [M, D] (already prepared) -> [M] int64
        return nearest_codes(vectors, self.codebook())

    @torch.no_grad()
    def record_usage(self, codes: Tensor) -> None:
        """Shift ``codes`` (flattened) into the usage window, as LlamaGen does while training."""
        codes = codes.reshape(-1)[-USAGE_WINDOW:].to(self.codebook_used.dtype)
        n = codes.numel()
        self.codebook_used.copy_(torch.cat([self.codebook_used[n:], codes]))

    def usage(self) -> float:
        """Fraction of the codebook seen in the usage window."""
        return torch.unique(self.codebook_used).numel() / self.embedding.num_embeddings


# --------------------------------------------------------------------------------------------
# The tokenizer
# --------------------------------------------------------------------------------------------


class VQModel(nn.Module):
    """LlamaGen VQ tokenizer: ``encode`` images to code grids and ``decode`` codes to images."""

    def __init__(self, config: VQConfig | None = None) -> None:
        super().__init__()
        self.config = config if config is not None else VQConfig()
        cfg = self.config
        self.encoder = Encoder(cfg)
        self.decoder = Decoder(cfg)
        self.quantize = VectorQuantizer(cfg.codebook_size, cfg.codebook_embed_dim,
                                        cfg.codebook_l2_norm)
        self.quant_conv = _conv1(cfg.z_channels, cfg.codebook_embed_dim)
        self.post_quant_conv = _conv1(cfg.codebook_embed_dim, cfg.z_channels)

    @property
    def _dtype(self) -> torch.dtype:
        return self.quant_conv.weight.dtype

    # ---- encoding -----------------------------------------------------------------------

    def encode_latents(self, images: Tensor) -> Tensor:  # [B, 3, H, W] -> [B, D, H/f, W/f]
        """Continuous pre-quantisation latents (after ``quant_conv``)."""
        self._check_images(images)
        return self.quant_conv(self.encoder(images.to(self._dtype)))

    def quantize_latents(self, z: Tensor) -> tuple[Tensor, Tensor]:
        """Snap latents to the codebook: ``z [B,D,h,w]`` -> ``(zq [B,D,h,w], codes [B, h*w])``.

        ``zq`` are the (normalised, when ``codebook_l2_norm``) codebook vectors, without any
        straight-through gradient; codes are row-major over the ``h x w`` grid.
        """
        codes = self._nearest_codes(z)
        return self._lookup(codes, z.shape[2], z.shape[3]).to(z.dtype), codes

    def _nearest_codes(self, z: Tensor) -> Tensor:  # [B, D, h, w] -> [B, h*w] int64
        b, d, h, w = z.shape
        flat = self.quantize.prepare(z.permute(0, 2, 3, 1).reshape(b * h * w, d))  # [B*h*w, D]
        return self.quantize.nearest(flat).reshape(b, h * w)

    @torch.no_grad()
    def encode(self, images: Tensor) -> Tensor:  # [B, 3, H, W] in [-1, 1] -> [B, h*w] int64
        """Token ids for a batch of images, in raster order (what the AR model predicts)."""
        return self._nearest_codes(self.encode_latents(images))

    # ---- decoding -----------------------------------------------------------------------

    def codebook(self) -> Tensor:  # [V, D]
        """The codebook as used for quantisation and lookup (L2-normalised if configured)."""
        return self.quantize.codebook()

    def embed_codes(self, codes: Tensor) -> Tensor:  # [B, N] -> [B, D, g, g], g = sqrt(N)
        """Latents for a square grid of codes, laid out as LlamaGen's ``decode_code`` does."""
        g = self._check_codes(codes)
        return self._lookup(codes, g, g)

    def _lookup(self, codes: Tensor, h: int, w: int) -> Tensor:  # [B, h*w] -> [B, D, h, w]
        vectors = self.codebook()[codes.reshape(-1)]  # [B*h*w, D]
        return vectors.reshape(codes.shape[0], h, w, -1).permute(0, 3, 1, 2).contiguous()

    def decode_latents(self, zq: Tensor) -> Tensor:  # [B, D, g, g] -> [B, 3, f*g, f*g]
        """Decoder on quantised latents (differentiable; used by :meth:`forward`)."""
        return self.decoder(self.post_quant_conv(zq.to(self._dtype)))

    @torch.no_grad()
    def decode(self, codes: Tensor) -> Tensor:  # [B, N] int -> [B, 3, f*g, f*g] in ~[-1, 1]
        """Images for square grids of token ids (N = g*g), in raster order."""
        return self.decode_latents(self.embed_codes(codes))

    # ---- training -----------------------------------------------------------------------

    def forward(self, images: Tensor,
                beta: float = COMMIT_LOSS_BETA) -> tuple[Tensor, dict[str, Tensor], Tensor]:
        """Reconstruct ``images``; return ``(recon [B,3,H,W], losses, codes [B, h*w])``.

        ``losses["codebook"] = mse(zq, sg(z))`` pulls codes toward encoder outputs;
        ``losses["commitment"] = beta * mse(z, sg(zq))`` keeps the encoder near its codes. Both use
        normalised vectors when ``codebook_l2_norm``. The decoder sees ``z + sg(zq - z)`` so
        reconstruction gradients reach the encoder (straight-through estimator).
        """
        z = self.encode_latents(images)  # [B, D, h, w]
        codes = self._nearest_codes(z)  # [B, h*w]
        zq = self._lookup(codes, z.shape[2], z.shape[3])  # [B, D, h, w], grads reach the codebook
        z = self._normalise_channels(z)
        losses = {
            "codebook": F.mse_loss(zq, z.detach()),
            "commitment": beta * F.mse_loss(z, zq.detach()),
        }
        if self.training:
            self.quantize.record_usage(codes)
        recon = self.decode_latents(z + (zq - z).detach())
        return recon, losses, codes

    def _normalise_channels(self, z: Tensor) -> Tensor:  # [B, D, h, w] -> [B, D, h, w]
        return F.normalize(z, p=2, dim=1) if self.config.codebook_l2_norm else z

    # ---- checks -------------------------------------------------------------------------

    def _check_images(self, images: Tensor) -> None:
        cfg = self.config
        check(images.ndim == 4 and images.shape[1] == cfg.in_channels,
              f"images must be [B, {cfg.in_channels}, H, W], got {tuple(images.shape)}")
        f = cfg.downsample_factor
        check(images.shape[2] % f == 0 and images.shape[3] % f == 0,
              f"image height and width must be multiples of {f}, got {tuple(images.shape[2:])}")

    def _check_codes(self, codes: Tensor) -> int:
        """Validate ``codes [B, N]`` and return the grid side g (N must be g*g)."""
        check(codes.ndim == 2, f"codes must be [B, N], got shape {tuple(codes.shape)}")
        check(not codes.is_floating_point() and not codes.is_complex(),
              f"codes must be an integer tensor, got {codes.dtype}")
        n = codes.shape[1]
        g = math.isqrt(n)
        check(n > 0 and g * g == n,
              f"decoding needs a square grid of codes; N = {n} is not a perfect square")
        if codes.numel() > 0:
            lo, hi = int(codes.min()), int(codes.max())
            size = self.config.codebook_size
            check(lo >= 0 and hi < size, f"codes must be in [0, {size}), got range [{lo}, {hi}]")
        return g

    # ---- files --------------------------------------------------------------------------

    def save_pretrained(self, directory: str | os.PathLike[str]) -> Path:
        """Write ``config.json`` (``model_type = lantern-vq``) + ``model.safetensors``."""
        config = {"model_type": MODEL_TYPE, **self.config.to_dict()}
        return save_model_folder(directory, config, self.state_dict())

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike[str]) -> VQModel:
        """Load a folder written by :meth:`save_pretrained` (keys and shapes checked strictly)."""
        raw, state_dict = load_model_folder(directory, "tokenizer")
        check(isinstance(raw, dict), f"model config in {directory} must be a JSON object")
        model_type = raw.pop("model_type", None)
        check(model_type == MODEL_TYPE,
              f"{directory} holds model_type {model_type!r}, not a {MODEL_TYPE!r} tokenizer")
        with config_of(Path(directory) / CONFIG_NAME):
            config = VQConfig.from_dict(raw)
        model = cls._empty(config)
        load_state_dict_strict(model, state_dict, f"model folder {directory}")
        return model.eval()

    @classmethod
    def from_official_checkpoint(cls, path: str | os.PathLike[str],
                                 config: VQConfig | str | None = "VQ-16",
                                 key: str | None = None, *, trust_checkpoint: bool | None = None) -> VQModel:
        """Load LlamaGen's ``vq_ds16_*.pt`` (weights under ``'model'``; other entries ignored).

        ``config`` None: read from the weights (:func:`official_vq_config`). ``key`` picks a
        container entry explicitly (e.g. ``'ema'``); see :func:`extract_state_dict`.
        The file is read by :func:`lantern.io.load_checkpoint`: ``trust_checkpoint=True`` allows
        classes besides tensors and the allow-listed ones (None: ``--trust-checkpoint``'s setting).
        """
        obj = load_checkpoint(path, "VQ checkpoint", trust=trust_checkpoint)
        try:
            state_dict = extract_state_dict(obj, key)
        except CheckpointError as e:  # name the file: the message only describes its contents
            raise CheckpointError(f"VQ checkpoint {path}: {e}") from None
        cfg = (official_vq_config(state_dict, f"VQ checkpoint {path}") if config is None
               else vq_config(config) if isinstance(config, str) else config)
        if USAGE_KEY not in state_dict:  # trained with codebook_show_usage=False: a statistic, not a weight
            state_dict = {**state_dict, USAGE_KEY: torch.zeros(USAGE_WINDOW)}
        model = cls._empty(cfg)
        load_state_dict_strict(model, state_dict, f"VQ checkpoint {path}")
        return model.eval()

    @classmethod
    def _empty(cls, config: VQConfig) -> VQModel:
        return empty_model(cls, config)


def official_vq_config(state: Mapping[str, Tensor], source: str = "VQ checkpoint") -> VQConfig:
    """The config of LlamaGen VQ weights, read from their shapes: the codebook's size and width
    (its scripts' ``--codebook-size`` / ``--codebook-embed-dim``), the encoder's widths per level
    (VQ-16: 5 levels, VQ-8: 4) and res blocks. LlamaGen's GroupNorms always have 32 groups and its
    codebook is always l2-normalised: neither shows in a shape, so both are LlamaGen's."""
    def shape(key: str) -> tuple[int, ...]:
        check(key in state, f"{source} has no {key}: not LlamaGen VQ weights")
        return tuple(state[key].shape)

    size, dim = shape("quantize.embedding.weight")
    ch, in_channels = shape("encoder.conv_in.weight")[:2]
    levels = sorted({int(k.split(".")[2]) for k in state if k.startswith("encoder.conv_blocks.")})
    check(levels == list(range(len(levels))) and bool(levels), f"{source}: its encoder's levels are not 0..n")
    res = {k.split(".")[4] for k in state if k.startswith("encoder.conv_blocks.0.res.")}
    return VQConfig(codebook_size=size, codebook_embed_dim=dim, ch=ch, in_channels=in_channels,
                    z_channels=shape("encoder.conv_out.weight")[0], num_res_blocks=len(res),
                    ch_mult=tuple(shape(f"encoder.conv_blocks.{i}.res.0.conv1.weight")[0] // ch for i in levels))


def extract_state_dict(obj: Any, key: str | None = None) -> dict[str, Tensor]:
    """The weights inside a checkpoint object.

    Tries ``obj[key]`` when ``key`` is given, else ``'model'``, then ``'state_dict'``, then ``obj``
    itself as a raw state dict. Training extras (``optimizer``, ``discriminator``, ``steps``,
    ``args``, ``ema``...) are ignored; ``ema`` is never picked implicitly.
    """
    if not isinstance(obj, Mapping):
        raise CheckpointError(f"checkpoint is a {type(obj).__name__}, expected a dict")
    candidates = (key,) if key is not None else _STATE_DICT_KEYS
    for name in candidates:
        if name in obj:
            return _as_state_dict(obj[name], f"checkpoint entry {name!r}")
    if key is None and obj and all(isinstance(v, Tensor) for v in obj.values()):
        return dict(obj)
    wanted = repr(key) if key is not None else " / ".join(map(repr, _STATE_DICT_KEYS))
    top = ", ".join(map(str, list(obj)[:10])) or "(empty)"
    raise CheckpointError(f"checkpoint has no {wanted} weights and is not a raw state dict; "
                          f"top-level keys: {top}")


def _as_state_dict(value: Any, what: str) -> dict[str, Tensor]:
    if not isinstance(value, Mapping) or not all(isinstance(v, Tensor) for v in value.values()):
        raise CheckpointError(f"{what} is not a state dict of tensors")
    return dict(value)


# --------------------------------------------------------------------------------------------
# Images
# --------------------------------------------------------------------------------------------


def to_pil(images: Tensor) -> list[Image.Image]:  # [B, C, H, W] in [-1, 1], C in {1, 3}
    """PIL images the way LlamaGen saves samples: ``clamp((x+1)/2, 0, 1) * 255``, rounded half-up
    (``floor(v + 0.5)``, as torchvision's ``save_image``): :func:`lantern.images.to_pil`."""
    from lantern.images import to_pil as images_to_pil

    return images_to_pil(images, "half_up")
