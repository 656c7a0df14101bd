"""EAGLE drafter (Li et al., 2024) as used by LANTERN for LlamaGen ([LANTERN code] cnets_llamagen.py).

One decoder layer over ``fc([embed(x_{t+1}); f_t])``, where ``f_t`` is the target's last hidden
state after its final norm. Layer 0 has no input norm; there is no final norm; logits come from the
*target's* ``lm_head`` (shared, frozen). Attention uses the target's interleaved 2D RoPE with
``cls_token_num - 1`` zero rows, because drafter position p holds the pair (f_p, x_{p+1}) and so
sits one position before the token it embeds.

Parameter names equal the official LANTERN drafter checkpoints (``embed_tokens``, ``fc``,
``layers.0.self_attn.{q,k,v,o}_proj``, ``layers.0.mlp.{gate,up,down}_proj``,
``layers.0.post_attention_layernorm``), so those folders load with ``strict=True``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lantern.decoding.cache import KVCache
from lantern.errors import LanternError, check
from lantern.io import (
    CONFIG_NAME,
    check_not_other_lantern_model,
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
from lantern.models.llamagen import LlamaGenConfig, RMSNorm, apply_rope, keep_rope_float32, rope_table_1d, rope_table_2d

MODEL_TYPE = "lantern-eagle-drafter"
# What training saves beside the weights (the target it was trained for, the recipe, the data):
# here, below the trainers, so loaders can read it to refuse a drafter of another model.
TRAINING_INFO_FILE = "drafter_training.json"

# The official drafter configs name the target family; the RoPE layout is hard-coded from it.
_OFFICIAL_INPUT_TYPES = {"t2i": (120, 256), "t2i2": (120, 1024), "c2i": (1, 576)}


@dataclass(frozen=True)
class DrafterConfig:
    hidden_size: int = 1280
    intermediate_size: int = 3584
    num_attention_heads: int = 20
    num_key_value_heads: int | None = None
    vocab_size: int = 16384
    rms_norm_eps: float = 1e-6
    bias: bool = True  # fc bias
    target_cls_token_num: int = 120
    block_size: int = 256
    rope_base: float = 10000.0
    # "2d": LlamaGen's 2D table (target_cls_token_num - 1 zero rows, then the image grid);
    # "1d": plain positions 0, 1, 2, ... (Chameleon targets, whose own RoPE is 1D).
    rope: str = "2d"

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size", "block_size"):
            value = getattr(self, name)
            check(isinstance(value, int) and value > 0, f"drafter config: {name} must be a positive integer")
        check(self.target_cls_token_num >= 1, "drafter config: target_cls_token_num must be >= 1")
        check(
            self.hidden_size % self.num_attention_heads == 0,
            "drafter config: hidden_size must be divisible by num_attention_heads",
        )
        check(self.rope in ("2d", "1d"), f"drafter config: rope must be '2d' or '1d', got {self.rope!r}")
        if self.rope == "2d":
            check(math.isqrt(self.block_size) ** 2 == self.block_size, "drafter config: block_size must be square")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> DrafterConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        check(not unknown, f"drafter config has unknown fields: {', '.join(unknown)}")
        return cls(**dict(d))

    @classmethod
    def for_target(cls, target: LlamaGenConfig, **overrides: Any) -> DrafterConfig:
        """A drafter sized like the target (one of its layers), as EAGLE/LANTERN do."""
        sizes = {"hidden_size": target.dim, "intermediate_size": target.hidden_ffn,
                 "num_attention_heads": target.n_head, "vocab_size": target.vocab_size,
                 "target_cls_token_num": target.cls_token_num, "block_size": target.block_size,
                 "rope_base": target.rope_base}
        return cls(**{**sizes, **overrides})

    @classmethod
    def from_official(cls, raw: Mapping[str, Any]) -> DrafterConfig:
        """From LANTERN's EConfig ``config.json`` (``input_type`` picks the RoPE layout)."""
        if raw.get("model_type") == "chameleon":  # lantern.models.chameleon_drafter reads those
            raise LanternError("this drafter is one of LANTERN's released Chameleon-family drafters (Anole / "
                               "Lumina-mGPT): it runs with an Anole or Lumina-mGPT model only; this model needs a "
                               "drafter in lantern's own layout")
        input_type = raw.get("input_type", "t2i")
        if input_type not in _OFFICIAL_INPUT_TYPES:
            raise LanternError(f"official drafter config has unknown input_type {input_type!r}")
        cls_num, block = _OFFICIAL_INPUT_TYPES[input_type]
        try:
            return cls(
                hidden_size=raw["hidden_size"],
                intermediate_size=raw["intermediate_size"],
                num_attention_heads=raw["num_attention_heads"],
                num_key_value_heads=raw.get("num_key_value_heads"),
                vocab_size=raw["vocab_size"],
                rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
                bias=raw.get("bias", True),
                target_cls_token_num=cls_num,
                block_size=block,
            )
        except KeyError as e:
            raise LanternError(f"official drafter config is missing {e.args[0]!r}") from None


