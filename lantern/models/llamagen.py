"""LlamaGen GPT (Sun et al., 2024), checkpoint-compatible with the official and HF-port weights.

Architecture per [LlamaGen code] gpt.py: pre-norm Llama blocks (RMSNorm in fp32, fused ``wqkv``, SwiGLU),
interleaved 2D RoPE whose first ``cls_token_num`` rows are zeros (so condition positions get
q = k = 0 and act only through their values — the checkpoints were trained that way), class
(c2i) or T5-caption (t2i) conditioning. Parameter names equal the official ``gpt.py`` keys, so
official ``.pt`` files load with ``strict=True`` after dropping the stray ``freqs_cis``.

Unlike the original, inference takes explicit cache slots, rotary positions and a boolean
attention mask (STYLE lesson 6): tree nodes at the same depth share a rotary position but need
distinct slots, and rows of a batch sit at different lengths.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any, Literal, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lantern.decoding.cache import KVCache
from lantern.errors import LanternError, check
from lantern.io import (
    CONFIG_NAME,
    check_not_other_lantern_model,
    check_state_dict,
    config_of,
    load_checkpoint,
    load_model_folder,
    load_safetensors,
    load_state_dict_strict,
    read_json_object,
    save_model_folder,
)
from lantern.models.attention import attend
from lantern.models.invariant import AttentionCalls

MODEL_TYPE = "lantern-llamagen"


def find_multiple(n: int, k: int) -> int:
    return n if n % k == 0 else n + k - (n % k)


@dataclass(frozen=True)
class LlamaGenConfig:
    dim: int = 768
    n_layer: int = 12
    n_head: int = 12
    n_kv_head: int | None = None  # None = n_head (every released LlamaGen model)
    multiple_of: int = 256
    ffn_dim_multiplier: float | None = None
    ffn_hidden: int | None = None  # explicit FFN width (HF ports state it); None = LlamaGen rule
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    vocab_size: int = 16384
    model_type: Literal["c2i", "t2i"] = "c2i"
    num_classes: int = 1000
    caption_dim: int = 2048
    cls_token_num: int = 1
    block_size: int = 256  # number of image tokens N (a square grid)
    class_dropout_prob: float = 0.1
    token_dropout_p: float = 0.1
    resid_dropout_p: float = 0.1
    ffn_dropout_p: float = 0.1
    attn_dropout_p: float = 0.0

    def __post_init__(self) -> None:
        for name in ("dim", "n_layer", "n_head", "vocab_size", "cls_token_num", "block_size", "multiple_of"):
            value = getattr(self, name)
            check(
                isinstance(value, int) and value > 0,
                f"LlamaGen config: {name} must be a positive integer, got {value!r}",
            )
        check(
            self.model_type in ("c2i", "t2i"),
            f"LlamaGen config: model_type must be 'c2i' or 't2i', got {self.model_type!r}",
        )
        check(
            self.dim % self.n_head == 0,
            f"LlamaGen config: dim ({self.dim}) must be divisible by n_head ({self.n_head})",
        )
        check(self.head_dim % 4 == 0, f"LlamaGen config: head_dim ({self.head_dim}) must be divisible by 4 for 2D RoPE")
        check(
            self.kv_heads > 0 and self.n_head % self.kv_heads == 0,
            f"LlamaGen config: n_head ({self.n_head}) must be a multiple of n_kv_head ({self.kv_heads})",
        )
        grid = math.isqrt(self.block_size)
        check(
            grid * grid == self.block_size,
            f"LlamaGen config: block_size ({self.block_size}) must be a square number of image tokens",
        )
        if self.model_type == "c2i":
            check(self.num_classes > 0, f"LlamaGen config: num_classes must be > 0, got {self.num_classes}")
        for name in ("class_dropout_prob", "token_dropout_p", "resid_dropout_p", "ffn_dropout_p", "attn_dropout_p"):
            value = getattr(self, name)  # nan passes torch's own range check and trains a model of NaNs
            check(isinstance(value, int | float) and 0.0 <= value <= 1.0,
                  f"LlamaGen config: {name} must be a rate in [0, 1], got {value!r}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_head

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head if self.n_kv_head is not None else self.n_head

    @property
    def grid_size(self) -> int:
        return math.isqrt(self.block_size)

    @property
    def hidden_ffn(self) -> int:
        if self.ffn_hidden is not None:
            return self.ffn_hidden
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return find_multiple(hidden, self.multiple_of)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> LlamaGenConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known - {"model_type_name", "architecture"})
        check(not unknown, f"LlamaGen config has unknown fields: {', '.join(unknown)}")
        return cls(**{k: v for k, v in d.items() if k in known})


# Named configs ([LlamaGen code] gpt.py). Training-time dropout values are LlamaGen's defaults.
GPT_CONFIGS: dict[str, dict[str, int]] = {
    "GPT-B": dict(n_layer=12, n_head=12, dim=768),
    "GPT-L": dict(n_layer=24, n_head=16, dim=1024),
    "GPT-XL": dict(n_layer=36, n_head=20, dim=1280),
    "GPT-XXL": dict(n_layer=48, n_head=24, dim=1536),
    "GPT-XXXL": dict(n_layer=48, n_head=40, dim=2560),
    "GPT-1B": dict(n_layer=22, n_head=32, dim=2048),
    "GPT-3B": dict(n_layer=24, n_head=32, dim=3200),
    "GPT-7B": dict(n_layer=32, n_head=32, dim=4096),
}


def llamagen_config(name: str, **overrides: Any) -> LlamaGenConfig:
    """A named LlamaGen config (``GPT-B`` ... ``GPT-7B``) with field overrides."""
    if name not in GPT_CONFIGS:
        raise LanternError(f"unknown LlamaGen config {name!r}; known: {', '.join(GPT_CONFIGS)}")
    return LlamaGenConfig(**{**GPT_CONFIGS[name], **overrides})


# ----------------------------------------------------------------------------------------------
# Rotary embedding


def rope_table_2d(cfg: LlamaGenConfig, extra_rows: int = 0) -> Tensor:
    """[cls + N + extra, head_dim/2, 2] (cos, sin) table; condition and extra rows are zeros.

    Cell (r, c) gets angles [r*w_0 .. r*w_{h/2-1}, c*w_0 .. c*w_{h/2-1}], w_j = base^(-2j/h),
    h = head_dim/2 ([LlamaGen code] gpt.py). The zero rows reproduce LlamaGen's condition-token quirk; the extra
    zero rows give finished rows of a batch a harmless position past the grid.
    """
    half = cfg.head_dim // 2
    inv = 1.0 / (cfg.rope_base ** (torch.arange(0, half, 2)[: half // 2].float() / half))
    t = torch.arange(cfg.grid_size, dtype=torch.float32)
    f = torch.outer(t, inv)  # [g, h/2]
    g = cfg.grid_size
    grid = torch.cat([f[:, None, :].expand(-1, g, -1), f[None, :, :].expand(g, -1, -1)], dim=-1)
    table = torch.stack([grid.cos(), grid.sin()], dim=-1).flatten(0, 1)  # [g*g, h, 2]
    zeros_head = torch.zeros(cfg.cls_token_num, half, 2)
    zeros_tail = torch.zeros(extra_rows, half, 2)
    return torch.cat([zeros_head, table, zeros_tail])


def rope_table_1d(head_dim: int, length: int, base: float = 10000.0) -> Tensor:
    """[length, head_dim/2, 2] (cos, sin) table of plain 1D positions, in ``apply_rope``'s layout."""
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.outer(torch.arange(length, dtype=torch.float32), inv)
    return torch.stack([angles.cos(), angles.sin()], dim=-1)


