"""What every transformers-format model folder shares (Janus / Janus-Pro, Emu3; Chameleon reads its
safetensors check): reading ``config.json`` without running anything, refusing folders that need
their own code, reading weights from safetensors only, and running a Llama-style decoder of
transformers' modules over lantern's static KV cache.

Why one place: each family's loader must refuse the same things the same way (a folder's own
Python code, pickled weights, a truncated safetensors file), and the cached decoder is the piece
that makes a transformers model speak lantern's loop (per-row slots, positions and tree masks);
a fix to either must reach every family.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
from collections.abc import Iterator
from contextvars import ContextVar
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from lantern.decoding.cache import KVCache
from lantern.errors import TRANSFORMERS_LOAD_ERRORS, LanternError, check
from lantern.models.attention import attend
from lantern.models.invariant import AttentionCalls

# model_type values of releases that need their authors' own code package (DeepSeek's original Janus)
ORIGINAL_MODEL_TYPES = ("multi_modality",)


def read_model_config(directory: Path) -> dict[str, Any] | None:
    """``directory/config.json`` as a dict, or None when there is none or it is not JSON (not a
    model folder; the family's own loader names a broken file)."""
    config_file = directory / "config.json"
    if not config_file.is_file():
        return None
    try:
        raw = json.loads(config_file.read_text())
    except (OSError, ValueError, RecursionError):
        return None
    return raw if isinstance(raw, dict) else None


def refuse_remote_code(directory: str | os.PathLike[str]) -> None:
    """A one-line error when the folder's ``config.json`` needs the folder's own Python code
    (``auto_map``: transformers' ``trust_remote_code``) or a model package lantern does not run
    (DeepSeek's original Janus release); lantern never runs a model folder's code."""
    root = Path(directory)
    raw = read_model_config(root)
    if raw is None:
        return
    if "auto_map" in raw:
        # BAAI's original Emu3 release (BAAI/Emu3-Gen: model_type "Emu3") has a converted twin on the Hub
        known = (" (BAAI/Emu3-Gen-hf, or transformers' convert_emu3_weights_to_hf.py)"
                 if str(raw.get("model_type", "")).lower() == "emu3" else "")
        raise LanternError(f"--model {root}/config.json asks to run the folder's own Python code (auto_map, "
                           "transformers' trust_remote_code), which lantern never does: use a transformers-native "
                           f"conversion of the model{known}")
    if raw.get("model_type") in ORIGINAL_MODEL_TYPES:
        raise LanternError(f"--model {root} is DeepSeek's original Janus release (model_type "
                           f"{raw['model_type']!r}), which needs DeepSeek's own code: use the transformers conversion "
                           "(deepseek-community/Janus-Pro-7B, or transformers' convert_janus_weights_to_hf.py)")


def check_sub_configs(directory: Path, raw: dict[str, Any], family: str, names: tuple[str, ...]) -> None:
    """Every sub-config the family's model is built from is in ``config.json``: without one,
    transformers builds that part at its default size (a 7B language model, ~17 GB on a CPU)
    before the weights fail to fit it."""
    for name in names:
        if not isinstance(raw.get(name), dict):
            raise LanternError(f"--model: {directory}/config.json has no {name} (a {family} config holds "
                               f"{', '.join(names)}): the file is damaged or not a transformers {family} config")


def check_safetensors_header(path: Path) -> None:
    """Open ``path``'s header (no tensor is read): a truncated file, or a header whose offsets
    point past its end, is named here rather than deep inside transformers' loader."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt"):
            pass
    except SafetensorError as e:
        raise LanternError(f"--model: {path} is not a readable safetensors file ({e})") from None
    except OSError as e:  # e.g. a Hub cache's link to a blob an interrupted download never finished
        raise LanternError(f"--model: {path} cannot be read ({e.strerror or type(e).__name__}"
                           + (": a link whose file is missing, as an interrupted download leaves; download it again"
                              if path.is_symlink() and not path.exists() else "") + ")") from None


def indexed_shards(directory: Path) -> dict[str, Path] | None:
    """The weight map of ``directory/model.safetensors.index.json`` (tensor name -> its shard), or
    None without an index. transformers reads exactly the shards it lists, so lantern's own readers
    do too: a shard it does not list (left from an older download) is never read, and a listed one
    that is missing is named here."""
    from lantern.io import read_json_object

    index = directory / "model.safetensors.index.json"
    if not index.is_file():
        return None
    weight_map = read_json_object(index, "safetensors index").get("weight_map")
    check(isinstance(weight_map, dict) and bool(weight_map) and all(isinstance(v, str) for v in weight_map.values()),
          f"{index} has no weight_map of tensor names to shard files")
    assert isinstance(weight_map, dict)
    shards = {str(key): directory / name for key, name in weight_map.items()}
    for path in sorted(set(shards.values())):
        check(path.is_file() and path.parent == directory, f"{index} lists the shard {path.name}, which is not in "
                                                           f"{directory} (an interrupted download? download the "
                                                           "model again)")
    return shards


def check_safetensors_weights(directory: Path, family: str) -> None:
    """The folder's weights are safetensors with readable headers; pickles (``*.bin``) are never
    read, and the error names them."""
    weights = sorted(directory.glob("*.safetensors"))
    if not weights:
        other = sorted(p.name for p in directory.glob("*.bin"))
        raise LanternError(f"--model: {directory} has {'an' if family[0] in 'AEIOU' else 'a'} {family} config but no "
                           "*.safetensors weights"
                           + (f" ({', '.join(other)} are pickles: lantern reads {family} weights from safetensors "
                              "only)" if other else ""))
    indexed_shards(directory)  # every listed shard is there (else transformers' own error, worded its way)
    for path in weights:
        check_safetensors_header(path)


# Whether transformers may draw its own "Loading weights" bar: the command line turns it off with
# its own bars (--no-progress, and torchrun ranks other than 0), which transformers cannot know.
LOADING_BARS: ContextVar[bool] = ContextVar("lantern_loading_bars", default=True)


@contextlib.contextmanager
def loading_bars() -> Iterator[None]:
    """Around a transformers load: its bar off where :data:`LOADING_BARS` says so, as it was after."""
    from transformers.utils import logging as hf_logging

    off = not LOADING_BARS.get() and hf_logging.is_progress_bar_enabled()
    if off:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if off:
            hf_logging.enable_progress_bar()


def load_pretrained(class_name: str, directory: Path, family: str, dtype: torch.dtype | None,
                    spare: tuple[str, ...] = (), refilled: re.Pattern[str] | None = None, **options: Any) -> Any:
    """transformers' ``class_name.from_pretrained`` on a checked folder: safetensors only unless
    ``options`` say otherwise (more keywords of ``from_pretrained``), bf16 unless told, its failures
    as one line naming the folder, and strict: a weight the folder lacks is refused
    (:func:`check_complete`; ``spare``: key prefixes of modules lantern never runs). ``refilled``:
    keys whose file shape may differ from the model's, because the caller fills them itself after
    the load (a release's own layout of them); any other shape mismatch is still refused."""
    if refilled is not None:
        options = {**options, "ignore_mismatched_sizes": True}
    try:
        import transformers
    except ImportError as e:  # pragma: no cover - the t2i extra is part of dev
        raise LanternError(f"{family} targets need transformers: pip install 'lantern-ar[t2i]'") from e
    from safetensors import SafetensorError

    from lantern.errors import transformers_reason

    # (a named tuple: mypy reads no starred tuple in an except clause)
    load_errors: tuple[type[Exception], ...] = (*TRANSFORMERS_LOAD_ERRORS, RuntimeError, SafetensorError)

    # transformers logs a loading report of many lines: held back, so that a failure is one line
    # naming its first problem, and passed on as transformers would print it when the load succeeds
    root = transformers.utils.logging.get_logger("transformers")
    report, held = _Report(), [h for h in root.handlers if isinstance(h, logging.StreamHandler)]
    for handler in held:
        root.removeHandler(handler)
    root.addHandler(report)
    try:
        with loading_bars():
            model, info = getattr(transformers, class_name).from_pretrained(
                str(directory), **{"use_safetensors": True, **options}, dtype=dtype or torch.bfloat16,
                output_loading_info=True)
    except load_errors as e:
        reason = transformers_reason(e) if report.first is None else \
            f"the weights do not fit config.json ({report.first})"
        raise LanternError(f"--model {directory}: transformers could not load the {family} weights: {reason}") \
            from None
    finally:
        root.removeHandler(report)
        for handler in held:
            root.addHandler(handler)
    check_complete(info, directory, family, spare)
    if refilled is not None:
        other = sorted(key for key, *_ in info.get("mismatched_keys", ()) if not refilled.fullmatch(key))
        check(not other, f"--model {directory}: transformers could not load the {family} weights: the weights do "
                         f"not fit config.json ({other[0] if other else ''} has another shape)")
    for record in report.records:  # e.g. keys of the folder the model has no place for (UNEXPECTED)
        if refilled is None or "MISMATCH" not in record.getMessage():  # refilled keys: not a problem
            logging.getLogger(record.name).handle(record)
    return model


def check_complete(info: dict[str, Any], directory: Path, family: str, spare: tuple[str, ...] = ()) -> None:
    """Refuse a load that left weights of the model out (``info``: transformers' loading info).
    transformers starts such weights at random with a warning and the run goes on to draw noise; a
    folder of another version or conversion (renamed keys) is the usual cause. Keys under
    ``spare`` (modules lantern never runs) may be missing."""
    missing = sorted(key for key in info.get("missing_keys", ()) if not key.startswith(spare))
    check(not missing, f"--model {directory}: the folder's weights lack {len(missing)} tensor(s) of the {family} "
                       f"model, e.g. {missing[0] if missing else ''} (transformers' name for it; transformers would "
                       "start them at random)")


class _Report(logging.Handler):
    """Keeps transformers' log records of a load, and the first MISMATCH / MISSING / UNEXPECTED row of
    its loading report as one line."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.first: str | None = None
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)
        if self.first is not None:
            return
        for line in re.sub(r"\x1b\[[0-9;]*m", "", record.getMessage()).splitlines():
            if any(status in line for status in ("MISMATCH", "MISSING", "UNEXPECTED")):
                self.first = " ".join(line.replace("|", " ").split())[:200]
                return


def cached_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, cache: KVCache, layer_idx: int, slots: Tensor,
                     scale: float | None = None, kv_start: int = 0, calls: AttentionCalls | None = None) -> Tensor:
    """Attention of the queries over lantern's cache: the new keys and values ([N, Hkv, T, Dh],
    rotated) are written at per-row ``slots`` first, then every query reads the ``mask.shape[-1]``
    slots from ``kv_start`` on under ``mask`` [N, T, S] (grouped heads repeated). -> [N, H, T, Dh]."""
    cache.write(layer_idx, slots, k, v)
    k, v = cache.read(layer_idx, kv_start + mask.shape[-1], kv_start)
    k, v = k.to(q.dtype), v.to(q.dtype)
    if k.shape[1] != q.shape[1]:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return attend(q, k, v, mask, scale=scale, calls=calls)


class CachedDecoder(nn.Module):
    """A transformers Llama-style decoder (``lm``: embed_tokens, layers of self_attn / mlp and
    their norms, norm, rotary_emb) run over lantern's static KV cache: the queries' keys and values
    are written at per-row ``slots`` and attention reads the cache under lantern's [N, T, S] mask,
    so one forward serves prefill, AR steps and tree or Jacobi verification alike. Subclasses set
    ``self.lm`` and ``self.config`` (the text config) through :meth:`_set_decoder` and define
    :meth:`embed`."""

    lm: Any
    config: Any
    attention_calls: AttentionCalls | None = None  # batch-invariant mode's (lantern.models.invariant)

    def _set_decoder(self, lm: nn.Module, text_config: Any) -> None:
        self.lm, self.config = lm, text_config
        self.n_head = text_config.num_attention_heads
        self.kv_heads = text_config.num_key_value_heads or self.n_head
        self.head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // self.n_head

    @property
    def n_layer(self) -> int:
        return int(self.config.num_hidden_layers)

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    def embed(self, ids: Tensor) -> Tensor:  # pragma: no cover - every family defines its own
        raise NotImplementedError

    def _attention(self, layer_idx: int, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, cache: KVCache,
                   slots: Tensor, kv_start: int = 0) -> Tensor:
        # Llama's rotary helper: Janus's language model is a Llama, and Emu3's copy is the same code.
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        attn = self.lm.layers[layer_idx].self_attn
        n, t, _ = x.shape
        q = attn.q_proj(x).view(n, t, self.n_head, self.head_dim).transpose(1, 2)
        k = attn.k_proj(x).view(n, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = attn.v_proj(x).view(n, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        out = cached_attention(q, k, v, mask, cache, layer_idx, slots, scale=attn.scaling, kv_start=kv_start,
                               calls=self.attention_calls)
        return attn.o_proj(out.transpose(1, 2).reshape(n, t, -1))

    def forward_cached(self, ids: Tensor, positions: Tensor, slots: Tensor, mask: Tensor, cache: KVCache,
                       kv_start: int = 0) -> Tensor:
        """ids / positions / slots [N, T], mask [N, T, S] bool over cache slots ``kv_start`` ..
        ``kv_start + S - 1`` -> final-norm hidden [N, T, D]."""
        x = self.embed(ids)
        cos, sin = self.lm.rotary_emb(x, positions)
        for i, layer in enumerate(self.lm.layers):
            x = x + self._attention(i, layer.input_layernorm(x), cos, sin, mask, cache, slots, kv_start)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.lm.norm(x)