class DrafterAttention(nn.Module):
    attention_calls: AttentionCalls | None = None  # batch-invariant mode's (lantern.models.invariant)

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        d, h, hkv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_heads, cfg.head_dim
        self.n_head, self.n_kv_head, self.head_dim = h, hkv, hd
        self.q_proj = nn.Linear(d, h * hd, bias=False)
        self.k_proj = nn.Linear(d, hkv * hd, bias=False)
        self.v_proj = nn.Linear(d, hkv * hd, bias=False)
        self.o_proj = nn.Linear(h * hd, d, bias=False)

    def forward(
        self,
        x: Tensor,  # [N, T, D]
        rope: Tensor,  # [N, T, Dh/2, 2]
        mask: Tensor,  # [N, T, S] bool
        cache: KVCache | None = None,
        slots: Tensor | None = None,  # [N, T]
    ) -> Tensor:
        n, t, _ = x.shape
        q = apply_rope(self.q_proj(x).view(n, t, self.n_head, self.head_dim), rope).transpose(1, 2)
        k = apply_rope(self.k_proj(x).view(n, t, self.n_kv_head, self.head_dim), rope).transpose(1, 2)
        v = self.v_proj(x).view(n, t, self.n_kv_head, self.head_dim).transpose(1, 2)
        return self.o_proj(cached_attention(q, k, v, mask, cache, slots, calls=self.attention_calls))


def cached_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, cache: KVCache | None = None,
                     slots: Tensor | None = None, layer: int = 0, calls: AttentionCalls | None = None) -> Tensor:
    """Attention of q [N, H, T, Dh] over k / v [N, Hkv, T, Dh], first written to ``cache`` at
    ``slots`` and read back with everything before them; key/value heads are shared by groups of
    query heads. mask [N, T, S] bool. Returns [N, T, H * Dh]."""
    n, h, t, _ = q.shape
    if cache is not None:
        assert slots is not None
        cache.write(layer, slots, k, v)
        k, v = cache.read(layer, mask.shape[-1])
        k, v = k.to(q.dtype), v.to(q.dtype)
    if k.shape[1] != h:
        rep = h // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    out = attend(q, k, v, mask, calls=calls)
    return out.transpose(1, 2).reshape(n, t, -1)


class DrafterMLP(nn.Module):
    """SwiGLU, as the official drafters name it (``gate_proj``, ``up_proj``, ``down_proj``)."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DrafterLayer(nn.Module):
    """EAGLE's layer 0: no input norm (the fc output is attended to directly)."""

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.self_attn = DrafterAttention(cfg)
        self.mlp = DrafterMLP(cfg.hidden_size, cfg.intermediate_size)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: Tensor, rope: Tensor, mask: Tensor, **cache_args: Any) -> Tensor:
        h = x + self.self_attn(x, rope, mask, **cache_args)
        return h + self.mlp(self.post_attention_layernorm(h))


class EagleModule(nn.Module):
    """What the loop reads from any EAGLE drafter module: where and in which precision it runs."""

    fc: nn.Linear

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype


