"""LANTERN's released Chameleon-family EAGLE drafters (``jadohu/anole_drafter``,
``sihwanpark/LANTERN-Lumina-mGPT-7B-768``), loaded strictly in their own key layout.

Facts from the official code (``jadohu/LANTERN`` @3a56e45, ``models/drafters/cnets_anole.py`` /
``cnets_lumina_mgpt.py`` ``Model``; folders read by ``models/ea_model_{anole,lumina_mgpt}.py``):

* The folder holds a transformers-style Chameleon ``config.json`` (``model_type: chameleon``,
  ``num_hidden_layers: 1``, the 7B sizes: hidden 4096, intermediate 11008, 32 heads, vocabulary
  65,536, ``rms_norm_eps`` 1e-5, ``rope_theta`` 1e4; an optional ``bias`` for ``fc``) and
  ``pytorch_model.bin`` or ``model.safetensors`` (an ``accelerate`` ``save_state`` of ``Model``).
* ``Model`` = ``embed_tokens`` over the *full* 65,536-token vocabulary, ``fc: [emb(x); f] -> D``
  (bias), then complete Chameleon decoder layers: ``input_layernorm`` (RMSNorm, used on layer 0,
  unlike the LlamaGen drafter), attention with per-head q/k LayerNorms (eps 1e-5) *before*
  transformers' rotate-half RoPE, ``post_attention_layernorm``, SwiGLU MLP. No final norm; logits
  come from the target's ``lm_head`` restricted to image tokens.
* The two releases differ in one place: the q/k LayerNorm parameters. Anole's ``ChameleonLayerNorm``
  holds one (gamma, beta) row per head (``[heads, head_dim]``); Lumina-mGPT's holds one row per
  model-parallel shard (``[model_parallel_size, head_dim]``, i.e. ``[1, 128]``) repeated over the
  shard's heads. That shape is how a folder's release is recognised (:func:`detect_layout`).
* Rotary buffers are non-persistent: not in the files.

The sequence the drafter reads (prompt, image tokens and Lumina-mGPT's new-line tokens, target
positions) is built by :mod:`lantern.drafters.released`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lantern.decoding.cache import KVCache
from lantern.errors import LanternError, check
from lantern.io import load_checkpoint, load_safetensors, load_state_dict_strict, read_json, save_safetensors
from lantern.models.drafter import DrafterMLP, EagleModule, cached_attention
from lantern.models.invariant import AttentionCalls
from lantern.models.llamagen import RMSNorm

RELEASED_MODEL_TYPE = "chameleon"
RELEASED_LAYOUTS = ("anole", "lumina-mgpt")
QK_NORM_EPS = 1e-5  # hard-coded in both releases' ChameleonLayerNorm
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
_REQUIRED = ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size", "num_hidden_layers")


@dataclass(frozen=True)
class ReleasedDrafterConfig:
    """The fields of a released drafter's ``config.json`` that shape or run it."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    num_hidden_layers: int = 1
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    fc_bias: bool = True
    model_parallel_size: int = 1
    layout: str = "anole"  # which release's q/k-norm layout: "anole" (per head) or "lumina-mgpt" (per shard)

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                     "vocab_size", "num_hidden_layers", "model_parallel_size"):
            value = getattr(self, name)
            check(isinstance(value, int) and value > 0, f"drafter config.json: {name} must be a positive integer")
        check(self.hidden_size % self.num_attention_heads == 0,
              "drafter config.json: hidden_size must be divisible by num_attention_heads")
        check(self.num_attention_heads % self.num_key_value_heads == 0,
              "drafter config.json: num_attention_heads must be a multiple of num_key_value_heads")
        check(self.layout in RELEASED_LAYOUTS, f"released drafter layout must be one of {RELEASED_LAYOUTS}")
        if self.layout == "lumina-mgpt":
            check(self.num_key_value_heads % self.model_parallel_size == 0,
                  "drafter config.json: num_key_value_heads must be a multiple of model_parallel_size")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def norm_rows(self, heads: int) -> int:
        """Rows of a q/k LayerNorm's (gamma, beta) for ``heads`` heads in this release's layout."""
        return heads if self.layout == "anole" else self.model_parallel_size

    @classmethod
    def from_json(cls, raw: Mapping[str, Any], layout: str, where: object = "config.json") -> ReleasedDrafterConfig:
        """From a released drafter's ``config.json`` (transformers' Chameleon fields)."""
        check(raw.get("model_type") == RELEASED_MODEL_TYPE,
              f"{where}: model_type {raw.get('model_type')!r}, a released Chameleon drafter has 'chameleon'")
        missing = [k for k in _REQUIRED if k not in raw]
        check(not missing, f"{where} is missing {', '.join(missing)}")
        unsupported = [f"{k}={raw[k]!r}" for k, ok in (("rope_scaling", None), ("attention_bias", False),
                                                        ("mlp_bias", False), ("swin_norm", False),
                                                        ("hidden_act", "silu"))
                       if k in raw and raw[k] != ok]
        check(not unsupported, f"{where}: unsupported {', '.join(unsupported)} (the released drafters use "
                               "no RoPE scaling, no attention/MLP bias, pre-norm layers and SiLU)")
        return cls(
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_attention_heads=raw["num_attention_heads"],
            num_key_value_heads=raw.get("num_key_value_heads") or raw["num_attention_heads"],
            vocab_size=raw["vocab_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
            rope_theta=float(raw.get("rope_theta", 10000.0)),
            fc_bias=bool(raw.get("bias", True)),
            model_parallel_size=int(raw.get("model_parallel_size", 1)),
            layout=layout,
        )


class HeadGroupNorm(nn.Module):
    """Chameleon's q/k LayerNorm: statistics over each head's features, then one (gamma, beta) row
    per group of heads (a group is one head in Anole's release, one shard in Lumina-mGPT's)."""

    def __init__(self, rows: int, heads: int, head_dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(rows, head_dim))
        self.bias = nn.Parameter(torch.zeros(rows, head_dim))
        self.per_row = heads // rows

    def forward(self, x: Tensor) -> Tensor:  # [..., heads, head_dim]
        x = F.layer_norm(x, x.shape[-1:], eps=QK_NORM_EPS)
        w: Tensor = self.weight
        b: Tensor = self.bias
        if self.per_row > 1:
            w, b = w.repeat_interleave(self.per_row, dim=0), b.repeat_interleave(self.per_row, dim=0)
        return x * w + b


def rotate_half_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """transformers' RoPE convention: the two halves of each head are the (re, im) parts."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class ReleasedAttention(nn.Module):
    attention_calls: AttentionCalls | None = None  # batch-invariant mode's (lantern.models.invariant)

    def __init__(self, cfg: ReleasedDrafterConfig, layer: int) -> None:
        super().__init__()
        d, h, hkv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.layer, self.n_head, self.n_kv_head, self.head_dim = layer, h, hkv, hd
        self.q_proj = nn.Linear(d, h * hd, bias=False)
        self.k_proj = nn.Linear(d, hkv * hd, bias=False)
        self.v_proj = nn.Linear(d, hkv * hd, bias=False)
        self.o_proj = nn.Linear(h * hd, d, bias=False)
        self.q_norm = HeadGroupNorm(cfg.norm_rows(h), h, hd)
        self.k_norm = HeadGroupNorm(cfg.norm_rows(hkv), hkv, hd)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, cache: KVCache | None,
                slots: Tensor | None) -> Tensor:
        n, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(n, t, self.n_head, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(n, t, self.n_kv_head, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(n, t, self.n_kv_head, self.head_dim).transpose(1, 2)
        q, k = rotate_half_rope(q, cos, sin), rotate_half_rope(k, cos, sin)
        return self.o_proj(cached_attention(q, k, v, mask, cache, slots, self.layer, calls=self.attention_calls))


class ReleasedLayer(nn.Module):
    """A full pre-norm Chameleon decoder layer (the released drafters keep ``input_layernorm``)."""

    def __init__(self, cfg: ReleasedDrafterConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = ReleasedAttention(cfg, layer)
        self.mlp = DrafterMLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, cache: KVCache | None,
                slots: Tensor | None) -> Tensor:
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache, slots)
        return h + self.mlp(self.post_attention_layernorm(h))


class ReleasedChameleonDrafter(EagleModule):
    """The released drafters' ``Model``: tokens are BPE ids of the full Chameleon vocabulary."""

    inv_freq: Tensor  # a buffer: the rotary frequencies

    def __init__(self, cfg: ReleasedDrafterConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.fc = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=cfg.fc_bias)
        self.layers = nn.ModuleList([ReleasedLayer(cfg, i) for i in range(cfg.num_hidden_layers)])
        inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2).float() / cfg.head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def rope(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """(cos, sin) [N, 1, T, head_dim] at absolute positions [N, T], computed in float32."""
        freqs = positions.float()[..., None] * self.inv_freq.float()
        emb = torch.cat([freqs, freqs], dim=-1)[:, None]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(
        self,
        features: Tensor,  # [N, T, D] target features f_p (or the drafter's own predictions)
        tokens: Tensor,  # [N, T] BPE id of the token after each feature
        positions: Tensor,  # [N, T] the target position of f_p's token
        mask: Tensor,  # [N, T, S] bool
        cache: KVCache | None = None,
        slots: Tensor | None = None,  # [N, T]
    ) -> Tensor:
        """Predicted next features [N, T, D] (no final norm; feed to the target's image head)."""
        x = self.fc(torch.cat([self.embed_tokens(tokens).to(features.dtype), features], dim=-1))
        cos, sin = self.rope(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, mask, cache, slots)
        return x


# ----------------------------------------------------------------------------------------------
# Folders


def is_released_drafter_folder(directory: str | os.PathLike[str]) -> bool:
    """True when ``directory/config.json`` is a transformers Chameleon config (a released drafter)."""
    import json

    config_file = Path(directory) / "config.json"
    try:
        raw = json.loads(config_file.read_text())
    except (OSError, ValueError, RecursionError):  # unreadable: not a released drafter (read_json names it later)
        return False
    return isinstance(raw, dict) and raw.get("model_type") == RELEASED_MODEL_TYPE


def read_weights(directory: Path) -> dict[str, Tensor]:
    """The folder's state dict: ``model.safetensors``, else ``pytorch_model.bin``, both through
    lantern's readers (one-line errors naming the file; the pickle through the safe loader)."""
    safetensors = directory / WEIGHT_FILES[0]
    if safetensors.is_file():
        return load_safetensors(safetensors, "drafter weights")
    if (directory / WEIGHT_FILES[1]).is_file():
        state = load_checkpoint(directory / WEIGHT_FILES[1], "drafter weights")
        check(isinstance(state, dict), f"drafter {directory / WEIGHT_FILES[1]} does not hold a state dict")
        return state
    raise LanternError(f"drafter folder {directory} has neither {' nor '.join(WEIGHT_FILES)}")


def detect_layout(raw: Mapping[str, Any], state: Mapping[str, Tensor], where: object) -> str | None:
    """Which release a folder is, from its q_norm rows; None when the shapes cannot tell (heads ==
    model_parallel_size, never the case at 7B)."""
    key = "layers.0.self_attn.q_norm.weight"
    check(key in state, f"drafter {where} has no {key}: not a released Chameleon drafter "
                        "(an Anole / Lumina-mGPT drafter has per-head q/k LayerNorms)")
    rows = int(state[key].shape[0])
    heads, shards = int(raw.get("num_attention_heads", 0)), int(raw.get("model_parallel_size", 1))
    if rows == heads and rows == shards:
        return None
    if rows == heads:
        return "anole"
    if rows == shards:
        return "lumina-mgpt"
    raise LanternError(f"drafter {where}: {key} has {rows} rows, neither num_attention_heads ({heads}, the Anole "
                       f"release) nor model_parallel_size ({shards}, the Lumina-mGPT release)")


def load_released_drafter(directory: str | os.PathLike[str], layout: str | None = None) -> ReleasedChameleonDrafter:
    """Load a released drafter folder strictly (every key, every shape). ``layout`` breaks the tie
    when the weights cannot tell the release (tiny test configs)."""
    directory = Path(directory)
    check(directory.is_dir(), f"--drafter: folder not found: {directory}")
    raw = read_json(directory / "config.json", "drafter config")
    check(isinstance(raw, dict), f"drafter {directory / 'config.json'} is not a JSON object")
    # a model folder has the same config: name it before its weights (gigabytes, or shards) are read
    model_files = [name for name in ("tokenizer.json", "model.safetensors.index.json") if (directory / name).is_file()]
    check(not model_files, f"--drafter: {directory} is a Chameleon model ({raw.get('num_hidden_layers')} layers, "
                           f"with {' and '.join(model_files)}), not a drafter: pass it as --model")
    state = read_weights(directory)
    found = detect_layout(raw, state, directory) or layout or "anole"
    model = ReleasedChameleonDrafter(ReleasedDrafterConfig.from_json(raw, found, directory / "config.json"))
    load_state_dict_strict(model, state, f"drafter weights in {directory}")
    return model.eval()


def save_released_drafter(model: ReleasedChameleonDrafter, directory: str | os.PathLike[str],
                          weights: str = WEIGHT_FILES[0], extra_config: Mapping[str, Any] | None = None) -> Path:
    """Write ``model`` as the releases lay it out (Chameleon ``config.json`` + one weights file);
    lantern uses it to synthesise folders for tests and conversions."""
    from lantern.io import write_json

    cfg = model.config
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["ChameleonForConditionalGeneration"], "model_type": RELEASED_MODEL_TYPE,
        "attention_bias": False, "mlp_bias": False, "hidden_act": "silu", "swin_norm": False, "rope_scaling": None,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
        "num_hidden_layers": cfg.num_hidden_layers, "vocab_size": cfg.vocab_size, "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta, "model_parallel_size": cfg.model_parallel_size, "bias": cfg.fc_bias,
    } | dict(extra_config or {})
    write_json(directory / "config.json", config)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if weights == WEIGHT_FILES[0]:
        save_safetensors(state, directory / weights)
    else:
        torch.save(state, directory / weights)
    return directory
