"""What every model family shares: the :class:`Stack` protocol (the run path, ``demo``, ``bench``,
``profile`` and ``--tree auto`` are written against it only), the conditions of a batch, and what
every stack folder may hold besides its model: ``generation.json`` (sampling settings, recommended
trees, layout), ``drafter/`` and ``proximity.safetensors``. The families: LlamaGen c2i / t2i in
``lantern.targets.llamagen_stack``, Anole / Lumina-mGPT in ``lantern.targets.chameleon_stack``, Janus /
Janus-Pro in ``lantern.targets.janus``, Emu3 in ``lantern.targets.emu3``.
"""

from __future__ import annotations

import functools
import itertools
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from numbers import Integral
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch
from torch import Tensor

from lantern.errors import LanternError, check
from lantern.targets.text import check_text

if TYPE_CHECKING:
    from PIL import Image

    from lantern.decoding.cache import CachePool
    from lantern.decoding.config import SamplingConfig
    from lantern.decoding.drafting import DraftBackend
    from lantern.decoding.loop import CodeHead, Target

TARGET_DIR, TOKENIZER_DIR, DRAFTER_DIR, PROXIMITY_FILE = "target", "tokenizer", "drafter", "proximity.safetensors"
T5_DIR = "t5"  # text-to-image stacks: a local copy of the T5 encoder (google/flan-t5-xl)
GENERATION_FILE = "generation.json"  # a stack's default sampling settings
SAMPLING_KEYS = ("temperature", "top_k", "top_p", "cfg_scale")
COMMON_GENERATION_KEYS = (*SAMPLING_KEYS, "trees")  # every family's; families add their own
PRESETS_DIR = Path(__file__).resolve().parents[1] / "presets"
PRESETS = ("digits", "photos")


@dataclass(frozen=True)
class Conditions:
    """Encoded conditions of N images, in the form the stack's target ``start`` takes."""

    cond: Tensor  # [N] labels, [N, cls, C] T5 captions, or [N, L] Chameleon / Janus / Emu3 prompt ids
    mask: Tensor | None = None  # [N, L] True = a real caption / prompt column; None for labels
    # CFG's unconditional rows where the stack writes one per image (Emu3's negative prompts: ids
    # [N, L'] with their mask, left-padded); None: the target builds its own from ``cond``.
    guidance: Conditions | None = None

    def __len__(self) -> int:
        return int(self.cond.shape[0])

    def rows(self, lo: int, hi: int) -> Conditions:
        return Conditions(self.cond[lo:hi], None if self.mask is None else self.mask[lo:hi],
                          None if self.guidance is None else self.guidance.rows(lo, hi))

    def take(self, indices: Sequence[int]) -> Conditions:
        """The rows of images ``indices``, in that order."""
        idx = torch.tensor(list(indices), dtype=torch.long, device=self.cond.device)
        return Conditions(self.cond[idx], None if self.mask is None else self.mask[idx],
                          None if self.guidance is None else self.guidance.take(indices))

    def guidance_rows(self) -> tuple[Tensor, Tensor] | None:
        """The guidance rows as the target's ``start`` takes them (ids, mask), or None."""
        g = self.guidance
        if g is None:
            return None
        assert g.mask is not None  # guidance rows are prompt ids
        return g.cond, g.mask


