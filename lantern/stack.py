"""Model stacks: the folder a user points ``--model`` at.

A stack folder holds everything one image generator needs::

    DIR/target/        LlamaGen model folder (config.json + model.safetensors), or an HF port
    DIR/tokenizer/     VQ tokenizer folder
    DIR/drafter/       optional EAGLE drafter folder
    DIR/proximity.safetensors   optional latent proximity table (LANTERN)
    DIR/provenance.json         optional: how it was made

``--model`` also accepts a bare target folder when ``--tokenizer`` is given separately.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from lantern.errors import LanternError
from lantern.models.llamagen import LlamaGen
from lantern.models.vq import VQModel

TARGET_DIR, TOKENIZER_DIR, DRAFTER_DIR, PROXIMITY_FILE = "target", "tokenizer", "drafter", "proximity.safetensors"


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


def resolve_model_dir(model: str | os.PathLike[str]) -> Path:
    """A stack folder path (embedded presets are resolved here once they exist)."""
    path = Path(model)
    if not path.exists():
        raise LanternError(f"--model: no such model folder {path}")
    if not path.is_dir():
        raise LanternError(f"--model: {path} is not a folder")
    return path


def load_stack(
    model: str | os.PathLike[str],
    tokenizer: str | os.PathLike[str] | None = None,
    dtype: torch.dtype | None = None,
) -> ModelStack:
    root = resolve_model_dir(model)
    target_dir = root / TARGET_DIR if (root / TARGET_DIR).is_dir() else root
    tok_dir = Path(tokenizer) if tokenizer is not None else root / TOKENIZER_DIR
    if not tok_dir.exists():
        raise LanternError(
            f"--model {root} has no {TOKENIZER_DIR}/ folder; pass --tokenizer DIR (a VQ tokenizer folder)"
        )
    target = LlamaGen.from_pretrained(target_dir, dtype=dtype)
    vq = VQModel.from_pretrained(tok_dir)
    if vq.config.codebook_size != target.config.vocab_size:
        raise LanternError(
            f"tokenizer codebook ({vq.config.codebook_size} entries) does not match the target's "
            f"vocabulary ({target.config.vocab_size})"
        )
    return ModelStack(root=root, target=target.eval(), tokenizer=vq.eval())
