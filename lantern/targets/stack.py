"""Model stacks: the folder a user points ``--model`` at, and the :class:`Stack` protocol that
every model family implements (LlamaGen c2i / t2i here, the Chameleon family in
``lantern.targets.chameleon``): the run path, ``demo``, ``bench``, ``profile`` and ``--tree auto`` are
written against the protocol only.

A stack folder holds everything one image generator needs::

    DIR/target/        LlamaGen model folder (config.json + model.safetensors), or an HF port
    DIR/tokenizer/     VQ tokenizer folder
    DIR/drafter/       optional EAGLE drafter folder
    DIR/proximity.safetensors   optional latent proximity table (LANTERN)
    DIR/t5/            text-to-image targets: the T5 encoder folder (google/flan-t5-xl), or --t5 DIR
    DIR/provenance.json         optional: how it was made

``--model`` also accepts a bare target folder when ``--tokenizer`` is given separately, or the
name of an embedded preset (``digits``, ``photos``: trained stacks shipped in ``lantern/presets``).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from numbers import Integral
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch
from torch import Tensor

from lantern.errors import LanternError, check
from lantern.models.llamagen import LlamaGen
from lantern.models.vq import VQModel

if TYPE_CHECKING:
    from PIL import Image

    from lantern.decoding.cache import CachePool
    from lantern.decoding.config import SamplingConfig
    from lantern.decoding.drafting import DraftBackend
    from lantern.decoding.loop import Target
    from lantern.targets.text import Captions

TARGET_DIR, TOKENIZER_DIR, DRAFTER_DIR, PROXIMITY_FILE = "target", "tokenizer", "drafter", "proximity.safetensors"
T5_DIR = "t5"  # text-to-image stacks: a local copy of the T5 encoder (google/flan-t5-xl)
GENERATION_FILE = "generation.json"  # a stack's default sampling settings
PRESETS_DIR = Path(__file__).resolve().parents[1] / "presets"
PRESETS = ("digits", "photos")


@dataclass(frozen=True)
class Conditions:
    """Encoded conditions of N images, in the form the stack's target ``start`` takes."""

    cond: Tensor  # [N] labels, [N, cls, C] T5 captions, or [N, L] Chameleon prompt ids
    mask: Tensor | None = None  # [N, L] True = a real caption / prompt column; None for labels

    def __len__(self) -> int:
        return int(self.cond.shape[0])

    def rows(self, lo: int, hi: int) -> Conditions:
        return Conditions(self.cond[lo:hi], None if self.mask is None else self.mask[lo:hi])