def keep_rope_float32(module: nn.Module, build: Any) -> Any:
    """Rebuild ``module.freqs_cis`` in float32 (on its device) if a cast changed its dtype."""
    table = module.freqs_cis
    if isinstance(table, Tensor) and table.dtype != torch.float32:
        module.freqs_cis = build().to(table.device)
    return module


def apply_rope(x: Tensor, rope: Tensor) -> Tensor:
    """Rotate interleaved pairs (x[2i], x[2i+1]). x: [N, T, H, Dh]; rope: [N, T, Dh/2, 2]."""
    xf = x.float().reshape(*x.shape[:-1], -1, 2)  # [N, T, H, Dh/2, 2]
    cos, sin = rope[:, :, None, :, 0], rope[:, :, None, :, 1]
    out = torch.stack([xf[..., 0] * cos - xf[..., 1] * sin, xf[..., 1] * cos + xf[..., 0] * sin], dim=-1)
    return out.flatten(3).type_as(x)


# ----------------------------------------------------------------------------------------------
# Modules (names match the official checkpoint keys)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


class LabelEmbedder(nn.Module):
    """Class table with one extra row (index ``num_classes``) for the null / CFG class."""

    def __init__(self, num_classes: int, dim: int, dropout_prob: float) -> None:
        super().__init__()
        self.num_classes = num_classes
        self.dropout_prob = dropout_prob
        self.embedding_table = nn.Embedding(num_classes + 1, dim)

    def forward(self, labels: Tensor) -> Tensor:
        return self.embedding_table(labels).unsqueeze(1)  # [B, 1, D]