@dataclass(frozen=True)
class PackedConditions:
    """The conditions of a whole request, held compactly on the host; each batch is rebuilt on the
    device as the :class:`Conditions` the target takes, bit for bit the rows that were packed.

    Image ``i`` reads stored condition ``i // repeats`` (``--num-per-prompt`` repeats a prompt
    without copying it), and a masked condition keeps only its valid columns: left-padded captions
    and prompt ids are exactly 0 where the mask is False. A flan-t5-xl caption is 120 x 2048 values,
    about 1 MB in float32, of which a COCO caption fills some 15 columns: 10,000 prompts at 4 images
    each held as plain rows on the device would take 39 GB, packed on the host about 1.2 GB."""

    values: Tensor  # unmasked: [M, ...] a row per condition; masked: [valid columns of all M, ...]
    offsets: tuple[int, ...] | None  # masked: condition j's are values[offsets[j]:offsets[j + 1]]; None: unmasked
    width: int  # columns of a rebuilt masked row (the set's padded width); 0 when unmasked
    repeats: int
    device: torch.device
    guidance: PackedConditions | None = None  # the conditions' own guidance rows (Conditions.guidance), packed

    @staticmethod
    def pack(chunks: Iterable[Conditions], repeats: int = 1) -> PackedConditions:
        """Pack ``chunks`` (consecutive conditions, each once, on the device they run on), one chunk at
        a time: the plain rows of the whole set never exist at once (the chunks may be made lazily)."""
        check(repeats >= 1, f"repeats must be >= 1, got {repeats}")
        values: list[Tensor] = []
        lengths: list[int] = []
        guides: list[Conditions | None] = []
        width, masked, device = 0, None, None
        for chunk in chunks:
            device = chunk.cond.device
            guides.append(chunk.guidance)
            if masked is None:
                masked, width = chunk.mask is not None, 0 if chunk.mask is None else int(chunk.mask.shape[1])
            check((chunk.mask is not None) == masked, "packed conditions must all have a mask or all have none")
            if chunk.mask is None:
                values.append(chunk.cond.cpu())
                continue
            check(int(chunk.mask.shape[1]) == width,
                  f"packed conditions must share their width: {width} then {int(chunk.mask.shape[1])}")
            count = chunk.mask.sum(dim=1)
            suffix = torch.arange(width, device=count.device)[None, :] >= (width - count)[:, None]
            check(bool(torch.equal(chunk.mask.bool(), suffix)), "packing needs left-padded conditions "
                  "(each row's valid columns at its end)")
            values.append(chunk.cond[chunk.mask.bool()].cpu())
            lengths.extend(int(c) for c in count.tolist())
        check(device is not None and bool(values), "no conditions to pack")
        assert device is not None
        offsets = tuple(itertools.accumulate(lengths, initial=0)) if masked else None
        given = [g for g in guides if g is not None]
        check(len(given) in (0, len(guides)), "packed conditions must all have guidance rows or all have none")
        guidance = PackedConditions.pack(given, repeats) if given else None
        return PackedConditions(torch.cat(values), offsets, width, repeats, device, guidance)

    def __len__(self) -> int:
        stored = len(self.offsets) - 1 if self.offsets is not None else int(self.values.shape[0])
        return stored * self.repeats

    def rows(self, lo: int, hi: int) -> Conditions:
        return self.take(range(max(lo, 0), min(hi, len(self))))

    def take(self, indices: Sequence[int]) -> Conditions:
        """The rows of images ``indices``, in that order, rebuilt on the device."""
        n = len(self)
        bad = [i for i in indices if not 0 <= i < n]
        check(not bad, f"image index {bad[:1]} out of range for {n} conditions")
        stored = [i // self.repeats for i in indices]
        guidance = None if self.guidance is None else self.guidance.take(indices)
        if self.offsets is None:
            return Conditions(self.values[torch.tensor(stored, dtype=torch.long)].to(self.device), None, guidance)
        cond = self.values.new_zeros((len(stored), self.width, *self.values.shape[1:]))
        mask = torch.zeros(len(stored), self.width, dtype=torch.bool)
        for r, s in enumerate(stored):
            lo, hi = self.offsets[s], self.offsets[s + 1]
            cond[r, self.width - (hi - lo) :] = self.values[lo:hi]
            mask[r, self.width - (hi - lo) :] = True
        return Conditions(cond.to(self.device), mask.to(self.device), guidance)


ConditionSet = Conditions | PackedConditions  # what a run reads its batches from (``rows``, ``take``)


class Stack(Protocol):
    """A loaded image generator of any model family, as the run path and the tools see it.

    Implemented by :class:`ModelStack` (LlamaGen c2i and t2i) and
    ``lantern.targets.chameleon_stack.ChameleonStack`` (Anole, Lumina-mGPT) and
    ``lantern.targets.janus.JanusStack`` (Janus, Janus-Pro) and ``lantern.targets.emu3.Emu3Stack``
    (Emu3). Everything family-specific (the
    condition format, CFG's unconditional branch, row-end tokens, the image tokenizer, which
    drafter folders fit) stays behind these methods and the :class:`~lantern.decoding.loop.Target` that
    :meth:`make_target` returns; the loop, acceptance rules, drafting and proximity tables work in
    code space and are shared.
    """

    root: Path

    @property
    def kind(self) -> str:
        """``c2i`` (class labels), ``t2i`` (prompts through T5), ``chameleon``, ``janus`` or ``emu3``
        (prompts, own tokenizer)."""
        ...

    @property
    def num_classes(self) -> int | None:
        """Classes a label may name; None for prompt-conditioned stacks (no class accuracy)."""
        ...

    @property
    def num_tokens(self) -> int: ...  # image codes per image

    @property
    def grid_width(self) -> int: ...  # image codes per image row (PJD's grid)

    @property
    def vocab_size(self) -> int: ...  # codes in the image vocabulary

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...

    def network(self) -> Any:
        """The target network (the stack's device and dtype are its own)."""
        ...

    @property
    def drafter_dir(self) -> Path | None: ...

    @property
    def proximity_file(self) -> Path | None: ...

    def default_sampling(self) -> dict[str, float]: ...

    def default_tree(self, method: str) -> str | None: ...

    def model_shape(self) -> dict[str, int | str]:
        """What a device profile's costs depend on (``lantern profile`` refuses another shape)."""
        ...

    def codebook(self) -> Tensor | None:
        """The tokenizer's code embeddings [V, D] (a proximity table is checked against them)."""
        ...

    def encode(self, conditions: Sequence[Any], repeats: int = 1, batch_size: int = 8,
               t5: str | os.PathLike[str] | None = None, negative: str | Sequence[str] | None = None) -> Conditions:
        """Labels or prompts, each ``repeats`` times in a row, checked and encoded on the device;
        ``negative``: a negative prompt (one for all, or one per prompt: ``negative_rows``)."""
        ...

    def negative_rows(self, negatives: list[str] | None, count: int, repeats: int) -> Conditions | None:
        """CFG's unconditional rows of ``count`` conditions with ``negatives`` (a negative prompt each,
        ``negative_prompts``; None: none given), each ``repeats`` times; None where the target builds
        its own. Families whose unconditional rows are not a prompt refuse a negative prompt."""
        ...

    def sample_conditions(self, n: int) -> list[Any]:
        """``n`` conditions for measurements (profile, calibration, bench): labels cycling through
        the classes, or fixed prompts."""
        ...

    def make_target(self, sampling: SamplingConfig, max_tree_nodes: int = 1, compile: str | None = None,
                    cache_pool: CachePool | None = None) -> Target:
        """A fresh target adapter (CFG streams, cache, positions) for one batch."""
        ...

    def cache_bytes(self, sampling: SamplingConfig, max_tree_nodes: int, conditions: ConditionSet, batch: int) -> int:
        """Bytes of the target's key/value cache for ``batch`` rows of ``conditions``."""
        ...

    def load_drafter(self, path: str | os.PathLike[str]) -> torch.nn.Module:
        """A drafter folder, checked against this target, on the device in the drafter's dtype."""
        ...

    def draft_backend(self, drafter: torch.nn.Module, head: CodeHead, sampling: SamplingConfig,
                      target: Target, slots: int, compile: str | None = None,
                      cache_pool: CachePool | None = None) -> DraftBackend:
        """The drafter's scorer for one batch; ``slots``: cache entries beyond the condition and the
        image (``TreeConfig.drafter_slots``)."""
        ...

    def decode(self, codes: Tensor) -> Tensor:
        """Images [N, C, H, W] in [-1, 1] of ``codes`` [N, T]."""
        ...

    def to_pil(self, codes: Tensor) -> list[Image.Image]: ...


def labels_for(num_classes: int, n: int) -> list[int]:
    """``n`` labels cycling through the classes, so every class is equally represented."""
    return [i % num_classes for i in range(n)]


# What each Stack.kind is called in messages.
FAMILY_NAMES = {"c2i": "class-conditional", "t2i": "text-to-image", "chameleon": "Chameleon-family", "janus": "Janus",
                "emu3": "Emu3"}

MEASURE_PROMPTS = ("a photo of a red car", "a cat on a sofa", "a mountain lake at dawn", "a bowl of fruit")


def prompts_for(n: int, prompts: Sequence[str] = ()) -> list[str]:
    """``n`` prompts for measurements on prompt-conditioned stacks, cycled: ``prompts`` (a user's
    set, e.g. ``bench --prompts``), else :data:`MEASURE_PROMPTS`."""
    pool = tuple(prompts) or MEASURE_PROMPTS
    return [pool[i % len(pool)] for i in range(n)]


@dataclass
class StackFolder:
    """What every stack reads from its folder, whatever the model family: the drafter and
    proximity table found there, and ``generation.json``'s sampling settings and trees."""

    root: Path

    # Sampling settings of the family used where generation.json is silent (none for LlamaGen:
    # SamplingConfig's defaults).
    FAMILY_SAMPLING: ClassVar[dict[str, float]] = {}
    # Why the family runs no drafter (drafter methods are refused with it), or None.
    DRAFTER_REFUSAL: ClassVar[str | None] = None
    # The keys the family's generation.json may hold (any other is refused: a misspelt key would
    # otherwise be silently ignored, and the run would use defaults the user meant to change).
    GENERATION_KEYS: ClassVar[tuple[str, ...]] = COMMON_GENERATION_KEYS

    @property
    def drafter_dir(self) -> Path | None:
        return existing_path(self.root / DRAFTER_DIR, folder=True)

    @property
    def proximity_file(self) -> Path | None:
        return existing_path(self.root / PROXIMITY_FILE, folder=False)

    def default_tree(self, method: str) -> str | None:
        """The stack's recommended draft tree for ``method`` (``generation.json`` "trees"), or None.

        Verify cost grows with tree size much faster on a CPU than on a GPU, so a stack meant for
        CPUs can ship smaller trees than the paper's defaults."""
        return self.default_trees().get(method)

    def default_trees(self) -> dict[str, str]:
        """Every recommended tree of ``generation.json``, by method name as written there."""
        return dict(self.generation_settings().get("trees", {}))

    def generation_settings(self) -> dict[str, Any]:
        """``generation.json``, read and checked once per loaded stack (a pipeline reads it when it
        is made): a loaded model keeps the defaults it was loaded with, whatever later happens to
        the file (an edit applies to the next load), and a call reads nothing from disk for it."""
        kept = self.__dict__.get("_generation_settings")
        if kept is None:
            kept = self.__dict__["_generation_settings"] = read_generation_settings(self.root, self.GENERATION_KEYS)
        return kept

    @property
    def device(self) -> torch.device:
        return self.network().device

    @property
    def dtype(self) -> torch.dtype:
        return self.network().dtype

    def network(self) -> Any:
        """The target network (the stack's device and dtype are its own)."""
        raise NotImplementedError

    def default_sampling(self) -> dict[str, float]:
        """The stack's recommended sampling settings, or {}: the family's, then what the model's own
        config states (:meth:`config_sampling`), then ``generation.json``'s."""
        raw = self.generation_settings()
        values = dict(self.FAMILY_SAMPLING) | self.config_sampling()
        values.update({k: raw[k] for k in SAMPLING_KEYS if k in raw})
        return values

    def config_sampling(self) -> dict[str, float]:
        """Sampling settings the model folder's own config states (transformers-format families:
        ``generation_config.json``), between the family's and ``generation.json``'s; none here."""
        return {}

    def sampling_origin(self, key: str) -> str:
        """Where the default ``key`` of :meth:`default_sampling` comes from, for an error about a
        value the caller never gave (a family default can be too large for a small test model)."""
        if key in self.generation_settings():
            return str(self.root / GENERATION_FILE)
        if key in self.config_sampling():
            return self.config_sampling_source()
        return f"the {getattr(self, 'family', 'model')} default"

    def measure_with(self, prompts: Sequence[str]) -> None:
        """Measure with ``prompts`` (cycled) wherever :meth:`sample_conditions` gives prompts:
        ``bench --prompts``'s evaluation set, for its images, AR's reference and every choice."""
        check(getattr(self, "num_classes", None) is None, f"prompts: {self.root} is a class-conditional model; its "
                                                          "measurements draw labels from its classes")
        self.__dict__["_measure_prompts"] = tuple(prompts)

    @property
    def measurement_prompts(self) -> tuple[str, ...]:
        """The prompts of :meth:`measure_with`, or () for the fixed ones."""
        return tuple(self.__dict__.get("_measure_prompts", ()))

    def config_sampling_source(self) -> str:
        """Where :meth:`config_sampling`'s values come from, for messages."""
        return str(self.root / "generation_config.json")


def check_condition_kind(conditions: Sequence[Any], kind: type, root: Path) -> list[Any]:
    """``conditions`` as a list, all labels (``kind`` Integral: numpy integers too) or all prompts
    (``kind`` str), else a one-line error."""
    if all(isinstance(c, kind) and not isinstance(c, bool) for c in conditions):
        if kind is str:
            for i, c in enumerate(conditions):
                check_text(c, f"prompts: prompt {i}")
        return list(conditions)
    if kind is Integral:
        raise LanternError(f"prompts: {root} is a class-conditional model; pass labels (integers)")
    raise LanternError(f"labels: {root} is a text-to-image model; pass prompts (strings)")


def negative_prompts(negative: str | Sequence[str] | None, count: int) -> list[str] | None:
    """``negative`` as one negative prompt per condition (a string: the same for all), checked;
    None when none is given."""
    if negative is None:
        return None
    if isinstance(negative, str):
        negative = [negative] * count
    check(isinstance(negative, (list, tuple)) and len(negative) == count,
          f"negative_prompt: expected a string, or a list of {count} (one per prompt), got "
          f"{len(negative) if isinstance(negative, (list, tuple)) else type(negative).__name__}",
          field="negative_prompt")
    for i, text in enumerate(negative):
        check(isinstance(text, str), f"negative_prompt: entry {i}: expected a string, got {type(text).__name__}",
              field="negative_prompt")
        check_text(text, f"negative_prompt: entry {i}")
    return list(negative)


def existing_path(path: Path, folder: bool) -> Path | None:
    """``path`` when it exists as a folder (``folder``) or a file, else None."""
    return path if (path.is_dir() if folder else path.is_file()) else None




def read_generation_settings(root: Path, keys: Sequence[str] = COMMON_GENERATION_KEYS) -> dict[str, Any]:
    """``root/generation.json`` ({} when absent), checked field by field: errors name the file and
    the field (``generation.json: trees.lantern++: ...``), not the command-line flag it stands in for.
    ``keys``: the keys the folder's family reads; any other is refused by name."""
    from lantern.decoding.config import SamplingConfig, TreeConfig
    from lantern.io import read_json_object

    path = root / GENERATION_FILE
    if not path.is_file():
        return {}
    raw = read_json_object(path, "generation settings")
    unknown = [key for key in raw if key not in keys]
    if unknown:
        raise LanternError(f"{path}: unknown key {unknown[0]!r} (this model family reads "
                           f"{', '.join(sorted(keys))})")
    sampling = {k: raw[k] for k in SAMPLING_KEYS if k in raw}
    for key, value in sampling.items():
        kind = int if key == "top_k" else (int, float)
        if isinstance(value, bool) or not isinstance(value, kind):
            raise LanternError(f"{path}: {key}: expected {'an integer' if key == 'top_k' else 'a number'}, "
                               f"got {value!r}")
    _with_source(path, "", lambda: SamplingConfig(**sampling))
    trees = raw.get("trees", {})
    if not isinstance(trees, dict):
        raise LanternError(f"{path}: trees: expected an object mapping methods to --tree specs, got {trees!r}")
    for method, spec in trees.items():  # (its keys are checked against the methods where methods resolve)
        if not isinstance(spec, str):
            raise LanternError(f"{path}: trees.{method}: expected a --tree spec string, got {spec!r}")
        _with_source(path, f"trees.{method}: ", functools.partial(TreeConfig.parse, spec))
    if "layout" in raw and not isinstance(raw["layout"], str):
        raise LanternError(f"{path}: layout: expected a layout name string, got {raw['layout']!r}")
    for key, what in (("image_size", "pixels a side, or the height"), ("image_width", "pixels")):
        size = raw.get(key, 1)
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise LanternError(f"{path}: {key}: expected a positive integer ({what}), got {size!r}")
    return raw


def _with_source(path: Path, field: str, build: Callable[[], object]) -> None:
    """Run ``build``; a LanternError it raises is re-raised naming the file (and field) first."""
    try:
        build()
    except LanternError as e:
        raise LanternError(f"{path}: {field}{e}") from None


DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def inference_dtype(name: str, device: str | torch.device = "cpu") -> torch.dtype:
    """The target/drafter precision for ``--dtype``: a name, or ``auto``.

    ``auto`` is bfloat16 where the hardware computes it natively (CUDA with bf16 support, CPUs
    with AVX-512 BF16 / AMX, as oneDNN reports) and float32 elsewhere: emulated bf16 matmuls are
    slower than float32 ones. At batch 1 the weights are read once per token, so halving them is
    the cheapest speed-up there is; the embedded presets are stored in bfloat16 anyway.
    """
    if name != "auto":
        if name not in DTYPES:
            raise LanternError(f"--dtype must be auto, {', '.join(sorted(DTYPES))}; got {name!r}")
        return DTYPES[name]
    kind = torch.device(device).type
    if kind == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    if kind == "cpu":
        try:
            native = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        except (AttributeError, RuntimeError):
            native = False
        return torch.bfloat16 if native else torch.float32
    return torch.float32
