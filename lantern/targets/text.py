"""Text conditioning for LlamaGen text-to-image models: prompt files and the T5 encoder front end.

LlamaGen T2I conditions on the encoder of ``google/flan-t5-xl``: the prompt is tokenized into
``max_length`` (= the target's ``cls_token_num``, 120) slots, right-padded by the tokenizer, and
encoded with the padding masked out. LlamaGen then *left*-pads the result ([LlamaGen code] sample_t2i.py): each row's
valid embeddings move to the end of the 120 slots, in order, the padded slots become exact zeros
and the mask is flipped to match. The target only ever sees this left-padded form, and the
unconditional CFG row (the stored ``uncond_embedding``) reuses the same mask (``LlamaGenTarget``).

transformers is imported lazily (``pip install 'lantern-ar[t2i]'``), so class-conditional use never
needs it. Prompts are lower-cased and their whitespace collapsed before tokenization: that is the
part of LlamaGen's DeepFloyd-IF ``clean_caption`` pass that changes ordinary prompts (it also strips
URLs, HTML and some punctuation runs, which lantern does not reproduce).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import pickle
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from lantern.errors import TRANSFORMERS_LOAD_ERRORS, LanternError, check, transformers_reason
from lantern.io import TRUST_FLAG, checkpoints_trusted, load_checkpoint, read_json

if TYPE_CHECKING:  # transformers is an optional extra: imported where a T5 is loaded
    from transformers import T5EncoderModel

T5_MAX_LENGTH = 120  # caption slots of LlamaGen T2I (= cls_token_num)
INSTALL_HINT = "pip install 'lantern-ar[t2i]'"
_TOKENIZER_FILES = ("tokenizer.json", "spiece.model")
_WEIGHT_FILES = (
    "model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json"
)


@dataclass(frozen=True)
class Captions:
    """Left-padded caption embeddings and their mask, one row per image ([LlamaGen code] sample_t2i.py)."""

    embeddings: Tensor  # [B, L, C]; the valid rows sit at the end, padded rows are exactly 0
    mask: Tensor  # [B, L] bool, True = a valid caption token

    def __post_init__(self) -> None:
        check(
            self.embeddings.dim() == 3 and tuple(self.mask.shape) == tuple(self.embeddings.shape[:2]),
            f"captions must be [B, L, C] with a [B, L] mask, got {tuple(self.embeddings.shape)} "
            f"and {tuple(self.mask.shape)}",
        )

    def __len__(self) -> int:
        return int(self.embeddings.shape[0])

    def repeat_interleave(self, n: int) -> Captions:
        """Each row ``n`` times in a row (``--num-per-prompt``)."""
        return Captions(self.embeddings.repeat_interleave(n, dim=0), self.mask.repeat_interleave(n, dim=0))


def left_pad(embeddings: Tensor, mask: Tensor) -> Captions:
    """Move each row's valid embeddings to the end (order kept) and zero the other rows.

    For the tokenizer's right padding (mask = v ones then zeros) this is exactly LlamaGen's
    ``cat(emb[v:], emb[:v]) * flip(mask)``; written as a scatter it also holds for any padding side.
    """
    b, length = mask.shape
    valid = mask.bool()
    count = valid.sum(dim=1)  # [B]
    dest = valid.long().cumsum(dim=1) - 1 + (length - count)[:, None]  # target slot of each valid row
    rows = torch.arange(b, device=mask.device)[:, None].expand(b, length)
    out = torch.zeros_like(embeddings)
    out[rows[valid], dest[valid]] = embeddings[valid]
    new_mask = torch.arange(length, device=mask.device)[None, :] >= (length - count)[:, None]
    return Captions(out, new_mask)


def normalize_prompt(text: str) -> str:
    """Lower-case and collapse whitespace (the part of LlamaGen's caption cleaning that matters for
    plain prompts: flan-t5's vocabulary is case-sensitive and LlamaGen trained on lower-cased text)."""
    return " ".join(text.lower().split())


def check_text(prompt: str, what: str) -> None:
    """A one-line error unless ``prompt`` is text a tokenizer can take: a lone surrogate (a byte
    that was not UTF-8, as Python decodes a command line, or half of a UTF-16 pair) is not, and
    would fail deep inside the tokenizer."""
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as e:
        raise LanternError(f"{what} is not valid text: character {e.start} ({prompt[e.start]!r}) is a lone "
                           "surrogate (a byte that is not UTF-8, or half of a UTF-16 pair); expected UTF-8 text"
                           ) from None


def check_prompts(prompts: list[str], what: str = "--prompt") -> list[str]:
    check(len(prompts) > 0, f"{what}: no prompts given")
    for i, p in enumerate(prompts):
        check(bool(p.strip()), f"{what}: prompt {i} is empty")
        check_text(p, f"{what}: prompt {i}")
    return [p.strip() for p in prompts]


def read_prompts(path: str | os.PathLike[str]) -> list[str]:
    """Prompts of a text file, one per line (LF or CRLF line ends; a byte-order mark, as Windows
    editors write, is dropped); blank lines are skipped, the order is kept. Lines are split at line
    ends only: ``str.splitlines`` would also split a prompt at U+2028, form feeds and the like.

    The prompt sets of the field's evaluations are read as they come ([LANTERN code]
    data/prompts): a ``.tsv`` by its ``Prompt`` (or ``caption``) column (PartiPrompts), a ``.json``
    list of strings or of objects with a ``caption`` / ``prompt``, or COCO's caption file
    (``annotations``). Read line by line, their headers and other columns became prompts."""
    path = Path(path)
    if not path.exists():
        raise LanternError(f"--prompts: no such file {path}")
    if not path.is_file():
        raise LanternError(f"--prompts: {path} is not a file")
    try:
        text = path.read_text(encoding="utf-8-sig")  # -sig: a BOM would become part of the first prompt
    except UnicodeDecodeError as e:
        raise LanternError(f"--prompts: {path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    suffix = path.suffix.lower()
    if suffix == ".json":
        prompts = _json_prompts(path)
    elif suffix == ".tsv":
        prompts = _tsv_prompts(text, path)
    else:
        prompts = [line.strip() for line in text.split("\n") if line.strip()]  # strip() takes the \r of \r\n
    check(bool(prompts), f"--prompts: {path} holds no prompts (expected one prompt per line)")
    return prompts


PROMPT_FIELDS = ("prompt", "caption", "text")  # a prompt's field in the field's .tsv / .json prompt sets


def _tsv_prompts(text: str, path: Path) -> list[str]:
    import csv

    rows = csv.reader(text.split("\n"), delimiter="\t")
    header = [name.strip().lower() for name in next(rows, [])]
    column = next((header.index(name) for name in PROMPT_FIELDS if name in header), None)
    check(column is not None, f"--prompts: {path} is a .tsv without a Prompt or caption column (its header: "
                              f"{', '.join(header) or 'empty'}); a plain one-prompt-per-line file is a .txt")
    assert column is not None
    return [row[column].strip() for row in rows if len(row) > column and row[column].strip()]


def _json_prompts(path: Path) -> list[str]:
    from lantern.io import read_json

    raw = read_json(path, "prompts file")
    if isinstance(raw, dict) and isinstance(raw.get("annotations"), list):  # COCO's captions_*.json
        raw = raw["annotations"]
    items = raw if isinstance(raw, list) else None
    check(items is not None, f"--prompts: {path} is JSON but not a list of prompts (or COCO's annotations)")
    assert items is not None
    prompts = []
    for i, item in enumerate(items):
        if isinstance(item, dict):
            item = next((item[name] for name in PROMPT_FIELDS if isinstance(item.get(name), str)), None)
        check(isinstance(item, str), f"--prompts: {path}: entry {i} is neither a string nor an object with a "
                                     f"{' / '.join(PROMPT_FIELDS)}")
        if item.strip():
            prompts.append(item.strip())
    return prompts


def require_transformers() -> None:
    if importlib.util.find_spec("transformers") is None:
        raise LanternError(f"text-to-image models need the transformers package for the T5 encoder: {INSTALL_HINT}")


def check_t5_folder(path: str | os.PathLike[str], caption_dim: int | None = None) -> dict[str, Any]:
    """Check that ``path`` is a local T5 encoder folder (config, tokenizer, weights) without loading
    it; with ``caption_dim``, that its width is what the target's caption projection expects."""
    path = Path(path)
    if not path.exists():
        raise LanternError(f"--t5: no such folder {path} (expected a local copy of google/flan-t5-xl)")
    if not path.is_dir():
        raise LanternError(f"--t5: {path} is not a folder (expected a local copy of google/flan-t5-xl)")
    if not (path / "config.json").is_file():
        raise LanternError(f"--t5: {path} has no config.json: not a T5 model folder (e.g. google/flan-t5-xl)")
    config = read_json(path / "config.json", "T5 config")
    model_type = config.get("model_type") if isinstance(config, dict) else None
    check(
        model_type == "t5",
        f"--t5: {path} holds a {model_type!r} model, not a T5 encoder (config.json model_type must be 't5')",
    )
    check(
        any((path / f).is_file() for f in _TOKENIZER_FILES),
        f"--t5: {path} has no tokenizer ({' or '.join(_TOKENIZER_FILES)})",
    )
    check(
        any((path / f).is_file() for f in _WEIGHT_FILES),
        f"--t5: {path} has no weights ({', '.join(_WEIGHT_FILES)})",
    )
    if caption_dim is not None:
        d_model = config.get("d_model")
        check(
            d_model == caption_dim,
            f"--t5: the encoder in {path} has d_model {d_model}, but the target's caption projection expects "
            f"{caption_dim} (LlamaGen T2I uses google/flan-t5-xl, d_model 2048)",
        )
    return config


class T5Encoder:
    """Prompts -> left-padded caption embeddings [B, max_length, d_model] and mask ([LlamaGen code] sample_t2i.py)."""

    def __init__(self, tokenizer: Any, model: T5EncoderModel, max_length: int = T5_MAX_LENGTH) -> None:
        check(max_length >= 1, f"T5 max_length must be >= 1, got {max_length}")
        self.tokenizer, self.model, self.max_length = tokenizer, model.eval(), max_length

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def d_model(self) -> int:
        return int(self.model.config.d_model)

    @torch.no_grad()
    def encode(self, prompts: list[str], batch_size: int = 8) -> Captions:
        """Encode ``prompts`` ``batch_size`` at a time (rows do not depend on their batch-mates:
        padding is masked inside the encoder)."""
        prompts = check_prompts(prompts)
        parts = [self._encode_batch(prompts[lo : lo + batch_size]) for lo in range(0, len(prompts), batch_size)]
        return Captions(torch.cat([p.embeddings for p in parts]), torch.cat([p.mask for p in parts]))

    def _encode_batch(self, prompts: list[str]) -> Captions:
        batch = self.tokenizer(
            [normalize_prompt(p) for p in prompts],
            max_length=self.max_length,
            padding="max_length",
            truncation=True,
            add_special_tokens=True,
            return_attention_mask=True,
            return_tensors="pt",
        )
        ids, mask = batch["input_ids"].to(self.device), batch["attention_mask"].to(self.device)
        hidden = self.model(input_ids=ids, attention_mask=mask).last_hidden_state  # [B, L, d_model]
        return left_pad(hidden, mask)


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """No weight-loading progress bar (recent transformers draw one on stderr; lantern's own bars
    follow --no-progress) while loading; the user's setting is restored afterwards."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def _pickled_weights(path: Path) -> list[Path]:
    """The folder's ``pytorch_model*.bin`` files when it has no safetensors (transformers then
    unpickles them; with safetensors present it never reads them)."""
    if any(path.glob("*.safetensors")):
        return []
    return sorted(path.glob("pytorch_model*.bin"))


def _load_t5_encoder(path: Path) -> Any:
    """``T5EncoderModel`` of ``path``. transformers reads a ``pytorch_model.bin`` with
    ``weights_only=True``, so a pickle carrying anything besides tensors is refused there, with a
    multi-paragraph ``UnpicklingError``: lantern reads such files itself, with the same rule and
    message as every other pickle (:func:`lantern.io.load_checkpoint`: the file named, and
    ``--trust-checkpoint`` as the way to load it anyway)."""
    from transformers import T5EncoderModel

    from lantern.models.hf_folder import loading_bars

    bins = _pickled_weights(path)
    if bins and checkpoints_trusted():
        return _trusted_t5_encoder(path, bins)
    try:
        with loading_bars():
            return T5EncoderModel.from_pretrained(str(path), local_files_only=True)
    except pickle.UnpicklingError:
        for file in bins:  # raises lantern's one-line refusal naming the file and the class
            load_checkpoint(file, "--t5 weights", trust=False)
        raise LanternError(f"--t5: {path}: transformers refused its pickled weights "
                           f"({', '.join(f.name for f in bins) or 'pytorch_model.bin'}); if you trust "
                           f"the folder, pass {TRUST_FLAG}") from None


def _trusted_t5_encoder(path: Path, bins: list[Path]) -> Any:
    """``--trust-checkpoint``: the ``.bin`` files fully unpickled by lantern (with its warning)
    and loaded into an encoder built from ``config.json`` (transformers itself only reads them
    weights-only). A full T5 checkpoint's decoder weights are ignored; tied weights are re-tied."""
    from transformers import T5Config, T5EncoderModel

    state: dict[str, Any] = {}
    for file in bins:
        loaded = load_checkpoint(file, "--t5 weights", trust=True)
        check(isinstance(loaded, dict), f"--t5: {file} holds a {type(loaded).__name__}, not a state dict")
        state.update(loaded)
    model = T5EncoderModel(T5Config.from_pretrained(str(path)))
    missing = set(model.load_state_dict(state, strict=False).missing_keys)
    model.tie_weights()
    missing -= {"encoder.embed_tokens.weight"}  # tied to shared.weight; save_pretrained drops it
    check(not missing, f"--t5: {path} weights lack {len(missing)} encoder tensor(s), e.g. {min(missing, default='')}")
    return model.eval()


def load_t5(
    path: str | os.PathLike[str],
    max_length: int = T5_MAX_LENGTH,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    caption_dim: int | None = None,
) -> T5Encoder:
    """Tokenizer and ``T5EncoderModel`` from a local folder (never the hub)."""
    check_t5_folder(path, caption_dim)
    require_transformers()
    from transformers import AutoTokenizer

    try:
        with _quiet_transformers():
            # trust_remote_code=False: never run (nor ask on the terminal to run) the folder's own code
            tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
            model = _load_t5_encoder(Path(path))
    except LanternError:  # already one line naming the file (a ValueError, so before the next clause)
        raise
    except TRANSFORMERS_LOAD_ERRORS as e:  # what transformers raises for broken folders
        raise LanternError(f"--t5: cannot load the T5 tokenizer and encoder from {path}: "
                           f"{transformers_reason(e)}") from None
    model = model.to(device=device, dtype=dtype) if dtype is not None else model.to(device)
    return T5Encoder(tokenizer, model, max_length)