class CaptionMLP(nn.Module):
    def __init__(self, in_features: int, dim: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(in_features, dim, bias=False)
        self.fc2 = nn.Linear(dim, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class CaptionEmbedder(nn.Module):
    """T5 caption projection; ``uncond_embedding`` is a stored buffer (it is in the checkpoints)."""

    uncond_embedding: Tensor

    def __init__(self, caption_dim: int, dim: int, token_num: int) -> None:
        super().__init__()
        self.cap_proj = CaptionMLP(caption_dim, dim)
        self.register_buffer("uncond_embedding", torch.randn(token_num, caption_dim) / caption_dim**0.5)

    def forward(self, captions: Tensor) -> Tensor:
        return self.cap_proj(captions)  # [B, cls, D]


class Attention(nn.Module):
    attention_calls: AttentionCalls | None = None  # batch-invariant mode's (lantern.models.invariant)

    def __init__(self, cfg: LlamaGenConfig) -> None:
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.kv_heads, cfg.head_dim
        total = (cfg.n_head + 2 * cfg.kv_heads) * cfg.head_dim
        self.wqkv = nn.Linear(cfg.dim, total, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.attn_dropout_p = cfg.attn_dropout_p
        self.resid_dropout = nn.Dropout(cfg.resid_dropout_p)

    def forward(
        self,
        x: Tensor,  # [N, T, D]
        rope: Tensor,  # [N, T, Dh/2, 2]
        mask: Tensor,  # [N, T, S] bool, True = attend
        cache: KVCache | None = None,
        layer: int = 0,
        slots: Tensor | None = None,  # [N, T]
        kv_len: int = 0,
    ) -> Tensor:
        n, t, _ = x.shape
        kv_dim = self.n_kv_head * self.head_dim
        q, k, v = self.wqkv(x).split([self.n_head * self.head_dim, kv_dim, kv_dim], dim=-1)
        q = apply_rope(q.view(n, t, self.n_head, self.head_dim), rope).transpose(1, 2)
        k = apply_rope(k.view(n, t, self.n_kv_head, self.head_dim), rope).transpose(1, 2)
        v = v.view(n, t, self.n_kv_head, self.head_dim).transpose(1, 2)  # [N, Hkv, T, Dh]
        if cache is not None:
            assert slots is not None
            cache.write(layer, slots, k, v)
            k, v = cache.read(layer, kv_len)  # [N, Hkv, S, Dh]
            k, v = k.to(q.dtype), v.to(q.dtype)
        if self.n_kv_head != self.n_head:
            rep = self.n_head // self.n_kv_head
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = attend(q, k, v, mask, calls=self.attention_calls,
                     dropout_p=self.attn_dropout_p if self.training else 0.0)
        out = out.transpose(1, 2).reshape(n, t, -1)
        return self.resid_dropout(self.wo(out))


class FeedForward(nn.Module):
    def __init__(self, cfg: LlamaGenConfig) -> None:
        super().__init__()
        hidden = cfg.hidden_ffn
        self.w1 = nn.Linear(cfg.dim, hidden, bias=False)  # gate (silu branch)
        self.w3 = nn.Linear(cfg.dim, hidden, bias=False)  # up
        self.w2 = nn.Linear(hidden, cfg.dim, bias=False)  # down
        self.ffn_dropout = nn.Dropout(cfg.ffn_dropout_p)

    def forward(self, x: Tensor) -> Tensor:
        return self.ffn_dropout(self.w2(F.silu(self.w1(x)) * self.w3(x)))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: LlamaGenConfig) -> None:
        super().__init__()
        self.attention = Attention(cfg)
        self.feed_forward = FeedForward(cfg)
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)

    def forward(self, x: Tensor, rope: Tensor, mask: Tensor, **cache_args: Any) -> Tensor:
        h = x + self.attention(self.attention_norm(x), rope, mask, **cache_args)
        return h + self.feed_forward(self.ffn_norm(h))


class LlamaGen(nn.Module):
    """The LlamaGen GPT. Inference goes through :meth:`forward_cached`; training through
    :meth:`forward`, which is also the slow uncached oracle in tests."""

    # Extra zero rows at the end of the RoPE table (positions of finished rows / tree overshoot).
    ROPE_PAD = 64
    freqs_cis: Tensor  # a buffer: the rotary table

    def __init__(self, cfg: LlamaGenConfig) -> None:
        super().__init__()
        self.config = cfg
        if cfg.model_type == "c2i":
            self.cls_embedding: nn.Module = LabelEmbedder(cfg.num_classes, cfg.dim, cfg.class_dropout_prob)
        else:
            self.cls_embedding = CaptionEmbedder(cfg.caption_dim, cfg.dim, cfg.cls_token_num)
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.tok_dropout = nn.Dropout(cfg.token_dropout_p)
        self.layers = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.register_buffer("freqs_cis", rope_table_2d(cfg, self.ROPE_PAD), persistent=False)

    def _apply(self, fn: Any, recurse: bool = True) -> LlamaGen:
        """``.to(dtype)`` / ``.half()`` cast every floating buffer; the rotary table is rebuilt in
        float32 afterwards, as LlamaGen keeps ``freqs_cis`` float32 whatever the model's dtype
        (a bf16 table rounds cos/sin to 3 significant digits)."""
        super()._apply(fn, recurse)
        return keep_rope_float32(self, lambda: rope_table_2d(self.config, self.ROPE_PAD))

    # -- construction ---------------------------------------------------------------------------

    def init_weights(self, std: float = 0.02, zero_output: bool = True, seed: int | None = None) -> LlamaGen:
        """LlamaGen's init: normal(0, std) linears/embeddings; output zeroed for training runs."""
        gen = None
        if seed is not None:
            gen = torch.Generator().manual_seed(seed)
        for module in self.modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                with torch.no_grad():
                    module.weight.copy_(torch.randn(module.weight.shape, generator=gen) * std)
        if zero_output:
            nn.init.zeros_(self.output.weight)
        return self

    @property
    def device(self) -> torch.device:
        return self.tok_embeddings.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.tok_embeddings.weight.dtype

    # -- conditioning ---------------------------------------------------------------------------

    def null_condition(self, batch: int) -> Tensor:
        """The unconditional input: the null class id, or the stored ``uncond_embedding``."""
        cfg = self.config
        if cfg.model_type == "c2i":
            return torch.full((batch,), cfg.num_classes, dtype=torch.long, device=self.device)
        emb = cast(CaptionEmbedder, self.cls_embedding).uncond_embedding  # [cls, caption_dim] (t2i: captions)
        return emb[None].expand(batch, -1, -1)

    def embed_condition(self, cond: Tensor) -> Tensor:
        """Labels [B] (c2i) or captions [B, cls, caption_dim] (t2i) -> [B, cls, D]."""
        return self.cls_embedding(cond)[:, : self.config.cls_token_num]

    def check_labels(self, labels: Tensor, allow_null: bool = False) -> None:
        top = self.config.num_classes + (1 if allow_null else 0)
        bad = labels[(labels < 0) | (labels >= top)]
        check(
            bad.numel() == 0,
            f"label {int(bad[0]) if bad.numel() else 0} is out of range: this model has "
            f"{self.config.num_classes} classes (0..{self.config.num_classes - 1})",
        )

    # -- forward passes -------------------------------------------------------------------------

    def rope_at(self, positions: Tensor) -> Tensor:
        """[N, T] rotary indices -> [N, T, Dh/2, 2]; indices past the table clamp to a zero row."""
        return self.freqs_cis[positions.clamp(max=self.freqs_cis.shape[0] - 1)]

    def forward_cached(
        self,
        h: Tensor,  # [N, T, D] input embeddings
        positions: Tensor,  # [N, T] rotary indices (condition rows are cls-prefix indices)
        slots: Tensor,  # [N, T] cache slots to write
        mask: Tensor,  # [N, T, kv_len] bool
        cache: KVCache,
    ) -> Tensor:
        """Write K/V at ``slots``, attend over the first ``kv_len`` slots; returns the final-norm
        hidden states [N, T, D] (the features an EAGLE drafter consumes)."""
        rope = self.rope_at(positions)
        kv_len = mask.shape[-1]
        for i, layer in enumerate(self.layers):
            h = layer(h, rope, mask, cache=cache, layer=i, slots=slots, kv_len=kv_len)
        return self.norm(h)

    def logits(self, hidden: Tensor) -> Tensor:
        return self.output(hidden).float()

    def forward(
        self,
        cond: Tensor,
        tokens: Tensor,  # [B, n] image tokens (teacher forcing), n <= block_size
        cond_mask: Tensor | None = None,  # [B, cls] bool, valid caption tokens (t2i)
    ) -> tuple[Tensor, Tensor]:
        """Uncached causal pass over ``cond + tokens``. Returns (logits [B, n+1, V] where row i
        predicts image token i, hidden [B, cls+n, D])."""
        cls = self.config.cls_token_num
        h = torch.cat([self.embed_condition(cond), self.tok_embeddings(tokens)], dim=1)
        h = self.tok_dropout(h)
        b, length, _ = h.shape
        positions = torch.arange(length, device=h.device).expand(b, -1)
        mask = causal_mask(length, device=h.device).expand(b, -1, -1)
        if cond_mask is not None:
            mask = mask & caption_columns(cond_mask, length)
        rope = self.rope_at(positions)
        for layer in self.layers:
            h = layer(h, rope, mask)
        hidden = self.norm(h)
        return self.logits(hidden[:, cls - 1 :]), hidden

    # -- model folders --------------------------------------------------------------------------

    def save_pretrained(self, directory: str | os.PathLike[str], extra_files: Mapping[str, Any] | None = None) -> Path:
        config = {"model_type": MODEL_TYPE, **config_json(self.config)}
        return save_model_folder(directory, config, self.state_dict(), extra_files)

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike[str], dtype: torch.dtype | None = None) -> LlamaGen:
        directory = Path(directory)
        if (directory / "config.json").is_file():
            raw = read_json_object(directory / "config.json", "model config")
            check_not_other_lantern_model(raw, directory, MODEL_TYPE)
            if raw.get("architectures") == ["LlamaForCausalLM"] or "hidden_size" in raw:
                return cls.from_hf_port(directory, dtype=dtype)
        config, state = load_model_folder(directory)
        if config.get("model_type") != MODEL_TYPE:
            raise LanternError(
                f"{directory} is not a lantern LlamaGen folder (model_type {config.get('model_type')!r}, "
                f"expected {MODEL_TYPE!r})"
            )
        with config_of(Path(directory) / CONFIG_NAME):
            cfg = _config_from_json(config)
        model = cls(cfg)
        load_state_dict_strict(model, state, f"weights in {directory}")
        return model.to(dtype) if dtype is not None else model

    @classmethod
    def from_official_checkpoint(
        cls, path: str | os.PathLike[str], config: LlamaGenConfig | None = None, dtype: torch.dtype | None = None,
        *, image_size: int | None = None, downsample: int | None = None, gpt_model: str | None = None,
        trust_checkpoint: bool | None = None,
    ) -> LlamaGen:
        """Load an official LlamaGen ``.pt`` (``'model'`` / ``'module'`` / ``'state_dict'`` or raw
        FSDP state dict), strictly, after dropping the stray ``freqs_cis``.

        ``config`` None: read from the weights (:func:`official_config`); the image size, the VQ's
        downsampling and the model's name are the arguments', else the file's training ``args``,
        else the file name's (``c2i_L_384.pt``), 16 and the weights' shapes.
        Read by :func:`lantern.io.load_checkpoint` (the training ``args`` Namespace is allowed);
        ``trust_checkpoint=True`` also allows other classes (None: ``--trust-checkpoint``'s setting)."""
        source = f"LlamaGen checkpoint {path}"
        raw = load_checkpoint(path, "LlamaGen checkpoint", trust=trust_checkpoint)
        state = official_state_dict(raw, source)
        if config is None:
            check(GPT_MARKER in state, f"{source} has no {GPT_MARKER}: not LlamaGen GPT weights")  # before its size
            args = raw.get("args") if isinstance(raw, Mapping) else None
            config = official_config(state, image_size or official_image_size(Path(path), args),
                                     downsample or getattr(args, "downsample_size", None) or 16, source,
                                     gpt_model or _named(getattr(args, "gpt_model", None)))
            _check_null_class(config, args, source)
        with torch.device("meta"):  # no random init, no second copy: the file's tensors become the weights
            model = cls(config)  # (GPT-B 384 px conversion: peak memory 1.52 -> 1.41 GB)
        check_state_dict(model, state, source)
        own = model.state_dict()
        model.load_state_dict({k: v.to(own[k].dtype) for k, v in state.items()}, strict=True, assign=True)
        model.freqs_cis = rope_table_2d(config, cls.ROPE_PAD)  # not in the file: built, on the CPU
        return model.to(dtype) if dtype is not None else model

    @classmethod
    def from_hf_port(cls, directory: str | os.PathLike[str], dtype: torch.dtype | None = None) -> LlamaGen:
        """Load LANTERN's HF port (``config.json`` + ``model.safetensors``, LlamaForCausalLM keys)."""
        directory = Path(directory)
        config = config_from_hf(read_json_object(directory / "config.json", "HF config"))
        state: dict[str, Tensor] = {}
        for f in hf_port_files(directory):
            state.update(load_safetensors(f, "HF-port weights"))
        model = cls(config)
        source = f"HF-port weights in {directory}"
        load_state_dict_strict(model, hf_to_official(state, config, source), source)
        return model.to(dtype) if dtype is not None else model


