"""Chameleon-family targets (Anole, Lumina-mGPT) run from transformers' weights with lantern's cache.

transformers' ``ChameleonForConditionalGeneration`` holds the weights and the layer modules; its
own ``forward`` is not used for decoding because (a) it masks every image token out of the logits
(it is a text generator), and (b) its caches have one length for the whole batch, while rows of a
speculative batch accept different numbers of tokens per step. :class:`ChameleonLM` therefore runs
the same modules (projections, per-head q/k LayerNorms, rotary tables, MLPs, norms) over lantern's
static :class:`~lantern.decoding.cache.KVCache` with explicit per-row slots, positions and tree masks, the
way :class:`~lantern.models.llamagen.LlamaGen` does. ``tests/test_chameleon.py`` checks it against
transformers' own forward.

The image vocabulary: Chameleon's BPE vocabulary (65,536) holds the 8,192 VQGAN codes as tokens
named ``IMGIMG<digits as letters A-J>Z`` (``config.vocabulary_map``). Lantern's loop, acceptance
rules and proximity tables work in *code* space (0..8191, the VQGAN codebook index), so the model
exposes an ``image_head`` whose row ``c`` is the ``lm_head`` row of code ``c``'s BPE token:
restricting logits to it is exactly "sampling restricted to image tokens". Without a
``vocabulary_map`` (LANTERN's Anole config has none) codes map to BPE ids ``4 + c``, as LANTERN's
Anole and Lumina code assume (``image_token_offset = 4``; image tokens 4..8195).

Image layouts (:class:`ImageLayout`), from the public inference code:

* Anole (LANTERN ``models/ea_model_anole.py``): ``[BOS] prompt <reserved08706> <racm3:break>`` then
  32 x 32 codes; the guidance context is ``[BOS] <racm3:break>``.
* Lumina-mGPT (``lumina_mgpt/data/item_processor.py``, ``inference_solver.py``): the prompt "Generate
  an image of WxH according to the following prompt:\\n..." and the separator, then
  ``<racm3:break> <reserved{8800+h/32}> <reserved{8800+w/32}>``, then rows of ``w/16`` codes each
  followed by the new-line token ``<reserved08799>``, then ``<eoss>``. Guidance uses the context
  from ``<racm3:break>`` on.
"""

from __future__ import annotations

import os
import pickle
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor, nn

from lantern.decoding.cache import KVCache
from lantern.errors import TRANSFORMERS_LOAD_ERRORS, LanternError, check, transformers_reason
from lantern.models.hf_folder import (
    cached_attention,
    check_safetensors_header,
    check_sub_configs,
    indexed_shards,
    load_pretrained,
)
from lantern.models.invariant import AttentionCalls

if TYPE_CHECKING:  # transformers is an optional extra: import it only where a Chameleon is loaded
    from transformers import ChameleonForConditionalGeneration, ChameleonVQVAEConfig

# Token ids of the Chameleon vocabulary (facebook/chameleon-7b tokenizer, as used by Anole/Lumina).
BOS_ID = 0
IMAGE_START_ID = 8197  # <racm3:break>
IMAGE_END_ID = 8196  # <eoss>
SEPARATOR_ID = 8710  # <reserved08706>: ends a conversation turn (Lumina's template, LANTERN's Anole prompt)
NEW_LINE_ID = 8803  # <reserved08799>: Lumina-mGPT's end-of-row token
GRID_TOKEN_BASE = 8804  # <reserved{8800 + n}> = id 8804 + n: Lumina-mGPT's size tokens (n in 32-px units)
IMAGE_TOKEN_OFFSET = 4  # image tokens are BPE ids 4..8195 when the config has no vocabulary_map
LUMINA_PATCH = 32  # pixels per Lumina size-token unit
VQ_DOWNSAMPLE = 16  # pixels per code of the Chameleon VQGAN
LUMINA_TEMPLATE = "Generate an image of {width}x{height} according to the following prompt:\n{prompt}"
LAYOUTS = ("anole", "lumina-mgpt")


