"""Model stacks: the folder a user points ``--model`` at.

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

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lantern.errors import LanternError
from lantern.models.llamagen import LlamaGen
from lantern.models.vq import VQModel

TARGET_DIR, TOKENIZER_DIR, DRAFTER_DIR, PROXIMITY_FILE = "target", "tokenizer", "drafter", "proximity.safetensors"
T5_DIR = "t5"  # text-to-image stacks: a local copy of the T5 encoder (google/flan-t5-xl)
GENERATION_FILE = "generation.json"  # a stack's default sampling settings
PRESETS_DIR = Path(__file__).resolve().parent / "presets"
PRESETS = ("digits", "photos")


@dataclass
class ModelStack:
    root: Path
    target: LlamaGen
    tokenizer: VQModel

    @property
    def drafter_dir(self) -> Path | None:
        d = self.root / DRAFTER_DIR
        return d if d.is_dir() else None

    @property
    def proximity_file(self) -> Path | None:
        f = self.root / PROXIMITY_FILE
        return f if f.is_file() else None

    @property
    def t5_dir(self) -> Path | None:
        """The stack's T5 encoder folder (text-to-image stacks), or None."""
        d = self.root / T5_DIR
        return d if d.is_dir() else None

    def default_tree(self, method: str) -> str | None:
        """The stack's recommended draft tree for ``method`` (``generation.json`` "trees"), or None.

        Verify cost grows with tree size much faster on a CPU than on a GPU, so a stack meant for
        CPUs can ship smaller trees than the paper's defaults."""
        return read_generation_settings(self.root).get("trees", {}).get(method)

    def default_sampling(self) -> dict[str, float]:
        """The stack's recommended sampling settings (``generation.json``), or {}."""
        raw = read_generation_settings(self.root)
        return {k: raw[k] for k in SAMPLING_KEYS if k in raw}


SAMPLING_KEYS = ("temperature", "top_k", "top_p", "cfg_scale")


def read_generation_settings(root: Path) -> dict[str, Any]:
    """``root/generation.json`` ({} when absent), checked field by field: errors name the file and
    the field (``generation.json: trees.lantern++: ...``), not the command-line flag it stands in for."""
    from lantern.config import SamplingConfig, TreeConfig
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
            f"--model {root} is a Chameleon-family model (Anole, Lumina-mGPT): `lantern generate` and "
            "`lantern train-chameleon-drafter` run it; demo, bench and profile take LlamaGen stacks only for now"
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