class Stack(Protocol):
    """A loaded image generator of any model family, as the run path and the tools see it.

    Implemented by :class:`ModelStack` (LlamaGen c2i and t2i) and
    ``lantern.targets.chameleon_stack.ChameleonStack`` (Anole, Lumina-mGPT). Everything family-specific (the
    condition format, CFG's unconditional branch, row-end tokens, the image tokenizer, which
    drafter folders fit) stays behind these methods and the :class:`~lantern.decoding.loop.Target` that
    :meth:`make_target` returns; the loop, acceptance rules, drafting and proximity tables work in
    code space and are shared.
    """

    root: Path

    @property
    def kind(self) -> str:
        """``c2i`` (class labels), ``t2i`` (prompts through T5) or ``chameleon`` (prompts, own tokenizer)."""
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
               t5: str | os.PathLike[str] | None = None) -> Conditions:
        """Labels or prompts, each ``repeats`` times in a row, checked and encoded on the device."""
        ...

    def sample_conditions(self, n: int) -> list[Any]:
        """``n`` conditions for measurements (profile, calibration, bench): labels cycling through
        the classes, or fixed prompts."""
        ...

    def make_target(self, sampling: SamplingConfig, max_tree_nodes: int = 1, compile: str | None = None,
                    cache_pool: CachePool | None = None) -> Target:
        """A fresh target adapter (CFG streams, cache, positions) for one batch."""
        ...

    def cache_bytes(self, sampling: SamplingConfig, max_tree_nodes: int, conditions: Conditions, batch: int) -> int:
        """Bytes of the target's key/value cache for ``batch`` rows of ``conditions``."""
        ...

    def load_drafter(self, path: str | os.PathLike[str]) -> torch.nn.Module:
        """A drafter folder, checked against this target, on the device in the drafter's dtype."""
        ...

    def draft_backend(self, drafter: torch.nn.Module, head: torch.nn.Linear, sampling: SamplingConfig,
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


MEASURE_PROMPTS = ("a photo of a red car", "a cat on a sofa", "a mountain lake at dawn", "a bowl of fruit")


def prompts_for(n: int) -> list[str]:
    """``n`` fixed prompts for measurements on prompt-conditioned stacks (cycled)."""
    return [MEASURE_PROMPTS[i % len(MEASURE_PROMPTS)] for i in range(n)]


@dataclass
class StackFolder:
    """What every stack reads from its folder, whatever the model family: the drafter and
    proximity table found there, and ``generation.json``'s sampling settings and trees."""

    root: Path

    # Sampling settings of the family used where generation.json is silent (none for LlamaGen:
    # SamplingConfig's defaults).
    FAMILY_SAMPLING: ClassVar[dict[str, float]] = {}

    @property
    def drafter_dir(self) -> Path | None:
        return _existing(self.root / DRAFTER_DIR, folder=True)

    @property
    def proximity_file(self) -> Path | None:
        return _existing(self.root / PROXIMITY_FILE, folder=False)

    def default_tree(self, method: str) -> str | None:
        """The stack's recommended draft tree for ``method`` (``generation.json`` "trees"), or None.

        Verify cost grows with tree size much faster on a CPU than on a GPU, so a stack meant for
        CPUs can ship smaller trees than the paper's defaults."""
        return read_generation_settings(self.root).get("trees", {}).get(method)

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
        """The stack's recommended sampling settings (``generation.json``, then the family's), or {}."""
        raw = read_generation_settings(self.root)
        values = dict(self.FAMILY_SAMPLING)
        values.update({k: raw[k] for k in SAMPLING_KEYS if k in raw})
        return values


@dataclass
class ModelStack(StackFolder):
    """A LlamaGen stack (c2i or t2i): the :class:`Stack` for LlamaGen targets."""

    target: LlamaGen
    tokenizer: VQModel
    # Fixed by the target's config at load time.
    kind: str = field(init=False)  # "c2i" or "t2i"
    num_classes: int | None = field(init=False)  # None for t2i (prompts)
    num_tokens: int = field(init=False)
    grid_width: int = field(init=False)
    vocab_size: int = field(init=False)

    def __post_init__(self) -> None:
        cfg = self.target.config
        self.kind = "t2i" if cfg.model_type == "t2i" else "c2i"
        self.num_classes = None if self.kind == "t2i" else cfg.num_classes
        self.num_tokens, self.vocab_size = cfg.block_size, cfg.vocab_size
        self.grid_width = math.isqrt(cfg.block_size)  # LlamaGen's token grids are square

    def network(self) -> torch.nn.Module:
        return self.target

    @property
    def t5_dir(self) -> Path | None:
        """The stack's T5 encoder folder (text-to-image stacks), or None."""
        return _existing(self.root / T5_DIR, folder=True)

    def codebook(self) -> Tensor:
        return self.tokenizer.quantize.embedding.weight

    def model_shape(self) -> dict[str, int | str]:
        c = self.target.config
        return {"dim": c.dim, "n_layer": c.n_layer, "block_size": c.block_size, "vocab_size": c.vocab_size}

    def encode(self, conditions: Sequence[Any], repeats: int = 1, batch_size: int = 8,
               t5: str | os.PathLike[str] | None = None) -> Conditions:
        if self.kind == "t2i":
            return self._encode_prompts(check_condition_kind(conditions, str, self.root), repeats, batch_size, t5)
        from lantern.validate import check_label_values

        labels = [int(lab) for lab in check_condition_kind(conditions, Integral, self.root) for _ in range(repeats)]
        check_label_values(labels, self.target.config.num_classes)
        label_t = torch.tensor(labels, dtype=torch.long, device=self.device)
        self.target.check_labels(label_t)
        return Conditions(label_t)

    def _encode_prompts(self, prompts: list[str], repeats: int, batch_size: int,
                        t5: str | os.PathLike[str] | None) -> Conditions:
        """Left-padded T5 captions of every image. The encoder is dropped before decoding starts:
        flan-t5-xl's encoder is larger than GPT-XL."""
        from lantern.targets.text import load_t5

        cfg = self.target.config
        encoder = load_t5(self.t5_folder(t5), cfg.cls_token_num, self.device, self.dtype, cfg.caption_dim)
        captions = encoder.encode(prompts, batch_size=batch_size)
        del encoder
        return self.from_captions(captions.repeat_interleave(repeats))

    def from_captions(self, captions: Captions) -> Conditions:
        """T5 captions (``lantern.targets.text.T5Encoder.encode``) as this t2i target's conditions, checked."""
        cfg = self.target.config
        check(cfg.model_type == "t2i", "this target is class-conditional: generate it from labels, not captions")
        expected = (cfg.cls_token_num, cfg.caption_dim)
        check(
            tuple(captions.embeddings.shape[1:]) == expected,
            f"captions are {tuple(captions.embeddings.shape)}, the target expects [N, {expected[0]}, {expected[1]}] "
            f"(T5 max_length = the target's cls_token_num, T5 d_model = its caption_dim)",
        )
        return Conditions(captions.embeddings.to(self.device, self.dtype), captions.mask.to(self.device, torch.bool))

    def t5_folder(self, t5: str | os.PathLike[str] | None = None) -> Path:
        """``t5``, else the stack's t5/ folder; checked (config, tokenizer, weights, width) without loading it."""
        from lantern.targets.text import check_t5_folder, require_transformers

        path = Path(t5) if t5 is not None else self.t5_dir
        if path is None:
            raise LanternError(f"--t5: {self.root} has no t5/ folder; pass --t5 DIR "
                               "(a local copy of google/flan-t5-xl)")
        check_t5_folder(path, caption_dim=self.target.config.caption_dim)
        require_transformers()
        return path

    def sample_conditions(self, n: int) -> list[Any]:
        return prompts_for(n) if self.num_classes is None else labels_for(self.num_classes, n)

    def make_target(self, sampling: SamplingConfig, max_tree_nodes: int = 1, compile: str | None = None,
                    cache_pool: CachePool | None = None) -> Target:
        from lantern.targets.llamagen import LlamaGenTarget

        return LlamaGenTarget(self.target, sampling, max_tree_nodes=max_tree_nodes, compile=compile,
                              cache_pool=cache_pool)

    def cache_bytes(self, sampling: SamplingConfig, max_tree_nodes: int, conditions: Conditions, batch: int) -> int:
        from lantern.targets.llamagen import LlamaGenTarget

        return LlamaGenTarget(self.target, sampling, max_tree_nodes=max_tree_nodes).cache_bytes(batch)

    def load_drafter(self, path: str | os.PathLike[str]) -> torch.nn.Module:
        from lantern.models.drafter import EagleDrafterModel
        from lantern.targets.checks import check_drafter_matches_target, check_t2i_drafter_layout, drafter_dtype

        dtype = drafter_dtype(self.dtype, self.device)
        drafter = EagleDrafterModel.from_pretrained(path).to(self.device, dtype).eval()
        check_drafter_matches_target(drafter.config, self.target.config)
        check_t2i_drafter_layout(drafter, self.target.config, path)
        return drafter

    def draft_backend(self, drafter: torch.nn.Module, head: torch.nn.Linear, sampling: SamplingConfig,
                      target: Target, slots: int, compile: str | None = None,
                      cache_pool: CachePool | None = None) -> DraftBackend:
        from lantern.drafters.eagle import EagleBackend

        cfg = self.target.config
        return EagleBackend(drafter, head, sampling, target.streams, cfg.cls_token_num + cfg.block_size + slots,
                            compile=compile, cache_pool=cache_pool)

    @torch.no_grad()
    def decode(self, codes: Tensor) -> Tensor:
        return self.tokenizer.decode(codes.to(self.device))

    def to_pil(self, codes: Tensor) -> list[Image.Image]:
        from lantern.images import to_pil

        return to_pil(self.decode(codes))


def check_condition_kind(conditions: Sequence[Any], kind: type, root: Path) -> list[Any]:
    """``conditions`` as a list, all labels (``kind`` Integral: numpy integers too) or all prompts
    (``kind`` str), else a one-line error."""
    if all(isinstance(c, kind) and not isinstance(c, bool) for c in conditions):
        return list(conditions)
    if kind is Integral:
        raise LanternError(f"prompts: {root} is a class-conditional model; pass labels (integers)")
    raise LanternError(f"labels: {root} is a text-to-image model; pass prompts (strings)")


def _existing(path: Path, folder: bool) -> Path | None:
    """``path`` when it exists as a folder (``folder``) or a file, else None."""
    return path if (path.is_dir() if folder else path.is_file()) else None


SAMPLING_KEYS = ("temperature", "top_k", "top_p", "cfg_scale")


def read_generation_settings(root: Path) -> dict[str, Any]:
    """``root/generation.json`` ({} when absent), checked field by field: errors name the file and
    the field (``generation.json: trees.lantern++: ...``), not the command-line flag it stands in for."""
    from lantern.decoding.config import SamplingConfig, TreeConfig
    from lantern.io import read_json_object

    path = root / GENERATION_FILE
    if not path.is_file():
        return {}
    raw = read_json_object(path, "generation settings")
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
    for method, spec in trees.items():
        if not isinstance(spec, str):
            raise LanternError(f"{path}: trees.{method}: expected a --tree spec string, got {spec!r}")
        _with_source(path, f"trees.{method}: ", lambda spec=spec: TreeConfig.parse(spec))
    if "layout" in raw and not isinstance(raw["layout"], str):
        raise LanternError(f"{path}: layout: expected a layout name string, got {raw['layout']!r}")
    return raw


def _with_source(path: Path, field: str, build: Callable[[], object]) -> None:
    """Run ``build``; a LanternError it raises is re-raised naming the file (and field) first."""
    try:
        build()
    except LanternError as e:
        raise LanternError(f"{path}: {field}{e}") from None


def preset_dir(name: str) -> Path:
    path = PRESETS_DIR / name
    if not (path / TARGET_DIR).is_dir():
        raise LanternError(f"the embedded preset {name!r} is not installed (expected {path}); "
                           "reinstall lantern or train it with scripts/train_preset.sh")
    return path


def resolve_model_dir(model: str | os.PathLike[str]) -> Path:
    """A stack folder path, or an embedded preset name (a folder of that name in the working
    directory is not taken for the preset: write ``./digits`` for that)."""
    from lantern.hub import resolve_location

    if str(model) in PRESETS:
        return preset_dir(str(model))
    path = Path(resolve_location(model, "--model"))
    if not path.exists():
        raise LanternError(f"--model: no such model folder {path} (embedded presets: {', '.join(PRESETS)})")
    if not path.is_dir():
        raise LanternError(f"--model: {path} is not a folder")
    return path


HF_LLAMAGEN_ARCHITECTURES = (["LlamaForCausalLM"],)  # LANTERN's HF ports of LlamaGen (SPEC §1.5)
HF_LLAMAGEN_MODEL_TYPES = (None, "llama")


def check_target_architecture(target_dir: Path) -> None:
    """Refuse a target folder of another model family before trying to load its weights.

    Without this, any HF ``config.json`` with a ``hidden_size`` would be read as a LlamaGen HF port
    and fail later with a list of unexpected checkpoint keys, which does not say what is wrong.
    """
    from lantern.io import read_json
    from lantern.models.llamagen import MODEL_TYPE

    config_file = target_dir / "config.json"
    if not config_file.is_file():
        raise LanternError(f"--model: {target_dir} has no config.json: not a model folder")
    raw = read_json(config_file, "model config")
    if not isinstance(raw, dict):
        raise LanternError(f"--model: {config_file} must hold a JSON object")
    model_type, arch = raw.get("model_type"), raw.get("architectures")
    if model_type == MODEL_TYPE:
        return
    if arch in HF_LLAMAGEN_ARCHITECTURES or (arch is None and model_type in HF_LLAMAGEN_MODEL_TYPES
                                             and "hidden_size" in raw):
        return
    found = f"model_type {model_type!r}" + (f", architectures {arch}" if arch is not None else "")
    raise LanternError(
        f"--model: unsupported architecture in {config_file} ({found}): lantern runs LlamaGen targets, "
        f"a lantern LlamaGen folder (model_type {MODEL_TYPE!r}) or LANTERN's HF port "
        "(architectures ['LlamaForCausalLM'])"
    )


def load_stack(
    model: str | os.PathLike[str],
    tokenizer: str | os.PathLike[str] | None = None,
    dtype: torch.dtype | None = None,
) -> ModelStack:
    from lantern.models.chameleon import is_chameleon_folder

    root = resolve_model_dir(model)
    if is_chameleon_folder(root):
        raise LanternError(
            f"--model {root} is a Chameleon-family model (Anole, Lumina-mGPT), not a LlamaGen stack: load it with "
            "lantern.load (any model) or lantern.targets.chameleon_stack.load_chameleon_stack"
        )
    target_dir = root / TARGET_DIR if (root / TARGET_DIR).is_dir() else root
    tok_dir = Path(tokenizer) if tokenizer is not None else root / TOKENIZER_DIR
    if not tok_dir.exists():
        raise LanternError(
            f"--model {root} has no {TOKENIZER_DIR}/ folder; pass --tokenizer DIR (a VQ tokenizer folder)"
        )
    check_target_architecture(target_dir)
    target = LlamaGen.from_pretrained(target_dir, dtype=dtype)
    vq = VQModel.from_pretrained(tok_dir)
    if vq.config.codebook_size != target.config.vocab_size:
        raise LanternError(
            f"tokenizer codebook ({vq.config.codebook_size} entries) does not match the target's "
            f"vocabulary ({target.config.vocab_size})"
        )
    return ModelStack(root=root, target=target.eval(), tokenizer=vq.eval())


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