@dataclass(frozen=True)
class ImageLayout:
    """How one image sits in a Chameleon token sequence (all ids are BPE ids).

    cond = ``head + text + tail + prefix``; uncond (guidance context) = ``uncond``; then
    ``height`` rows of ``width`` codes, each row followed by ``eol`` when it is set.
    """

    name: str
    height: int  # code rows
    width: int  # codes per row
    head: tuple[int, ...] = (BOS_ID,)
    tail: tuple[int, ...] = (SEPARATOR_ID,)
    prefix: tuple[int, ...] = (IMAGE_START_ID,)
    uncond: tuple[int, ...] = (BOS_ID, IMAGE_START_ID)
    eol: int | None = None
    template: str = "{prompt}"
    pixel_size: tuple[int, int] = field(default=(512, 512))  # (height, width) in pixels

    def __post_init__(self) -> None:
        check(self.height >= 1 and self.width >= 1,
              f"image layout: grid must be positive, got {self.height}x{self.width}")
        check(len(self.prefix) >= 1, "image layout: prefix must hold at least the image-start token")
        check(
            tuple(self.uncond[-len(self.prefix) :]) == tuple(self.prefix),
            "image layout: the guidance context must end with the image prefix (the drafter reads those positions)",
        )

    @property
    def num_tokens(self) -> int:
        return self.height * self.width

    def format_prompt(self, prompt: str) -> str:
        h, w = self.pixel_size
        return self.template.format(prompt=prompt, width=w, height=h)

    def sequence(self, text_ids: Sequence[int], codes_bpe: Sequence[int]) -> list[int]:
        """The full token sequence for a prompt and (a prefix of) an image's codes, as BPE ids."""
        out = [*self.head, *text_ids, *self.tail, *self.prefix]
        for i, c in enumerate(codes_bpe):
            out.append(int(c))
            if self.eol is not None and (i + 1) % self.width == 0:
                out.append(self.eol)
        return out


def anole_layout() -> ImageLayout:
    """Anole-7b: 512 x 512 images, 32 x 32 codes, no row tokens."""
    return ImageLayout(name="anole", height=32, width=32)


