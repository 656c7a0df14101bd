"""LlamaGen stacks (c2i and t2i): the :class:`~lantern.targets.base.Stack` of a LlamaGen folder.

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
from collections.abc import Sequence
from dataclasses import dataclass, field
from numbers import Integral
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor

from lantern.errors import LanternError, check
from lantern.models.llamagen import LlamaGen
from lantern.models.vq import VQModel
from lantern.targets.base import (
    PRESETS,
    PRESETS_DIR,
    T5_DIR,
    TARGET_DIR,
    TOKENIZER_DIR,
    Conditions,
    ConditionSet,
    StackFolder,
    check_condition_kind,
    existing_path,
    labels_for,
    negative_prompts,
    prompts_for,
)

if TYPE_CHECKING:
    from PIL import Image

    from lantern.decoding.cache import CachePool
    from lantern.decoding.config import SamplingConfig
    from lantern.decoding.drafting import DraftBackend
    from lantern.decoding.loop import CodeHead, Target
    from lantern.models.drafter import EagleDrafterModel
    from lantern.targets.text import Captions


@dataclass
class ModelStack(StackFolder):
    """A LlamaGen stack (c2i or t2i): the :class:`Stack` for LlamaGen targets."""

    target: LlamaGen
    tokenizer: VQModel
    hf_port: bool = False  # the target is LANTERN's HF port of an official LlamaGen model
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

    def config_sampling(self) -> dict[str, float]:
        """An official model (LANTERN's HF ports, jadohu/LlamaGen-T2I) samples with LlamaGen's own
        script defaults where generation.json is silent, as a converted checkpoint's stack does
        (``lantern convert-llamagen`` writes them); lantern-format targets keep lantern's."""
        return llamagen_sampling(self.kind, self.vocab_size) if self.hf_port else {}

    def config_sampling_source(self) -> str:
        return f"LlamaGen's sample_{self.kind}.py default"

    @property
    def t5_dir(self) -> Path | None:
        """The stack's T5 encoder folder (text-to-image stacks), or None."""
        return existing_path(self.root / T5_DIR, folder=True)

    def codebook(self) -> Tensor:
        return self.tokenizer.quantize.embedding.weight

    def model_shape(self) -> dict[str, int | str]:
        c = self.target.config
        return {"dim": c.dim, "n_layer": c.n_layer, "block_size": c.block_size, "vocab_size": c.vocab_size}

    def encode(self, conditions: Sequence[Any], repeats: int = 1, batch_size: int = 8,
               t5: str | os.PathLike[str] | None = None, negative: str | Sequence[str] | None = None) -> Conditions:
        self.negative_rows(negative_prompts(negative, len(conditions)), len(conditions), repeats)
        if self.kind == "t2i":
            return self._encode_prompts(check_condition_kind(conditions, str, self.root), repeats, batch_size, t5)
        from lantern.validate import check_label_values

        labels = [int(lab) for lab in check_condition_kind(conditions, Integral, self.root) for _ in range(repeats)]
        check_label_values(labels, self.target.config.num_classes)
        label_t = torch.tensor(labels, dtype=torch.long, device=self.device)
        self.target.check_labels(label_t)
        return Conditions(label_t)

    def negative_rows(self, negatives: list[str] | None, count: int, repeats: int) -> None:
        """None: LlamaGen's unconditional row is the model's null condition (a class id or T5's
        learned null caption), not a prompt, so a negative prompt is refused."""
        check(negatives is None, f"negative_prompt: LlamaGen {self.kind} models take no negative prompt (their "
                                 "unconditional row is the model's null condition; Emu3 models take one)",
              field="negative_prompt")

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
        return prompts_for(n, self.measurement_prompts) if self.num_classes is None else labels_for(self.num_classes, n)

    def make_target(self, sampling: SamplingConfig, max_tree_nodes: int = 1, compile: str | None = None,
                    cache_pool: CachePool | None = None) -> Target:
        from lantern.targets.llamagen import LlamaGenTarget

        return LlamaGenTarget(self.target, sampling, max_tree_nodes=max_tree_nodes, compile=compile,
                              cache_pool=cache_pool)

    def cache_bytes(self, sampling: SamplingConfig, max_tree_nodes: int, conditions: ConditionSet, batch: int) -> int:
        from lantern.targets.llamagen import LlamaGenTarget

        return LlamaGenTarget(self.target, sampling, max_tree_nodes=max_tree_nodes).cache_bytes(batch)

    def load_drafter(self, path: str | os.PathLike[str]) -> torch.nn.Module:
        from lantern.drafters.checks import (
            check_drafter_layout,
            check_drafter_matches_target,
            check_t2i_drafter_layout,
            drafter_dtype,
            warn_if_trained_for_another_head,
        )
        from lantern.models.drafter import EagleDrafterModel

        dtype = drafter_dtype(self.dtype, self.device)
        drafter = EagleDrafterModel.from_pretrained(path).to(self.device, dtype).eval()
        check_drafter_matches_target(drafter.config, self.target.config)
        check_t2i_drafter_layout(drafter, self.target.config, path)
        check_drafter_layout(drafter.config, self.target.config, path)
        warn_if_trained_for_another_head(path, self.target.output.weight)
        return drafter

    def draft_backend(self, drafter: torch.nn.Module, head: CodeHead, sampling: SamplingConfig,
                      target: Target, slots: int, compile: str | None = None,
                      cache_pool: CachePool | None = None) -> DraftBackend:
        from lantern.drafters.eagle import EagleBackend

        cfg = self.target.config
        # (LlamaGen's drafters are lantern's EAGLE drafters: load_drafter's, or one given loaded)
        return EagleBackend(cast("EagleDrafterModel", drafter), head, sampling, target.streams,
                            cfg.cls_token_num + cfg.block_size + slots,
                            compile=compile, cache_pool=cache_pool)

    @torch.no_grad()
    def decode(self, codes: Tensor) -> Tensor:
        return self.tokenizer.decode(codes.to(self.device))

    def to_pil(self, codes: Tensor) -> list[Image.Image]:
        from lantern.images import to_pil

        return to_pil(self.decode(codes))


def preset_dir(name: str) -> Path:
    path = PRESETS_DIR / name
    if not (path / TARGET_DIR).is_dir():
        raise LanternError(f"the embedded preset {name!r} is not installed (expected {path}); "
                           "reinstall lantern or train it with scripts/train_preset.sh")
    return path


def resolve_model_dir(model: str | os.PathLike[str]) -> Path:
    """A stack folder path, or an embedded preset name (a folder of that name in the working
    directory is not taken for the preset: write ``./digits`` for that)."""
    from lantern.hub import is_repo_id, resolve_location

    text = str(model)
    if text in PRESETS:
        return preset_dir(text)
    path = Path(resolve_location(model, "--model"))
    if not path.exists():  # named as given: Path would turn org//name into org/name, which it is not
        near_id = "/" in text and not (is_repo_id(text) or Path(text).is_absolute() or text.startswith("."))
        hub = "; a Hugging Face repo id is ORG/NAME" if near_id else ""
        raise LanternError(f"--model: no such model folder {text} (embedded presets: {', '.join(PRESETS)}{hub})")
    if not path.is_dir():
        if path.suffix in CHECKPOINT_SUFFIXES:  # e.g. LlamaGen's c2i_L_256.pt, as downloaded
            raise LanternError(f"--model {text} is a checkpoint file, not a model folder: convert an official LlamaGen "
                               "checkpoint and its VQ once with `lantern convert-llamagen --gpt-ckpt GPT.pt --vq-ckpt "
                               "VQ.pt --out DIR` and pass that folder")
        raise LanternError(f"--model: {text} is not a folder")
    return path


# The sampling defaults of LlamaGen's own scripts ([LlamaGen code] autoregressive/sample/sample_c2i.py
# and sample_t2i.py), for official models: a converted checkpoint's generation.json, an HF port's defaults.
LLAMAGEN_SAMPLING: dict[str, dict[str, float]] = {
    "c2i": {"cfg_scale": 4.0, "top_k": 2000, "temperature": 1.0, "top_p": 1.0},
    "t2i": {"cfg_scale": 7.5, "top_k": 1000, "temperature": 1.0, "top_p": 1.0},
}

def llamagen_sampling(kind: str, vocab_size: int) -> dict[str, float]:
    """:data:`LLAMAGEN_SAMPLING` of a c2i / t2i model: its top_k capped at the codebook, which is
    what a larger top_k keeps (all of it), so a small test model is not refused for it."""
    values = LLAMAGEN_SAMPLING[kind]
    return values | {"top_k": min(int(values["top_k"]), vocab_size)}


# Pickled checkpoint files as the official releases ship them (LlamaGen's c2i_*.pt / vq_ds16_*.pt)
CHECKPOINT_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")


HF_LLAMAGEN_ARCHITECTURES = (["LlamaForCausalLM"],)  # LANTERN's HF ports of LlamaGen ([LANTERN code] README)
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
        "(architectures ['LlamaForCausalLM']); and transformers folders of model_type 'chameleon', 'janus' or 'emu3'"
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
    has_config = (target_dir / "config.json").is_file()
    pickles = sorted(p.name for p in root.glob("*.pt"))
    if pickles and not has_config:  # official LlamaGen downloads: checkpoints, not a model folder yet
        raise LanternError(
            f"--model {root} holds official checkpoint files ({', '.join(pickles[:3])}), not a model folder: convert "
            "them once with `lantern convert-llamagen --gpt-ckpt GPT.pt --vq-ckpt VQ.pt --out DIR` and pass that "
            "folder"
        )
    if has_config:  # a broken or foreign config is named before a missing tokenizer
        check_target_architecture(target_dir)
    tok_dir = Path(tokenizer) if tokenizer is not None else root / TOKENIZER_DIR
    if tokenizer is not None and tok_dir.is_file():  # LANTERN's README lays vq_ds16_t2i.pt beside its HF ports
        raise LanternError(f"--tokenizer {tok_dir} is a file, not a VQ tokenizer folder"
                           + (": convert LlamaGen's VQ checkpoint once with VQModel.from_official_checkpoint(...)"
                              ".save_pretrained(DIR) and pass that folder (`lantern convert-llamagen` converts a GPT "
                              "checkpoint and its VQ together)"
                              if tok_dir.suffix in CHECKPOINT_SUFFIXES else ""))
    check(tokenizer is None or tok_dir.is_dir(), f"--tokenizer: no such folder {tok_dir} (a VQ tokenizer folder)")
    if not tok_dir.exists() and not has_config:  # nothing of any family lantern reads
        raise LanternError(
            f"--model {root} is not a model folder lantern reads: it has no config.json (a Chameleon, Janus or "
            f"Emu3 folder has one) and no {TARGET_DIR}/ and {TOKENIZER_DIR}/ folders (a LlamaGen stack)"
        )
    if not tok_dir.exists():
        raise LanternError(
            f"--model {root} has no {TOKENIZER_DIR}/ folder; pass --tokenizer DIR (a VQ tokenizer folder)"
        )
    if not has_config:
        check_target_architecture(target_dir)  # names the missing config.json
    target = LlamaGen.from_pretrained(target_dir, dtype=dtype)
    vq = VQModel.from_pretrained(tok_dir)
    if vq.config.codebook_size != target.config.vocab_size:
        raise LanternError(
            f"tokenizer codebook ({vq.config.codebook_size} entries) does not match the target's "
            f"vocabulary ({target.config.vocab_size})"
        )
    _check_trained_tokenizer(target_dir, vq, f"--tokenizer {tok_dir}" if tokenizer is not None
                             else f"--model {root}: its {TOKENIZER_DIR}/")
    from lantern.models.hf_folder import read_model_config

    official = read_model_config(target_dir) or {}
    return ModelStack(root=root, target=target.eval(), tokenizer=vq.eval(),
                      hf_port=official.get("architectures") in HF_LLAMAGEN_ARCHITECTURES)


def _check_trained_tokenizer(target_dir: Path, vq: VQModel, what: str) -> None:
    """A target lantern trained (``train-target``) records the codebook of the tokenizer its codes
    came from; another tokenizer of the same size would decode its codes to noise, silently."""
    from lantern.io import TRAIN_CONFIG_FILE, read_json_object
    from lantern.targets.proximity import codebook_sha256  # the hash extract-codes records

    record = target_dir / TRAIN_CONFIG_FILE
    try:
        task = read_json_object(record, "training record").get("task") if record.is_file() else None
    except LanternError:  # a damaged record is no reason to refuse a model; it vouches for nothing
        return
    data = task.get("data") if isinstance(task, dict) else None
    recorded = data.get("tokenizer_codebook_sha256") if isinstance(data, dict) else None
    if isinstance(recorded, str) and recorded != codebook_sha256(vq.quantize.embedding.weight):
        raise LanternError(f"{what} is not the tokenizer this target was trained with: its codebook differs from "
                           f"the one {record} records, and would decode the target's codes to noise; pass the "
                           "tokenizer the codes were extracted with")
