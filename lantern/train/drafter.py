"""EAGLE drafter training for LANTERN ([EAGLE], [LANTERN code]): feature data, the recipe and the trainer.

Two stages, as in the official code:

1. :func:`make_drafter_data` runs the frozen target teacher-forced over real codes (the paper's
   recipe; optionally also over sequences the target sampled itself) and stores its post-norm
   hidden states, the drafter's input features, in safetensors shards plus ``meta.json``.
2. :func:`train_drafter` trains an :class:`EagleDrafterModel` on those features with the shared
   loop (:mod:`lantern.train.loop`): SmoothL1 feature regression plus soft cross-entropy through
   the target's frozen ``lm_head``, uniform noise on the input features.

The training layout equals what :class:`lantern.drafters.eagle.EagleBackend` feeds at inference, for a
sequence of L = cls + n target positions (drafter position = target position)::

    position t       0 .. cls-2        cls-1       cls .. cls+n-2
    feature          f_t               f_{cls-1}   f_t
    token            0 (placeholder)   x_0         x_{t-cls+1}
    regress          f_{t+1}           f_cls       f_{t+1}
    in the loss      no                yes         yes

The last target position is not fed at all: its successor lies beyond the image. Position cls-1
is in the loss (the official code drops it) because inference drafts the second token from it.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lantern.decoding.config import SamplingConfig, TreeConfig
from lantern.drafters.checks import HEAD_SHA_KEY, head_sha256
from lantern.errors import check
from lantern.io import atomic_path, ensure_writable_dir, read_json, save_safetensors, write_json
from lantern.models.drafter import TRAINING_INFO_FILE, DrafterConfig, EagleDrafterModel
from lantern.models.llamagen import LlamaGen, causal_mask
from lantern.train.codes import CodeSet
from lantern.train.loop import BatchPart, LoopConfig, RunOptions, TrainResult, TrainTask, step_generator, train

if TYPE_CHECKING:
    from lantern.models.janus import GenerationHead
    from lantern.targets.base import Conditions, ConditionSet
    from lantern.targets.llamagen_stack import ModelStack

DATA_FORMAT = "lantern-drafter-data"
DATA_VERSION = 1
META_FILE = "meta.json"
CAPTIONS_FILE = "captions.safetensors"  # text-to-image held-out data: captions to generate from
SOURCES = ("real", "generated")
NOISE_STREAM = 1  # step_generator stream of the feature noise (stream 0 is left to the loop)


def target_fingerprint(target: LlamaGen) -> str:
    """sha256 of the target's output layer and config: cheap to compute for a 3B model, and any
    retrained or different target changes its lm_head, which the drafter shares."""
    h = hashlib.sha256()
    h.update(target.output.weight.detach().float().cpu().contiguous().numpy().tobytes())
    h.update(json.dumps(target.config.to_dict(), sort_keys=True).encode())
    return h.hexdigest()


# ----------------------------------------------------------------------------------------------
# Feature data
# ----------------------------------------------------------------------------------------------


@dataclass
class DrafterData:
    """Teacher-forced target features: ``hidden`` bf16 [N, L, D], ``tokens`` [N, n], ``labels`` [N]
    (the condition actually used, the null class for dropped ones), ``meta`` (see ``meta.json``).
    ``captions``: text-to-image held-out data's first prompts, encoded (``captions.safetensors``),
    which the held-out speculative generation decodes from; None for class-conditional data."""

    hidden: Tensor
    tokens: Tensor
    labels: Tensor
    meta: dict[str, Any]
    directory: Path | None = None
    captions: Conditions | None = None

    def __post_init__(self) -> None:
        n = self.hidden.shape[0]
        check(self.hidden.ndim == 3 and self.tokens.ndim == 2 and self.labels.shape == (n,)
              and self.tokens.shape[0] == n, f"{self._where()}: hidden/tokens/labels shapes do not match "
              f"({tuple(self.hidden.shape)}, {tuple(self.tokens.shape)}, {tuple(self.labels.shape)})")

    def __len__(self) -> int:
        return int(self.hidden.shape[0])

    @property
    def cls_token_num(self) -> int:
        return int(self.hidden.shape[1] - self.tokens.shape[1])

    def fingerprint(self) -> str:
        """sha256 of the meta, which holds every shard's sha256 (so it covers the contents)."""
        return hashlib.sha256(json.dumps(self.meta, sort_keys=True).encode()).hexdigest()

    def _where(self) -> str:
        return f"drafter data {self.directory}" if self.directory is not None else "drafter data"

    def check_target(self, target: LlamaGen) -> None:
        """Raise a specific :class:`LanternError` unless this data was made by ``target``."""
        cfg = target.config
        made = self.meta.get("target_config", {})
        for name in ("dim", "vocab_size", "cls_token_num", "block_size", "model_type"):
            check(made.get(name) == getattr(cfg, name),
                  f"{self._where()} was made for a target with {name} {made.get(name)!r}, but this target has "
                  f"{name} {getattr(cfg, name)!r}: make drafter data with this target")
        check(self.hidden.shape[1:] == (cfg.cls_token_num + cfg.block_size, cfg.dim),
              f"{self._where()}: hidden states of shape {tuple(self.hidden.shape[1:])} do not fit the target "
              f"(expected {(cfg.cls_token_num + cfg.block_size, cfg.dim)})")
        check(self.meta.get("target_fingerprint") == target_fingerprint(target),
              f"{self._where()} was made with a different target model (its weights differ from this one's): "
              "make drafter data with the target you train the drafter for")

    @classmethod
    def load(cls, directory: str | os.PathLike[str]) -> DrafterData:
        """Load every shard listed in ``meta.json`` into memory (checking each shard's sha256)."""
        directory = Path(directory)
        make = "make one with `lantern make-drafter-data`"
        check(directory.is_dir(), f"drafter data folder not found: {directory} ({make})")
        check(any(directory.iterdir()), f"drafter data folder {directory} is empty ({make})")
        check((directory / META_FILE).is_file(),
              f"drafter data folder {directory} has no {META_FILE}: it is not drafter data, or `lantern "
              "make-drafter-data` was interrupted (it writes meta.json last); make the data again")
        meta = read_json(directory / META_FILE, "drafter data meta")
        check(isinstance(meta, dict) and meta.get("format") == DATA_FORMAT,
              f"{directory / META_FILE} is not a drafter data meta file (format {DATA_FORMAT!r} expected)")
        check(meta.get("version") == DATA_VERSION,
              f"{directory} holds drafter data version {meta.get('version')!r}; this lantern reads {DATA_VERSION}")
        count, shards = meta.get("count", 0), meta.get("shards", [])
        # the fields' types too: a hand-edited meta.json ended in TypeError / KeyError before
        check(_whole(count) and isinstance(shards, list) and all(
            isinstance(s, dict) and isinstance(s.get("file"), str) and isinstance(s.get("sha256"), str)
            for s in shards), f"{directory / META_FILE}: count or shards is damaged (make the data again)")
        check(count >= 1 and bool(shards), f"drafter data folder {directory} holds no examples")
        cfg = meta.get("target_config")
        check(isinstance(cfg, dict) and all(_whole(cfg.get(k)) for k in ("dim", "cls_token_num", "block_size")),
              f"{directory / META_FILE} does not record the target config (dim, cls_token_num, block_size)")
        length = cfg["cls_token_num"] + cfg["block_size"]
        hidden = torch.empty(count, length, cfg["dim"], dtype=torch.bfloat16)  # filled in place: no 2x peak
        tokens = torch.empty(count, cfg["block_size"], dtype=torch.long)
        labels = torch.empty(count, dtype=torch.long)
        lo = 0
        for shard in shards:
            part = _read_shard(directory / shard["file"], shard["sha256"])
            m = part["labels"].shape[0]
            check(lo + m <= count and part["hidden"].shape[1:] == hidden.shape[1:],
                  f"{directory / shard['file']} does not match {META_FILE} (shape or count)")
            hidden[lo : lo + m], tokens[lo : lo + m] = part["hidden"], part["tokens"]
            labels[lo : lo + m] = part["labels"]
            lo += m
        check(lo == count, f"{directory}: shards hold {lo} examples but {META_FILE} says {count}")
        return cls(hidden, tokens, labels, meta, directory, _read_captions(directory, meta.get("captions")))