def hf_port_files(directory: Path) -> list[Path]:
    """The weight files of an HF port, as transformers picks them: the shards its index lists
    (:func:`lantern.models.hf_folder.indexed_shards`), else ``model.safetensors``."""
    from lantern.models.hf_folder import indexed_shards

    shards = indexed_shards(directory)
    if shards is not None:
        return sorted(set(shards.values()))
    single = directory / "model.safetensors"
    check(single.is_file(), f"{directory} has no model.safetensors (nor model.safetensors.index.json and its shards)")
    return [single]


# ----------------------------------------------------------------------------------------------
# Masks


def causal_mask(length: int, device: torch.device | str = "cpu") -> Tensor:
    return torch.ones(length, length, dtype=torch.bool, device=device).tril()[None]  # [1, L, L]


def caption_columns(cond_mask: Tensor, length: int) -> Tensor:
    """[B, L, L] mask hiding padded caption columns; the diagonal stays visible (LlamaGen forces
    it, so a padded row still attends to itself and never sees an all-masked row)."""
    b, cls = cond_mask.shape
    cols = torch.ones(b, length, dtype=torch.bool, device=cond_mask.device)
    cols[:, :cls] = cond_mask
    eye = torch.eye(length, dtype=torch.bool, device=cond_mask.device)[None]
    return cols[:, None, :].expand(b, length, length) | eye