def lumina_layout(size: int = 768, width: int | None = None) -> ImageLayout:
    """Lumina-mGPT at ``size`` pixels high and ``width`` wide (multiples of 32; 768 x 768 for
    Lumina-mGPT-7B-768). The prefix names the grid's rows, then its columns, in 32-pixel patches,
    as Lumina-mGPT's item processor writes it; the prompt names the size as width x height."""
    w_px = size if width is None else width
    for name, v in (("--image-size", size), ("--image-width", w_px)):
        check(v >= LUMINA_PATCH and v % LUMINA_PATCH == 0, f"{name} must be a positive multiple of 32, got {v}")
    prefix = (IMAGE_START_ID, GRID_TOKEN_BASE + size // LUMINA_PATCH, GRID_TOKEN_BASE + w_px // LUMINA_PATCH)
    return ImageLayout(
        name="lumina-mgpt",
        height=size // VQ_DOWNSAMPLE,
        width=w_px // VQ_DOWNSAMPLE,
        prefix=prefix,
        uncond=prefix,
        eol=NEW_LINE_ID,
        template=LUMINA_TEMPLATE,
        pixel_size=(size, w_px),
    )


def layout_by_name(name: str, size: int | None = None, width: int | None = None) -> ImageLayout:
    """The layout ``name`` at ``size`` pixels high and ``width`` wide (None: ``size``; both None:
    the layout's default)."""
    if name == "anole":
        check(size in (None, 512), f"Anole generates 512 x 512 images; --image-size {size} is not supported")
        check(width in (None, 512), f"Anole generates 512 x 512 images; --image-width {width} is not supported")
        return anole_layout()
    if name == "lumina-mgpt":
        return lumina_layout(768 if size is None else size, width)
    raise LanternError(f"--layout must be one of {', '.join(LAYOUTS)}, got {name!r}")


def image_token_ids(config: Any, num_codes: int) -> Tensor:
    """[num_codes] BPE id of each VQGAN code, from ``config.vocabulary_map`` (or offset 4)."""
    vocab_map = getattr(config, "vocabulary_map", None)
    if not vocab_map:
        ids = torch.arange(num_codes) + IMAGE_TOKEN_OFFSET
    else:
        digits = {chr(ord("A") + i): str(i) for i in range(10)}
        found: dict[int, int] = {}
        for name, bpe in vocab_map.items():
            if name.startswith("IMGIMG") and name.endswith("Z"):
                found[int("".join(digits.get(c, c) for c in name[len("IMGIMG") : -1]))] = int(bpe)
        missing = [c for c in range(num_codes) if c not in found]
        check(not missing, f"config.vocabulary_map has no image token for codes {missing[:5]} (of {num_codes})")
        ids = torch.tensor([found[c] for c in range(num_codes)])
    check(
        int(ids.max()) < config.vocab_size,
        f"image token ids reach {int(ids.max())}, past the vocabulary ({config.vocab_size})",
    )
    return ids


def code_token_name(code: int) -> str:
    """Chameleon's name for the BPE token of VQGAN code ``code`` (digits written as letters A-J)."""
    return "IMGIMG" + "".join(chr(ord("A") + int(d)) for d in str(code)) + "Z"


def default_vocabulary_map(num_codes: int) -> dict[str, int]:
    """The image part of a vocabulary map under the offset-4 convention (code c = BPE id 4 + c)."""
    return {code_token_name(c): IMAGE_TOKEN_OFFSET + c for c in range(num_codes)} | {"<image>": 8711}


class ChameleonLM(nn.Module):
    """A transformers Chameleon decoder run over lantern's static KV cache, in code space."""

    image_ids: Tensor  # a buffer [V_codes]: each code's BPE id
    attention_calls: AttentionCalls | None = None  # batch-invariant mode's (lantern.models.invariant)

    def __init__(self, hf_model: ChameleonForConditionalGeneration, num_codes: int | None = None) -> None:
        super().__init__()
        cfg = hf_model.config
        self.hf = hf_model.eval()
        self.config = cfg
        # transformers annotates a sub-config as its argument (dict | config | None); loaded, it is the config
        vq = cast("ChameleonVQVAEConfig", cfg.vq_config)
        n_codes = num_codes if num_codes is not None else vq.num_embeddings
        self.num_codes = int(n_codes)
        # on the model's device: the wrapper is built around a model already moved there (load_chameleon),
        # and nothing moves the wrapper after, so a CPU buffer would be indexed by CUDA codes (code_to_bpe)
        weight = self.hf.lm_head.weight
        self.register_buffer("image_ids", image_token_ids(cfg, self.num_codes).to(weight.device), persistent=False)
        self.n_head = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads or cfg.num_attention_heads
        self.head_dim = cfg.hidden_size // cfg.num_attention_heads
        self.swin_norm = bool(cfg.swin_norm)
        # Code-space head: a Linear (the drafter needs one) sharing the image rows of lm_head.
        self.image_head = nn.Linear(cfg.hidden_size, self.num_codes, bias=False, device=weight.device,
                                    dtype=weight.dtype)
        with torch.no_grad():
            self.image_head.weight.copy_(weight[self.image_ids])

    @property
    def device(self) -> torch.device:
        return self.hf.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.hf.lm_head.weight.dtype

    @property
    def n_layer(self) -> int:
        return self.config.num_hidden_layers

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    def code_to_bpe(self, codes: Tensor) -> Tensor:
        return self.image_ids[codes]

    def embed(self, ids: Tensor) -> Tensor:
        return self.hf.model.embed_tokens(ids)

    def image_logits(self, hidden: Tensor) -> Tensor:
        """hidden [..., D] (after the final norm) -> logits over the image codes [..., V_img], float32."""
        return self.image_head(hidden).float()

    def _attention(self, layer_idx: int, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, cache: KVCache,
                   slots: Tensor, kv_start: int = 0) -> Tensor:
        from transformers.models.chameleon.modeling_chameleon import apply_rotary_pos_emb

        attn = self.hf.model.layers[layer_idx].self_attn
        n, t, _ = x.shape
        # Chameleon's q/k LayerNorms normalise each head separately with per-head gamma/beta.
        q = attn.q_norm(attn.q_proj(x).reshape(-1, self.n_head, self.head_dim))
        k = attn.k_norm(attn.k_proj(x).reshape(-1, self.kv_heads, self.head_dim))
        q = q.reshape(n, t, self.n_head, self.head_dim).transpose(1, 2)
        k = k.reshape(n, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = attn.v_proj(x).view(n, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        out = cached_attention(q, k, v, mask, cache, layer_idx, slots, kv_start=kv_start, calls=self.attention_calls)
        return attn.o_proj(out.transpose(1, 2).reshape(n, t, -1))

    def forward_cached(self, ids: Tensor, positions: Tensor, slots: Tensor, mask: Tensor, cache: KVCache,
                       kv_start: int = 0) -> Tensor:
        """ids / positions / slots [N, T], mask [N, T, S] bool over cache slots ``kv_start`` ..
        ``kv_start + S - 1`` -> final-norm hidden [N, T, D]."""
        x = self.embed(ids)
        cos, sin = self.hf.model.rotary_emb(x, positions)
        for i, layer in enumerate(self.hf.model.layers):
            if self.swin_norm:  # Chameleon-30B: norms after attention / MLP instead of before
                x = x + layer.input_layernorm(self._attention(i, x, cos, sin, mask, cache, slots, kv_start))
                x = x + layer.post_attention_layernorm(layer.mlp(x))
            else:
                x = x + self._attention(i, layer.input_layernorm(x), cos, sin, mask, cache, slots, kv_start)
                x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.hf.model.norm(x)

    @torch.no_grad()
    def reference_hidden(self, ids: Tensor) -> Tensor:
        """transformers' own uncached forward over full sequences [N, L] -> hidden [N, L, D] (tests)."""
        return self.hf.model(input_ids=ids, use_cache=False).last_hidden_state


# ----------------------------------------------------------------------------------------------
# Loading


CHAMELEON_MODEL_TYPE = "chameleon"


def load_chameleon(directory: str | os.PathLike[str], dtype: torch.dtype | None = None,
                   device: str | torch.device = "cpu") -> ChameleonLM:
    """An HF-format Chameleon folder (Anole-7b-hf, Lumina-mGPT-7B-*: ``config.json`` with
    ``model_type: chameleon`` + safetensors) through transformers, wrapped for lantern."""
    directory = Path(directory)
    check_chameleon_folder(directory)
    try:
        from transformers import ChameleonConfig
    except ImportError as e:  # pragma: no cover - the t2i extra is part of dev
        raise LanternError("Chameleon targets need transformers: pip install 'lantern-ar[t2i]'") from e

    try:
        config = ChameleonConfig.from_pretrained(str(directory))
    except TRANSFORMERS_LOAD_ERRORS as e:
        raise LanternError(f"--model {directory}/config.json: transformers could not read it: "
                           f"{transformers_reason(e)}") from None
    if not config.vocabulary_map:  # e.g. LANTERN's anole_config.json: transformers needs one to build the model
        vq = cast("ChameleonVQVAEConfig", config.vq_config)  # (a loaded sub-config: see ChameleonLM)
        config.vocabulary_map = default_vocabulary_map(vq.num_embeddings)
    # Chameleon folders may hold pytorch_model*.bin (transformers reads them weights-only); images
    # are decoded by the folder's VQGAN checkpoint (vqgan.ckpt), so transformers' VQ model may be absent
    shards = shard_norm_rows(directory, config)
    options: dict[str, Any] = dict(spare=("model.vqmodel.",), refilled=None if shards is None else SHARD_NORM_KEYS,
                                   config=config, use_safetensors=None)
    try:
        model = load_pretrained("ChameleonForConditionalGeneration", directory, "Chameleon", dtype, **options)
    except pickle.UnpicklingError:  # transformers' weights-only refusal: many paragraphs, no file name
        raise LanternError(_refused_pickle(directory)) from None
    if shards is not None:
        fill_shard_norms(model, directory, shards)
    return ChameleonLM(model.to(device))


def _refused_pickle(directory: Path) -> str:
    """Why transformers refused the folder's ``pytorch_model*.bin``, in one line: the file and the
    class it names (lantern's own weights-only reader finds them). transformers reads a model
    folder's pickles weights-only whatever lantern is told, so ``--trust-checkpoint`` cannot help:
    the way out is safetensors."""
    from lantern.io import load_checkpoint

    files = sorted(directory.glob("pytorch_model*.bin"))
    reason = f"{', '.join(f.name for f in files) or 'its pickled weights'} hold objects besides tensors"
    for file in files:
        try:
            load_checkpoint(file, "weights", trust=False)
        except LanternError as e:
            reason = str(e).split(", which lantern does not load")[0]
            break
    return (f"--model {directory}: {reason}; transformers reads a model folder's pickles tensors-only, even with "
            "--trust-checkpoint: if you trust the file, re-save its tensors as model.safetensors")


# Lumina-mGPT's own Chameleon code keeps each attention's q/k LayerNorm once per model-parallel
# shard, ``[model_parallel_size, head_dim]``, and repeats a shard's row over that shard's heads at
# run time (Alpha-VLLM/Lumina-mGPT: ``ChameleonLayerNorm`` in lumina_mgpt/model/chameleon/
# modeling_chameleon.py; its weight converter writes ``[1, head_dim]`` for an unsharded model).
# transformers' Chameleon holds one row per head: a Lumina-mGPT folder loads with its rows repeated
# as Lumina's code repeats them, which is the same function.
SHARD_NORM_KEYS = re.compile(r"model\.layers\.\d+\.self_attn\.[qk]_norm\.(weight|bias)")


def _safetensors_files(directory: Path) -> dict[str, Path]:
    """Which safetensors file holds each key (the index's map when there is one, as transformers reads)."""
    from safetensors import safe_open

    shards = indexed_shards(directory)
    if shards is not None:
        return shards
    files: dict[str, Path] = {}
    for path in sorted(directory.glob("model*.safetensors")):  # not proximity.safetensors
        with safe_open(str(path), framework="pt") as f:
            files.update(dict.fromkeys(f.keys(), path))
    return files


def shard_norm_rows(directory: Path, config: Any) -> int | None:
    """The shard count when the folder's q/k norms are Lumina-mGPT's per-shard rows (fewer rows
    than heads, as many as ``model_parallel_size``), else None (transformers' per-head rows, or
    weights only in pickles, whose shapes transformers itself checks)."""
    from safetensors import safe_open

    path = _safetensors_files(directory).get("model.layers.0.self_attn.q_norm.weight")
    if path is None:
        return None
    with safe_open(str(path), framework="pt") as f:
        shape = tuple(f.get_slice("model.layers.0.self_attn.q_norm.weight").get_shape())
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    shards = int(getattr(config, "model_parallel_size", 1) or 1)
    if len(shape) != 2 or shape[0] == heads or shape[0] != shards:
        return None  # per-head rows, or a shape transformers refuses by name
    check(heads % shards == 0 and kv_heads % shards == 0,
          f"--model {directory}: q/k norms of {shards} model-parallel rows (Lumina-mGPT's layout) need heads "
          f"({heads}) and key/value heads ({kv_heads}) that are multiples of it")
    return shards


def fill_shard_norms(model: ChameleonForConditionalGeneration, directory: Path, shards: int) -> None:
    """Each layer's q/k norm rows from the folder, each shard's row repeated over its heads."""
    from safetensors import safe_open

    files = _safetensors_files(directory)
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    params = dict(model.named_parameters())
    kv_heads = config.num_key_value_heads
    assert kv_heads is not None  # transformers built the model's k_norm with it
    for i in range(config.num_hidden_layers):
        for norm, heads in (("q_norm", config.num_attention_heads), ("k_norm", kv_heads)):
            for part in ("weight", "bias"):
                key = f"model.layers.{i}.self_attn.{norm}.{part}"
                check(key in files and key in params, f"--model {directory}: the weights lack {key}")
                with safe_open(str(files[key]), framework="pt") as f:
                    rows = f.get_tensor(key)
                check(tuple(rows.shape) == (shards, head_dim),
                      f"--model {directory}: {key} has shape {list(rows.shape)}; expected [{shards}, {head_dim}] "
                      f"(one row per model-parallel shard) like layer 0's, or [{heads}, {head_dim}] (one per head)")
                with torch.no_grad():
                    params[key].copy_(rows.repeat_interleave(heads // shards, dim=0))


def check_chameleon_folder(directory: Path) -> None:
    from lantern.io import read_json

    config_file = directory / "config.json"
    if not config_file.is_file():
        raise LanternError(f"--model: {directory} has no config.json: not a model folder")
    raw = read_json(config_file, "model config")
    check(
        isinstance(raw, dict) and raw.get("model_type") == CHAMELEON_MODEL_TYPE,
        f"--model: {config_file} is not a Chameleon config (model_type {CHAMELEON_MODEL_TYPE!r} expected)",
    )
    # LANTERN's released drafters are Chameleon folders too (the target's config, one layer), and
    # would otherwise be refused for a missing tokenizer, which sends the user the wrong way
    check(not (raw.get("num_hidden_layers") == 1 and not (directory / "tokenizer.json").is_file()),
          f"--model: {directory} holds one Chameleon layer and no tokenizer, as LANTERN's released drafters "
          "(jadohu/anole_drafter) do: pass it as --drafter, and the model it drafts for as --model")
    # the image vocabulary's size comes from vq_config: without one transformers builds its default
    check_sub_configs(directory, raw, "Chameleon", ("vq_config",))
    weights = list(directory.glob("model*.safetensors")) + list(directory.glob("pytorch_model*.bin"))
    check(bool(weights), f"--model: {directory} has a Chameleon config but no weights (model*.safetensors)")
    indexed_shards(directory)  # every listed shard is there
    for path in sorted(directory.glob("*.safetensors")):
        check_safetensors_header(path)


def is_chameleon_folder(directory: str | os.PathLike[str]) -> bool:
    """True when ``directory/config.json`` declares ``model_type: chameleon``."""
    import json

    config_file = Path(directory) / "config.json"
    if not config_file.is_file():
        return False
    try:
        raw = json.loads(config_file.read_text())
    except (OSError, ValueError, RecursionError):  # unreadable: not a Chameleon folder (read_json names it later)
        return False
    return isinstance(raw, dict) and raw.get("model_type") == CHAMELEON_MODEL_TYPE


def refuse_original_release(directory: str | os.PathLike[str]) -> None:
    """A one-line error for Meta's original Chameleon layout (``facebook/chameleon-7b``,
    ``GAIR/Anole-7b-v0.1``: ``models/<size>/consolidated*.pth`` + ``params.json`` and
    ``tokenizer/text_tokenizer.json`` / ``vqgan.ckpt``, no ``config.json``): lantern reads the
    transformers conversion of those weights, and its VQGAN from the release's ``tokenizer/``.
    Without this the folder falls through to the LlamaGen loader and is called "not a model
    folder" (or, with ``--layout``, not a Chameleon-family model at all)."""
    root = Path(directory)
    if not root.is_dir() or (root / "config.json").is_file():
        return
    tokenizer = root / "tokenizer"
    weights = sorted(root.glob("models/*/params.json"))
    if not ((tokenizer / "text_tokenizer.json").is_file() or weights):
        return
    vq = tokenizer / "vqgan.ckpt"
    raise LanternError(
        f"--model {root} is Meta's original Chameleon-format release (models/, tokenizer/text_tokenizer.json; e.g. "
        "GAIR/Anole-7b-v0.1), which lantern does not read: use its transformers conversion (leloy/Anole-7b-v0.1-hf, "
        "or transformers' convert_chameleon_weights_to_hf.py) as --model"
        + (f", with --vq {vq}" if vq.is_file() else ", with --vq pointing at the release's tokenizer/vqgan.ckpt"))