def _read_captions(directory: Path, entry: Any) -> Conditions | None:
    """The held-out captions ``meta.json`` lists (None when it lists none), checked by their sha256."""
    from lantern.targets.base import Conditions

    if entry is None:
        return None
    check(isinstance(entry, dict) and entry.get("file") == CAPTIONS_FILE and isinstance(entry.get("sha256"), str),
          f"{directory / META_FILE}: captions is damaged (make the data again)")
    part = _read_shard(directory / CAPTIONS_FILE, entry["sha256"])
    check({"cond", "mask"} <= part.keys() and part["mask"].shape == part["cond"].shape[:2],
          f"{directory / CAPTIONS_FILE} holds no captions (cond, mask): make the data again")
    return Conditions(part["cond"], part["mask"])


def _whole(value: Any) -> bool:
    """A count or size as meta.json must hold it: an integer, not a bool, not negative."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _read_shard(path: Path, sha256: str) -> dict[str, Tensor]:
    from safetensors.torch import load

    check(path.is_file(), f"drafter data shard missing: {path} (make the data again)")
    raw = path.read_bytes()
    check(hashlib.sha256(raw).hexdigest() == sha256,
          f"drafter data shard {path} is corrupt or from another run (sha256 differs from meta.json)")
    return load(raw)


def make_drafter_data(
    target: LlamaGen,
    codes: CodeSet,
    out: str | os.PathLike[str],
    *,
    cond_dropout: float = 0.1,
    seed: int = 0,
    batch_size: int = 32,
    shard_size: int = 1024,
    progress: bool = True,
    source: str = "real",
    num_generated: int = 0,
    sampling: SamplingConfig | None = None,
) -> Path:
    """Write teacher-forced target features for ``codes`` (and, with ``source="generated"``,
    ``num_generated`` sequences the target samples itself) into the folder ``out``.

    Each example's label is replaced by the null class with probability ``cond_dropout`` (drawn
    from a generator seeded by ``seed``), so the drafter also learns the unconditional CFG stream.
    """
    _check_data_args(target, codes, cond_dropout, batch_size, shard_size, source, num_generated)
    out = ensure_writable_dir(out)
    check(not (out / META_FILE).exists(),
          f"{out} already holds drafter data ({META_FILE}); choose a new folder or delete it first")
    sampling = sampling or SamplingConfig()
    gen = torch.Generator().manual_seed(seed)
    # Real examples' draws come first, so adding generated examples never changes them.
    all_codes, cond = codes.codes.long(), codes.labels.long()
    if source == "generated":
        extra_codes, extra_labels = _generate_codes(target, num_generated, sampling, seed, batch_size, progress)
        all_codes, cond = torch.cat([all_codes, extra_codes]), torch.cat([cond, extra_labels])
    dropped = torch.rand(len(cond), generator=gen) < cond_dropout
    used = torch.where(dropped, target.config.num_classes, cond)
    shards = _write_shards(target, all_codes, used, out, batch_size, shard_size, progress)
    meta = {
        "format": DATA_FORMAT,
        "version": DATA_VERSION,
        "target_config": target.config.to_dict(),
        "target_fingerprint": target_fingerprint(target),
        "codes_fingerprint": codes.fingerprint(),
        "codes_meta": {k: codes.meta.get(k) for k in ("vocab_size", "grid", "num_classes", "data_fingerprint")},
        "cond_dropout": cond_dropout,
        "seed": seed,
        "source": source,
        "num_real": len(codes),
        "num_generated": num_generated if source == "generated" else 0,
        "sampling": sampling.to_dict() if source == "generated" else None,
        "count": int(len(used)),
        "num_dropped": int(dropped.sum()),
        "shards": shards,
    }
    write_json(out / META_FILE, meta)  # last: a folder with meta.json is complete
    return out


def make_prompt_drafter_data(
    stack: ModelStack,
    prompts: Sequence[str],
    out: str | os.PathLike[str],
    *,
    num_per_prompt: int = 1,
    cond_dropout: float = 0.1,
    seed: int = 0,
    batch_size: int = 32,
    shard_size: int = 1024,
    sampling: SamplingConfig | None = None,
    t5: str | os.PathLike[str] | None = None,
    progress: bool = True,
    keep_captions: int = 0,
) -> Path:
    """Drafter data for a text-to-image LlamaGen stack, self-distilled: the target samples
    ``num_per_prompt`` images of every prompt (plain AR, ``sampling``; LANTERN trains its T2I
    drafters on LAION-COCO's images instead: :func:`make_caption_drafter_data`), then runs
    teacher-forced over each caption and its codes. A row is run on the unconditional caption
    (``uncond_embedding``, the caption's own mask, as the target's CFG stream) with probability
    ``cond_dropout``, so the drafter also learns the stream it drafts for under guidance.
    ``keep_captions``: the first prompts whose encoded captions are kept (``captions.safetensors``,
    about 1 MB each), for held-out data: training's speculative evaluation generates from them."""
    from lantern.api import resolve_sampling
    from lantern.methods import MethodConfig
    from lantern.parts import ModelParts
    from lantern.run import run_conditions

    target = stack.target
    out = _check_caption_args(stack, "--prompts", len(prompts), cond_dropout, batch_size, shard_size, keep_captions,
                              out)
    check(num_per_prompt >= 1, f"--num-per-prompt must be >= 1, got {num_per_prompt!r}")
    sampling = sampling or resolve_sampling(stack)  # the stack's own (LlamaGen's for an official model)
    # packed on the host: a prompt's caption once, its valid columns only (not 120 x 2048 per image)
    conditions = ModelParts(stack, t5=t5).encode(list(prompts), repeats=num_per_prompt, batch_size=batch_size,
                                                 progress=progress)
    codes = run_conditions(stack, conditions, seed, sampling, MethodConfig(), batch_size, progress).codes.cpu()
    index = torch.arange(len(prompts)).repeat_interleave(num_per_prompt)
    labels = _caption_labels(index, cond_dropout, seed)
    shards = _write_shards(target, codes, labels, out, batch_size, shard_size, progress, captions=conditions)
    kept = min(keep_captions, len(prompts))
    captions = _write_captions(conditions, kept, num_per_prompt, out) if kept else None
    _write_caption_meta(out, target, labels, shards, captions, cond_dropout=cond_dropout, seed=seed,
                        source="generated", prompts=len(prompts),
                        prompts_sha256=hashlib.sha256("\n".join(prompts).encode()).hexdigest(),
                        num_per_prompt=num_per_prompt, num_real=0, num_generated=int(len(index)),
                        sampling=sampling.to_dict())
    return out


def make_caption_drafter_data(
    stack: ModelStack,
    pairs: Sequence[tuple[Path, str]],
    out: str | os.PathLike[str],
    *,
    cond_dropout: float = 0.1,
    seed: int = 0,
    batch_size: int = 32,
    shard_size: int = 1024,
    t5: str | os.PathLike[str] | None = None,
    progress: bool = True,
    keep_captions: int = 0,
) -> Path:
    """Drafter data for a text-to-image LlamaGen stack from real images and their captions
    (``pairs``, :func:`lantern.data.captions.caption_folder`; LANTERN's recipe, which trains its
    T2I drafters on LAION-COCO's images): each image squared to the target's size as LlamaGen and
    LANTERN extract codes (ADM's centre crop) and encoded by the stack's tokenizer; then the target runs
    teacher-forced over its caption and codes, or over the unconditional caption with
    probability ``cond_dropout``, as :func:`make_prompt_drafter_data` does. Made one shard at a
    time: one shard's images and captions are in memory at once, whatever the data set's size."""
    from tqdm.auto import tqdm

    from lantern.images import square_image
    from lantern.parts import ModelParts

    target, tokenizer = stack.target, stack.tokenizer
    out = _check_caption_args(stack, "--images", len(pairs), cond_dropout, batch_size, shard_size, keep_captions, out)
    size = stack.grid_width * tokenizer.config.downsample_factor
    tokenizer_at = next(tokenizer.parameters())
    parts = ModelParts(stack, t5=t5)
    labels = _caption_labels(torch.arange(len(pairs)), cond_dropout, seed)
    shards: list[dict[str, Any]] = []
    captions = None
    with tqdm(total=len(pairs), desc="images to features", unit="image", disable=not progress) as bar:
        for lo in range(0, len(pairs), shard_size):
            chunk = pairs[lo : lo + shard_size]
            conditions = parts.encode([caption for _, caption in chunk], batch_size=batch_size)
            codes = []
            for b in range(0, len(chunk), batch_size):
                images = torch.stack([square_image(path, size, "--images", "adm")  # LANTERN's extract_code's
                                      for path, _ in chunk[b : b + batch_size]])
                codes.append(tokenizer.encode(images.to(tokenizer_at.device, tokenizer_at.dtype)).cpu())
            shards += _write_shards(target, torch.cat(codes), labels[lo : lo + len(chunk)], out, batch_size,
                                    shard_size, False, captions=conditions, first=len(shards))
            if lo == 0 and keep_captions:  # the first prompts' (at most a shard's)
                captions = _write_captions(conditions, min(keep_captions, len(chunk)), 1, out)
            bar.update(len(chunk))
    listing = "\n".join(f"{path.name}\t{caption}" for path, caption in pairs)
    _write_caption_meta(out, target, labels, shards, captions, cond_dropout=cond_dropout, seed=seed, source="real",
                        prompts=len(pairs), prompts_sha256=hashlib.sha256(listing.encode()).hexdigest(),
                        num_per_prompt=1, num_real=len(pairs), num_generated=0, image_size=size)
    return out


def _check_caption_args(stack: ModelStack, source: str, count: int, cond_dropout: float, batch_size: int,
                        shard_size: int, keep_captions: int, out: str | os.PathLike[str]) -> Path:
    """The checks both caption routes make, before anything is encoded; ``out``, created."""
    check(stack.target.config.model_type == "t2i", f"{source}: drafter data from captions needs a text-to-image "
                                                   "target; a class-conditional one takes --codes")
    check(count >= 1, f"{source}: no captions given")
    check(0.0 <= cond_dropout <= 1.0, f"--cond-dropout must be in [0, 1], got {cond_dropout!r}")
    check(batch_size >= 1, f"--batch-size must be >= 1, got {batch_size!r}")
    check(shard_size >= 1, f"shard_size must be >= 1, got {shard_size!r}")
    check(keep_captions >= 0, f"keep_captions must be >= 0, got {keep_captions!r}")
    folder = ensure_writable_dir(out)
    check(not (folder / META_FILE).exists(),
          f"{folder} already holds drafter data ({META_FILE}); choose a new folder or delete it first")
    return folder


def _caption_labels(index: Tensor, cond_dropout: float, seed: int) -> Tensor:
    """Each row's caption (its prompt's index), or -1 for a row run on the unconditional caption
    (drawn with probability ``cond_dropout`` from ``seed``, one draw per row in order)."""
    dropped = torch.rand(len(index), generator=torch.Generator().manual_seed(seed)) < cond_dropout
    return torch.where(dropped, -1, index)


def _write_caption_meta(out: Path, target: LlamaGen, labels: Tensor, shards: list[dict[str, Any]],
                        captions: dict[str, Any] | None, **fields: Any) -> None:
    meta = {
        "format": DATA_FORMAT,
        "version": DATA_VERSION,
        "target_config": target.config.to_dict(),
        "target_fingerprint": target_fingerprint(target),
        **fields,
        "count": int(len(labels)),
        "num_dropped": int((labels < 0).sum()),
        "shards": shards,
        **({"captions": captions} if captions else {}),
    }
    write_json(out / META_FILE, meta)  # last: a folder with meta.json is complete


def _write_captions(conditions: ConditionSet, count: int, per_prompt: int, out: Path) -> dict[str, Any]:
    """The first ``count`` prompts' captions (``per_prompt`` images each in ``conditions``) into
    ``captions.safetensors``: its ``meta.json`` entry."""
    rows = conditions.take(range(0, count * per_prompt, per_prompt))
    assert rows.mask is not None  # captions always carry their mask
    with atomic_path(out / CAPTIONS_FILE) as tmp:
        save_safetensors({"cond": rows.cond.cpu().contiguous(), "mask": rows.mask.cpu().contiguous()}, tmp)
        digest = hashlib.sha256(tmp.read_bytes()).hexdigest()
    return {"file": CAPTIONS_FILE, "count": count, "sha256": digest}


def _check_data_args(target: LlamaGen, codes: CodeSet, cond_dropout: float, batch_size: int, shard_size: int,
                     source: str, num_generated: int) -> None:
    cfg = target.config
    check(cfg.model_type == "c2i",
          "drafter data needs a class-conditional (c2i) target: code sets hold class labels, not captions")
    check(0.0 <= cond_dropout <= 1.0, f"--cond-dropout must be in [0, 1], got {cond_dropout!r}")
    check(batch_size >= 1, f"--batch-size must be >= 1, got {batch_size!r}")
    check(shard_size >= 1, f"--shard-size must be >= 1, got {shard_size!r}")
    check(source in SOURCES, f"--source must be one of {', '.join(SOURCES)}, got {source!r}")
    check(num_generated >= 0, f"--num-generated must be >= 0, got {num_generated!r}")
    check(source == "generated" or num_generated == 0, "--num-generated needs --source generated")
    check(source == "real" or num_generated >= 1, "--source generated needs --num-generated >= 1")
    check(len(codes) >= 1 or source == "generated", "the code set is empty: no drafter data to make")
    check(codes.seq_len == cfg.block_size,
          f"the code set has {codes.seq_len} tokens per image but the target generates {cfg.block_size}")
    if len(codes):
        top = int(codes.codes.max())
        check(top < cfg.vocab_size and int(codes.codes.min()) >= 0,
              f"the code set holds code {top}, outside the target's vocabulary of {cfg.vocab_size}")
        target.check_labels(codes.labels)


@torch.no_grad()
def _generate_codes(target: LlamaGen, count: int, sampling: SamplingConfig, seed: int, batch_size: int,
                    progress: bool) -> tuple[Tensor, Tensor]:
    """Plain AR samples of the target (self-distillation), labels cycling over the classes."""
    from tqdm.auto import tqdm

    from lantern.decoding.loop import generate
    from lantern.decoding.sampling import make_generators
    from lantern.run import image_seed
    from lantern.targets.llamagen import LlamaGenTarget

    labels = torch.arange(count) % target.config.num_classes
    was_training = target.training
    parts = []
    for lo in tqdm(range(0, count, batch_size), desc="generate", disable=not progress):
        chunk = labels[lo : lo + batch_size]
        # A seed stream apart from the cond-dropout generator; one generator per row (batch-invariant).
        gens = make_generators([image_seed(seed + 1, i) for i in range(lo, lo + len(chunk))], target.device)
        out = generate(LlamaGenTarget(target, sampling), chunk.to(target.device), generators=gens)
        parts.append(out.codes.cpu())
    target.train(was_training)
    return torch.cat(parts), labels


@torch.no_grad()
def _write_shards(target: LlamaGen, codes: Tensor, labels: Tensor, out: Path, batch_size: int, shard_size: int,
                  progress: bool, captions: ConditionSet | None = None, first: int = 0) -> list[dict[str, Any]]:
    """Teacher-forced features of ``codes`` under ``labels`` (c2i), or under the ``captions`` of each
    row (t2i; ``labels`` then names each row's prompt, -1 for a row run on the unconditional
    caption: ``uncond_embedding`` under the caption's own mask, what the target's CFG stream runs).
    The shards are numbered from ``first``."""
    from tqdm.auto import tqdm

    was_training = target.training
    target.eval()  # no dropout: the features must be the ones inference produces
    shards = []
    bar = tqdm(total=len(labels), desc="target features", disable=not progress)
    for index, lo in enumerate(range(0, len(labels), shard_size)):
        hi = min(lo + shard_size, len(labels))
        hidden = []
        for b in range(lo, hi, batch_size):
            e = min(b + batch_size, hi)
            cond, mask = labels[b:e].to(target.device), None
            if captions is not None:
                rows = captions.rows(b, e)
                dropped = (labels[b:e] < 0).to(target.device)[:, None, None]
                cond = torch.where(dropped, target.null_condition(e - b).to(rows.cond.dtype), rows.cond)
                mask = rows.mask
            _, h = target(cond, codes[b:e].to(target.device), cond_mask=mask)
            hidden.append(h.to(torch.bfloat16).cpu())
            bar.update(e - b)
        name = f"shard-{first + index:05d}.safetensors"
        tensors = {"hidden": torch.cat(hidden).contiguous(), "tokens": codes[lo:hi].to(torch.int32).contiguous(),
                   "labels": labels[lo:hi].contiguous()}
        with atomic_path(out / name) as tmp:
            save_safetensors(tensors, tmp)
            digest = hashlib.sha256(tmp.read_bytes()).hexdigest()
        shards.append({"file": name, "count": hi - lo, "sha256": digest})
    bar.close()
    target.train(was_training)
    return shards


# ----------------------------------------------------------------------------------------------
# Recipe, batches and the loss
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DrafterRecipe:
    """LANTERN / EAGLE drafter loss and augmentation ([EAGLE code], [LANTERN code]).

    ``noise_width`` w: uniform noise U(-w/2, w/2) is added to the *input* features only. The
    official code draws ``(U(0,1) - 0.5) * 0.2 * 512 / L`` (L the sequence length, an EAGLE quirk),
    i.e. w = 0.2 * 512 / L: 0.2 * 512 / 376 ≈ 0.27 for LlamaGen t2i Stage I.
    """

    p_weight: float = 0.1  # soft cross-entropy through the target's lm_head
    v_weight: float = 1.0  # SmoothL1 feature regression
    noise_width: float = 0.2
    freeze_embeddings: bool = True  # keep embed_tokens at the target's token table

    def __post_init__(self) -> None:
        for name in ("p_weight", "v_weight", "noise_width"):
            value = getattr(self, name)
            check(isinstance(value, int | float) and math.isfinite(value) and value >= 0,
                  f"drafter recipe: {name} must be a finite number >= 0, got {value!r}")
        check(self.p_weight > 0 or self.v_weight > 0, "drafter recipe: p_weight and v_weight cannot both be 0")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class DrafterBatch:
    features: Tensor  # [B, T, D] f_t (noised for training), T = L - 1
    tokens: Tensor  # [B, T] the token paired with each feature
    targets: Tensor  # [B, T, D] f_{t+1}, clean
    loss_mask: Tensor  # [B, T] bool
    positions: Tensor  # [B, T]
    mask: Tensor  # [B, T, T] causal

    def to(self, device: torch.device | str) -> DrafterBatch:
        return DrafterBatch(*(getattr(self, f.name).to(device) for f in fields(self)))


def teacher_forced_batch(hidden: Tensor, codes: Tensor, cls: int) -> DrafterBatch:
    """The drafter's inputs and targets for full sequences (see the module docstring).

    hidden [B, L, D] target features (L = cls + n), codes [B, n] image tokens.
    """
    b, length, _ = hidden.shape
    n = codes.shape[1]
    check(length == cls + n, f"hidden states have {length} positions, expected cls {cls} + {n} tokens")
    t = length - 1
    tokens = torch.zeros(b, t, dtype=torch.long, device=codes.device)
    tokens[:, cls - 1 :] = codes  # condition positions but the last pair with placeholder 0
    loss_mask = torch.zeros(b, t, dtype=torch.bool, device=hidden.device)
    loss_mask[:, cls - 1 :] = True
    positions = torch.arange(t, device=hidden.device).expand(b, -1)
    mask = causal_mask(t, device=hidden.device).expand(b, -1, -1)
    features = hidden[:, :t].float()
    return DrafterBatch(features, tokens, hidden[:, 1:].float(), loss_mask, positions, mask)


@dataclass
class DrafterLosses:
    total: Tensor
    loss_v: Tensor
    loss_p: Tensor
    top1: Tensor  # drafter argmax == target argmax, over loss positions


def drafter_losses(pred: Tensor, batch: DrafterBatch, logits_fn: Callable[[Tensor], Tensor],
                   recipe: DrafterRecipe) -> DrafterLosses:
    """[LANTERN code] main.py: masked-mean SmoothL1 (beta 1, mean over D) plus soft CE to softmax(lm_head(f_{t+1})),
    both divided by (number of loss positions + 1e-5) as in the official code."""
    m = batch.loss_mask
    denom = m.sum() + 1e-5
    pred_m, tgt_m = pred[m].float(), batch.targets[m].float()  # [K, D] loss positions only
    loss_v = F.smooth_l1_loss(pred_m, tgt_m, reduction="none", beta=1.0).mean(-1).sum() / denom
    with torch.no_grad():
        target_logits = logits_fn(tgt_m).float()
        p = target_logits.softmax(-1)
    logq = logits_fn(pred_m).float().log_softmax(-1)
    loss_p = -(p * logq).sum(-1).sum() / denom
    top1 = (logq.argmax(-1) == target_logits.argmax(-1)).float().mean()
    total = recipe.v_weight * loss_v + recipe.p_weight * loss_p
    return DrafterLosses(total, loss_v, loss_p, top1.detach())


def add_feature_noise(batch: DrafterBatch, recipe: DrafterRecipe, seed: int, step: int,
                      part: BatchPart | None = None) -> DrafterBatch:
    """Uniform noise on the input features, a pure function of (seed, step, position in the global
    batch): a resumed run draws the same noise, and so does a run on another number of processes
    (``batch`` is ``part`` of the global batch; one stream per example, not a [B, T, D] draw)."""
    if recipe.noise_width > 0:
        part = part or BatchPart.whole(batch.features.shape[0])
        shape = batch.features.shape[1:]
        noise = torch.stack([torch.rand(shape, generator=step_generator(seed, step, NOISE_STREAM, example=i))
                             for i in range(part.start, part.stop)])
        batch.features = batch.features + (noise - 0.5) * recipe.noise_width
    return batch


def drafter_step_loss(model: nn.Module, batch: DrafterBatch, head: Callable[[Tensor], Tensor],
                      recipe: DrafterRecipe) -> tuple[Tensor, dict[str, float]]:
    """A training step's loss and the floats to log."""
    pred = model(batch.features, batch.tokens, batch.positions, batch.mask)
    out = drafter_losses(pred, batch, head, recipe)
    return out.total, {"loss_v": float(out.loss_v.detach()), "loss_p": float(out.loss_p.detach()),
                       "top1": float(out.top1)}


# ----------------------------------------------------------------------------------------------
# The task
# ----------------------------------------------------------------------------------------------


def initial_drafter(target: LlamaGen, recipe: DrafterRecipe, seed: int = 0,
                    initial: EagleDrafterModel | None = None) -> EagleDrafterModel:
    """The drafter training starts from: a copy of ``initial``, or a fresh one sized like the target
    (seeded, without touching the global RNG) whose token table is the target's.

    The official LANTERN code loads ``lm_head.weight`` into the table for single-file HF ports
    ([LANTERN code] cnets_llamagen.py); we take the target's input table, the natural reading of EAGLE.
    """
    from lantern.drafters.checks import check_drafter_matches_target

    if initial is not None:
        model = copy.deepcopy(initial).float()
        check_drafter_matches_target(model.config, target.config)
        check((model.config.target_cls_token_num, model.config.block_size)
              == (target.config.cls_token_num, target.config.block_size),
              f"the initial drafter's RoPE layout (cls {model.config.target_cls_token_num}, block "
              f"{model.config.block_size}) does not match the target's (cls {target.config.cls_token_num}, "
              f"block {target.config.block_size})")
    else:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = EagleDrafterModel(DrafterConfig.for_target(target.config))
        with torch.no_grad():
            model.embed_tokens.weight.copy_(target.tok_embeddings.weight.detach().float().cpu())
    model.embed_tokens.weight.requires_grad_(not recipe.freeze_embeddings)
    return model


def state_fingerprint(model: nn.Module) -> str:
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


class _FrozenHead(nn.Module):
    """The target's lm_head, copied and frozen: shared at inference, never trained here."""

    def __init__(self, output: nn.Linear | GenerationHead) -> None:  # (Janus: its generation head)
        super().__init__()
        self.linear = copy.deepcopy(output).requires_grad_(False)

    def forward(self, h: Tensor) -> Tensor:
        return self.linear(h.to(self.linear.weight.dtype)).float()


@dataclass(frozen=True)
class EvalConfig:
    """Held-out evaluation settings (they do not change training, so resume ignores them)."""

    batch_size: int = 32
    # rows of the speculative generation: labels 0, 1, ... (at most num_classes), or the held-out
    # data's first captions (text-to-image; ``make-drafter-data`` keeps this many)
    num_rows: int = 4
    sampling: SamplingConfig = field(default_factory=lambda: SamplingConfig(temperature=0.0))


@torch.no_grad()
def evaluate_drafter(drafter: EagleDrafterModel, target: LlamaGen, data: DrafterData, *, generation: bool = True,
                     config: EvalConfig | None = None) -> dict[str, float]:
    """``top1`` / ``top3`` (target argmax among the drafter's top 1 / 3), ``accept_prob`` (mean
    Σ_v min(p_v, q_v) at temperature 1, the single-draft exact acceptance probability), ``loss_v``,
    ``loss_p``, and ``mean_accepted`` of a speculative generation (tokens per target forward)."""
    config = config or EvalConfig()
    check(len(data) >= 1, "drafter evaluation: the held-out data is empty")
    was_training = drafter.training
    drafter.eval()
    head = _FrozenHead(target.output).to(drafter.device)
    sums = dict.fromkeys(("top1", "top3", "accept_prob", "loss_v", "loss_p"), 0.0)
    count = 0
    for lo in range(0, len(data), config.batch_size):
        rows = slice(lo, lo + config.batch_size)
        batch = teacher_forced_batch(data.hidden[rows], data.tokens[rows], data.cls_token_num).to(drafter.device)
        pred = drafter(batch.features, batch.tokens, batch.positions, batch.mask)
        m = batch.loss_mask
        p, q = head(batch.targets[m]).softmax(-1), head(pred[m]).softmax(-1)
        best = p.argmax(-1, keepdim=True)
        sums["top1"] += float((q.argmax(-1, keepdim=True) == best).sum())
        sums["top3"] += float((q.topk(min(3, q.shape[-1]), -1).indices == best).any(-1).sum())
        sums["accept_prob"] += float(torch.minimum(p, q).sum(-1).sum())
        sums["loss_v"] += float(F.smooth_l1_loss(pred[m].float(), batch.targets[m], reduction="none").mean(-1).sum())
        sums["loss_p"] += float(-(p * q.clamp_min(1e-30).log()).sum(-1).sum())
        count += int(m.sum())
    metrics = {k: v / count for k, v in sums.items()}
    if generation:
        metrics["mean_accepted"] = _mean_accepted(drafter, target, config, data.captions)
    drafter.train(was_training)
    return metrics


def _eval_tree(target: LlamaGen) -> TreeConfig:
    """The default ``sd`` tree (EAGLE-2 dynamic), shallower if the image is tiny."""

    tree = TreeConfig.parse("dynamic")
    depth = min(tree.depth, target.config.block_size - 2)
    tree = TreeConfig(kind="dynamic", depth=max(depth, 1), top_k=min(tree.top_k, target.config.vocab_size),
                      total_tokens=tree.total_tokens)
    check(tree.max_depth < target.config.block_size,
          f"images of {target.config.block_size} tokens are too small for a speculative evaluation; "
          "disable it (eval_generation=False)")
    return tree


def _mean_accepted(drafter: EagleDrafterModel, target: LlamaGen, config: EvalConfig,
                   captions: Conditions | None = None) -> float:
    """Tokens per target forward of a speculative generation: of labels 0, 1, ..., or of a
    text-to-image target's held-out ``captions``."""
    from lantern.decoding.loop import generate
    from lantern.decoding.sampling import make_generators
    from lantern.drafters.eagle import make_eagle_drafter
    from lantern.targets.llamagen import LlamaGenTarget

    was_training = target.training
    if drafter.device != target.device:
        drafter = copy.deepcopy(drafter).to(target.device)
    if target.config.model_type == "t2i":
        check(captions is not None, "a text-to-image drafter's generation evaluation needs held-out data with "
                                    "captions (make-drafter-data --prompts or --images keeps them)")
        assert captions is not None
        cond, mask = captions.cond[: config.num_rows].to(target.device), captions.mask
        mask = None if mask is None else mask[: config.num_rows].to(target.device)
    else:
        cond, mask = torch.arange(min(target.config.num_classes, config.num_rows), device=target.device), None
    tree_drafter, nodes = make_eagle_drafter(target, drafter, config.sampling, _eval_tree(target))
    gens = None if config.sampling.greedy else make_generators(list(range(len(cond))), target.device)
    out = generate(LlamaGenTarget(target, config.sampling, max_tree_nodes=nodes), cond, generators=gens,
                   drafter=tree_drafter, cond_mask=mask)
    target.train(was_training)
    return out.stats.mean_accepted


class DrafterTask(TrainTask):
    """EAGLE drafter training on :class:`DrafterData` (run by :func:`lantern.train.loop.train`)."""

    kind = "drafter"

    def __init__(self, target: LlamaGen, train_data: DrafterData, test_data: DrafterData,
                 recipe: DrafterRecipe | None = None, *, seed: int = 0, initial: EagleDrafterModel | None = None,
                 eval_generation: bool = True, eval_config: EvalConfig | None = None) -> None:
        self.recipe = recipe or DrafterRecipe()
        check(len(train_data) >= 1, "drafter training: the training data is empty")
        train_data.check_target(target)
        test_data.check_target(target)
        self.target, self.train_data, self.test_data, self.seed = target, train_data, test_data, seed
        # text-to-image held-out data made before it kept captions has none to generate from: its
        # teacher-forced metrics (top1, top3, accept_prob) then stand for the speculative generation
        eval_generation = eval_generation and (target.config.model_type == "c2i" or test_data.captions is not None)
        self.eval_generation, self.eval_config = eval_generation, eval_config or EvalConfig()
        if eval_generation:
            _eval_tree(target)  # fail now, not after training, if the images are too small for it
        self.model: EagleDrafterModel = initial_drafter(target, self.recipe, seed, initial)
        self.initial_fingerprint = state_fingerprint(self.model)
        self.lm_head = _FrozenHead(target.output)

    def bind(self, accelerator: Any) -> None:
        super().bind(accelerator)
        self.lm_head.to(accelerator.device)

    def num_examples(self) -> int:
        return len(self.train_data)

    def make_batch(self, indices: Tensor, step: int, device: torch.device,
                   part: BatchPart | None = None) -> DrafterBatch:
        d = self.train_data
        batch = teacher_forced_batch(d.hidden[indices], d.tokens[indices], d.cls_token_num)
        return add_feature_noise(batch, self.recipe, self.seed, step, part).to(device)

    def loss(self, model: nn.Module, batch: DrafterBatch, step: int) -> tuple[Tensor, dict[str, float]]:
        return drafter_step_loss(model, batch, self.lm_head, self.recipe)

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        assert isinstance(model, EagleDrafterModel)
        return evaluate_drafter(model, self.target, self.test_data, generation=self.eval_generation,
                                config=self.eval_config)

    def save(self, model: nn.Module, out: Path) -> None:
        assert isinstance(model, EagleDrafterModel)
        info = {"target_fingerprint": target_fingerprint(self.target),
                HEAD_SHA_KEY: head_sha256(self.target.output.weight), "recipe": self.recipe.to_dict(),
                "data_fingerprint": self.data_fingerprint()}
        model.save_pretrained(out, extra_files={TRAINING_INFO_FILE: info})

    def config_dict(self) -> dict[str, Any]:
        # The evaluation settings and held-out data do not change the trained weights: left out,
        # so a run can be resumed with the generation eval switched off.
        meta = {k: v for k, v in self.train_data.meta.items() if k != "shards"}
        return {
            "recipe": self.recipe.to_dict(),
            "drafter": self.model.config.to_dict(),
            "initial_weights": self.initial_fingerprint,
            "data": {"fingerprint": self.train_data.fingerprint(), "meta": meta},
        }

    def data_fingerprint(self) -> str:
        return self.train_data.fingerprint()


def train_drafter(
    target: LlamaGen,
    train_data: DrafterData,
    test_data: DrafterData,
    recipe: DrafterRecipe | None,
    loop: LoopConfig,
    options: RunOptions,
    *,
    eval_generation: bool = True,
    initial: EagleDrafterModel | None = None,
) -> TrainResult:
    """Train (or resume) a drafter into ``options.out``; the final folder loads with
    :meth:`EagleDrafterModel.from_pretrained`. The target is only read (lm_head, evaluation)."""
    task = DrafterTask(target, train_data, test_data, recipe, seed=loop.seed, initial=initial,
                       eval_generation=eval_generation)
    return train(task, loop, options)