class EagleDrafterModel(EagleModule):
    ROPE_PAD = 64
    freqs_cis: Tensor  # a buffer: the rotary table

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.register_buffer("freqs_cis", self._rope_table(), persistent=False)
        self.fc = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=cfg.bias)
        self.layers = nn.ModuleList([DrafterLayer(cfg)])

    def _rope_table(self) -> Tensor:
        cfg = self.config
        if cfg.rope == "1d":  # drafter position p = target position p (its own cache slots)
            return rope_table_1d(cfg.head_dim, cfg.target_cls_token_num + 2 * cfg.block_size + self.ROPE_PAD,
                                 cfg.rope_base)
        else:  # the target's 2D table with one condition row fewer (drafter index = target index - 1)
            rope_cfg = LlamaGenConfig(
                dim=cfg.hidden_size,
                n_layer=1,
                n_head=cfg.num_attention_heads,
                vocab_size=cfg.vocab_size,
                block_size=cfg.block_size,
                cls_token_num=max(cfg.target_cls_token_num - 1, 1),
                rope_base=cfg.rope_base,
            )
            table = rope_table_2d(rope_cfg, self.ROPE_PAD)
            if cfg.target_cls_token_num == 1:  # no zero prefix row at all for c2i
                table = table[1:]
        return table

    def _apply(self, fn: Any, recurse: bool = True) -> EagleDrafterModel:
        """Casts keep the rotary table float32 (see ``LlamaGen._apply``)."""
        super()._apply(fn, recurse)
        return keep_rope_float32(self, self._rope_table)

    def rope_at(self, positions: Tensor) -> Tensor:
        return self.freqs_cis[positions.clamp(max=self.freqs_cis.shape[0] - 1)]

    def forward(
        self,
        features: Tensor,  # [N, T, D] target features f_t (or the drafter's own predictions)
        tokens: Tensor,  # [N, T] the token that follows each feature
        positions: Tensor,  # [N, T] drafter positions (index into the RoPE table)
        mask: Tensor,  # [N, T, S] bool
        cache: KVCache | None = None,
        slots: Tensor | None = None,  # [N, T]
    ) -> Tensor:
        """Predicted next features [N, T, D] (no final norm; feed to the target's lm_head)."""
        z = self.fc(torch.cat([self.embed_tokens(tokens).to(features.dtype), features], dim=-1))
        return self.layers[0](z, self.rope_at(positions), mask, cache=cache, slots=slots)

    # -- folders --------------------------------------------------------------------------------

    def save_pretrained(self, directory: str | os.PathLike[str], extra_files: Mapping[str, Any] | None = None) -> Path:
        return save_model_folder(
            directory, {"model_type": MODEL_TYPE, **self.config.to_dict()}, self.state_dict(), extra_files
        )

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike[str]) -> EagleDrafterModel:
        """Load a lantern drafter folder, or an official LANTERN drafter folder (``config.json`` +
        ``pytorch_model.bin`` or ``model.safetensors``; ``embed_tokens`` is taken from it)."""
        directory = Path(directory)
        if not directory.is_dir():
            raise LanternError(f"drafter folder not found: {directory}")
        raw = read_json_object(directory / "config.json", "drafter config")
        check_not_other_lantern_model(raw, directory, MODEL_TYPE)
        if raw.get("model_type") == MODEL_TYPE:
            config, state = load_model_folder(directory)
            with config_of(directory / CONFIG_NAME):
                drafter = DrafterConfig.from_dict({k: v for k, v in config.items() if k != "model_type"})
            model = cls(drafter)
            load_state_dict_strict(model, state, f"drafter weights in {directory}")
            return model
        return cls.from_official(directory)

    @classmethod
    def from_official(cls, directory: str | os.PathLike[str]) -> EagleDrafterModel:
        """An official EAGLE/LANTERN drafter folder; a ``pytorch_model.bin`` is read by
        :func:`lantern.io.load_checkpoint` (tensors only, unless ``--trust-checkpoint``)."""
        directory = Path(directory)
        config = DrafterConfig.from_official(read_json_object(directory / "config.json", "drafter config"))
        if (directory / "model.safetensors").is_file():
            state = load_safetensors(directory / "model.safetensors", "drafter weights")
        elif (directory / "pytorch_model.bin").is_file():
            state = load_checkpoint(directory / "pytorch_model.bin", "drafter weights")
            check(isinstance(state, dict) and all(isinstance(v, torch.Tensor) for v in state.values()),
                  f"drafter weights {directory / 'pytorch_model.bin'} must hold a dict of tensors")
        else:
            raise LanternError(f"drafter folder {directory} has neither model.safetensors nor pytorch_model.bin")
        model = cls(config)
        load_state_dict_strict(model, state, f"official drafter weights in {directory}")
        return model