# ----------------------------------------------------------------------------------------------
# Checkpoint formats


GPT_MARKER = "tok_embeddings.weight"  # a key every LlamaGen GPT state dict has


def official_config(state: Mapping[str, Tensor], image_size: int, downsample: int = 16, source: str = "checkpoint",
                    gpt_model: str | None = None) -> LlamaGenConfig:
    """The config of official LlamaGen weights, from their shapes: LlamaGen's files do not say
    which model they are (its scripts take ``--gpt-model GPT-L --image-size 256`` on the command
    line). Width and depth name the model (:data:`GPT_CONFIGS`, whose head counts the shapes cannot
    tell); the condition embedder tells c2i (``embedding_table``: classes + the null class) from
    t2i (``uncond_embedding``: caption tokens x T5 width); ``image_size`` / ``downsample`` give the grid."""
    def shape(key: str) -> tuple[int, ...]:
        check(key in state, f"{source} has no {key}: not LlamaGen GPT weights")
        return tuple(state[key].shape)

    vocab, dim = shape(GPT_MARKER)
    n_layer = len({k.split(".")[1] for k in state if k.startswith("layers.") and k.endswith(".attention_norm.weight")})
    check(gpt_model is None or gpt_model in GPT_CONFIGS,
          f"gpt_model must be one of {', '.join(GPT_CONFIGS)}, got {gpt_model!r}")
    named = [n for n, c in GPT_CONFIGS.items() if (c["dim"], c["n_layer"]) == (dim, n_layer)]
    name = gpt_model or (named[0] if named else None)
    check(name is not None, f"{source}: its weights (width {dim}, {n_layer} layers) are none of LlamaGen's models "
                            f"({', '.join(GPT_CONFIGS)})")
    assert name is not None
    check((GPT_CONFIGS[name]["dim"], GPT_CONFIGS[name]["n_layer"]) == (dim, n_layer),
          f"{source}: its weights have width {dim} and {n_layer} layers, {name} has {GPT_CONFIGS[name]['dim']} and "
          f"{GPT_CONFIGS[name]['n_layer']}")
    check(isinstance(image_size, int) and isinstance(downsample, int) and image_size > 0 and downsample > 0
          and image_size % downsample == 0,
          f"image size {image_size!r} is not a positive multiple of the VQ's downsampling ({downsample!r})")
    head_dim = dim // GPT_CONFIGS[name]["n_head"]
    overrides: dict[str, Any] = {"vocab_size": vocab, "block_size": (image_size // downsample) ** 2}
    kv = (shape("layers.0.attention.wqkv.weight")[0] // head_dim - GPT_CONFIGS[name]["n_head"]) // 2
    if kv != GPT_CONFIGS[name]["n_head"]:
        overrides["n_kv_head"] = kv
    if "cls_embedding.uncond_embedding" in state:
        tokens, caption_dim = shape("cls_embedding.uncond_embedding")
        overrides |= {"model_type": "t2i", "cls_token_num": tokens, "caption_dim": caption_dim}
    else:
        overrides["num_classes"] = shape("cls_embedding.embedding_table.weight")[0] - 1  # + the null class
    config = llamagen_config(name, **overrides)
    hidden = shape("layers.0.feed_forward.w1.weight")[0]
    return config if hidden == config.hidden_ffn else replace(config, ffn_hidden=hidden)


def _check_null_class(config: LlamaGenConfig, args: Any, source: str) -> None:
    """A c2i run trained with ``--class-dropout-prob 0`` has no null-class row (LlamaGen's
    ``LabelEmbedder`` adds it only with dropout), so the shapes alone would read one class fewer and
    no unconditional branch: refused where the training ``args`` say so (released models have the row)."""
    classes, dropout = getattr(args, "num_classes", None), getattr(args, "class_dropout_prob", None)
    if config.model_type != "c2i" or not isinstance(classes, int) or classes == config.num_classes:
        return
    why = (" (trained with class_dropout_prob 0: there is no null-class row, which classifier-free guidance "
           "and lantern's c2i model need)") if dropout == 0 else ""
    raise LanternError(f"{source}: its training args say {classes} classes, its class embedding has "
                       f"{config.num_classes + 1} rows for {config.num_classes} classes and the null class{why}")


def _named(gpt_model: Any) -> str | None:
    """A training run's ``args.gpt_model`` when it names one of :data:`GPT_CONFIGS` (else the shapes decide)."""
    return gpt_model if isinstance(gpt_model, str) and gpt_model in GPT_CONFIGS else None


def official_image_size(path: Path, args: Any = None) -> int:
    """The image size of an official LlamaGen checkpoint: its training ``args`` (training
    checkpoints keep them), else its file name (``c2i_L_384.pt``, ``t2i_XL_stage1_256.pt``)."""
    size = getattr(args, "image_size", None)
    if isinstance(size, int) and size > 0:
        return size
    named = re.findall(r"(?:^|_)(\d{3,4})(?=[_.]|$)", path.name)
    check(bool(named), f"{path}: the image size is not in the file (no training args) nor its name (like "
                       "c2i_L_384.pt): give it (--image-size, image_size=)")
    return int(named[-1])


def official_state_dict(obj: Any, source: str = "checkpoint") -> dict[str, Tensor]:
    """Weights of an official LlamaGen checkpoint container ([LlamaGen code]); ``source`` names it in errors."""
    if isinstance(obj, Mapping):
        for key in ("model", "module", "state_dict"):
            if key in obj and isinstance(obj[key], Mapping):
                obj = obj[key]
                break
    if not isinstance(obj, Mapping) or not all(isinstance(v, Tensor) for v in obj.values()):
        raise LanternError(f"{source} holds no state dict under 'model', 'module' or 'state_dict'")
    state = {k.removeprefix("_orig_mod.").removeprefix("module."): v for k, v in obj.items()}
    state.pop("freqs_cis", None)  # older files carry the rotary table
    return state


_HF_LAYER = {
    "self_attn.o_proj.weight": "attention.wo.weight",
    "mlp.gate_proj.weight": "feed_forward.w1.weight",
    "mlp.up_proj.weight": "feed_forward.w3.weight",
    "mlp.down_proj.weight": "feed_forward.w2.weight",
    "input_layernorm.weight": "attention_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
}


def hf_to_official(state: Mapping[str, Tensor], cfg: LlamaGenConfig,
                   source: str = "HF-port checkpoint") -> dict[str, Tensor]:
    """Map HF-port keys to official names ([LANTERN code]); q/k/v are concatenated into ``wqkv``.

    LANTERN keeps LlamaGen's interleaved RoPE on the HF weights, so no permutation is needed.
    Unknown keys are kept as they are, so the strict check reports them.
    """
    out: dict[str, Tensor] = {}
    qkv: dict[int, dict[str, Tensor]] = {}
    for key, value in state.items():
        if key.endswith("rotary_emb.inv_freq") or key == "freqs_cis":
            continue
        if key == "model.embed_tokens.weight":
            out["tok_embeddings.weight"] = value
        elif key == "model.norm.weight":
            out["norm.weight"] = value
        elif key == "lm_head.weight":
            out["output.weight"] = value
        elif key.startswith("model.cls_embedding."):
            out[key.removeprefix("model.")] = value
        elif key.startswith("model.layers."):
            idx, rest = key.removeprefix("model.layers.").split(".", 1)
            if rest in ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"):
                qkv.setdefault(int(idx), {})[rest[10]] = value
            elif rest in _HF_LAYER:
                out[f"layers.{idx}.{_HF_LAYER[rest]}"] = value
            else:
                out[key] = value
        else:
            out[key] = value
    widths = {"q": cfg.n_head * cfg.head_dim, "k": cfg.kv_heads * cfg.head_dim, "v": cfg.kv_heads * cfg.head_dim}
    for layer, parts in qkv.items():
        missing = [f"model.layers.{layer}.self_attn.{p}_proj.weight" for p in "qkv" if p not in parts]
        if missing:
            raise LanternError(f"{source} lack {', '.join(missing)}")
        for p in "qkv":  # named here: torch.cat would only say that sizes differ
            shape = tuple(parts[p].shape)
            check(shape == (widths[p], cfg.dim), f"{source}: model.layers.{layer}.self_attn.{p}_proj.weight has shape "
                                                 f"{list(shape)}, config.json expects {[widths[p], cfg.dim]}")
        out[f"layers.{layer}.attention.wqkv.weight"] = torch.cat([parts["q"], parts["k"], parts["v"]])
    return out


def official_to_hf(state: Mapping[str, Tensor], cfg: LlamaGenConfig) -> dict[str, Tensor]:
    """Inverse of :func:`hf_to_official` (used to export, and to test the mapping)."""
    inverse = {v: k for k, v in _HF_LAYER.items()}
    out: dict[str, Tensor] = {}
    q_dim = cfg.n_head * cfg.head_dim
    kv_dim = cfg.kv_heads * cfg.head_dim
    for key, value in state.items():
        if key == "tok_embeddings.weight":
            out["model.embed_tokens.weight"] = value
        elif key == "norm.weight":
            out["model.norm.weight"] = value
        elif key == "output.weight":
            out["lm_head.weight"] = value
        elif key.startswith("cls_embedding."):
            out["model." + key] = value
        elif key.startswith("layers."):
            _, idx, rest = key.split(".", 2)
            if rest == "attention.wqkv.weight":
                q, k, v = value.split([q_dim, kv_dim, kv_dim])
                for name, part in zip("qkv", (q, k, v), strict=True):
                    out[f"model.layers.{idx}.self_attn.{name}_proj.weight"] = part
            else:
                out[f"model.layers.{idx}.{inverse[rest]}"] = value
    return out


def config_from_hf(raw: Mapping[str, Any]) -> LlamaGenConfig:
    """LlamaGenConfig from the HF-port ``config.json`` attributes ([LANTERN code])."""
    # LANTERN's model code reads these (and a t2i port's cls_token_num) directly: a port without
    # one is damaged, and a default would decide the image size or the condition kind silently (a
    # Stage II port read as 256 tokens)
    missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "input_type", "block_size")
               if k not in raw]
    check(not missing, f"HF config is missing {missing[0]!r}" if missing else "")
    dim, n_layer, n_head = raw["hidden_size"], raw["num_hidden_layers"], raw["num_attention_heads"]
    input_type = raw["input_type"]
    check(input_type in ("c2i", "t2i", "t2i2"), f"HF config: input_type must be c2i, t2i or t2i2, got {input_type!r}")
    check(input_type == "c2i" or "cls_token_num" in raw, "HF config is missing 'cls_token_num' (caption tokens)")
    return LlamaGenConfig(
        dim=dim,
        n_layer=n_layer,
        n_head=n_head,
        n_kv_head=raw.get("num_key_value_heads", n_head),
        ffn_hidden=raw.get("intermediate_size"),
        rope_base=float(raw.get("rope_base", raw.get("rope_theta", 10000.0))),
        norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
        vocab_size=raw.get("vocab_size", 16384),
        model_type="c2i" if input_type == "c2i" else "t2i",
        num_classes=raw.get("num_classes", 1000),
        caption_dim=raw.get("caption_dim", 2048),
        cls_token_num=raw.get("cls_token_num", 1),
        block_size=raw.get("block_size", 256),
        class_dropout_prob=raw.get("class_dropout_p", 0.1),
        token_dropout_p=raw.get("token_dropout_p", 0.1),
        resid_dropout_p=raw.get("resid_dropout_p", 0.1),
    )


def config_json(cfg: LlamaGenConfig) -> dict[str, Any]:
    """``cfg`` as a model folder's config.json stores it (the architecture under ``"architecture"``)."""
    d = cfg.to_dict()
    d["architecture"] = d.pop("model_type")  # "model_type" names the folder kind at top level
    return d


def _config_from_json(raw: Mapping[str, Any]) -> LlamaGenConfig:
    d = {k: v for k, v in raw.items() if k != "model_type"}
    d["model_type"] = d.pop("architecture", "c2i")
    return LlamaGenConfig.from_dict(d)
