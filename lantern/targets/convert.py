"""Official LlamaGen checkpoints as a lantern stack folder (``lantern convert-llamagen``).

FoundationVision/LlamaGen ships each model as two pickles, a GPT (``c2i_L_256.pt``,
``t2i_XL_stage1_256.pt``) and a VQ tokenizer (``vq_ds16_c2i.pt``), and its sampling scripts take
the model's size and image size on their command lines (``--gpt-model GPT-L --image-size 256``):
the files do not say. The conversion reads both once, through the safe loader, works the sizes
out of the weights' shapes (the image size from the file's training ``args`` or its name, unless
given), and writes a stack folder that every later run loads from safetensors::

    OUT/target/                  the GPT (config.json + model.safetensors)
    OUT/tokenizer/               the VQ tokenizer
    OUT/proximity.safetensors    the codebook's nearest neighbours, which LANTERN's acceptance reads
    OUT/generation.json          LlamaGen's own sampling defaults (sample_c2i.py / sample_t2i.py)
    OUT/drafter/                 with ``--drafter``: an EAGLE drafter for this model, checked and copied
    OUT/provenance.json          the files it came from and the sizes read from them

A text-to-image model also needs its T5 encoder (google/flan-t5-xl) at ``OUT/t5`` or ``--t5``.
The folder is written all-or-nothing (:class:`lantern.outputs.OutputFolder`).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

from lantern.errors import check
from lantern.io import write_json
from lantern.models.llamagen import GPT_CONFIGS, LlamaGen
from lantern.models.vq import VQ_CONFIGS, VQModel
from lantern.outputs import OutputFolder
from lantern.targets.base import DRAFTER_DIR, GENERATION_FILE, PROXIMITY_FILE, TARGET_DIR, TOKENIZER_DIR
from lantern.targets.llamagen_stack import llamagen_sampling
from lantern.targets.proximity import DEFAULT_K_MAX, build_proximity
from lantern.version import __version__


def convert_llamagen(gpt_ckpt: str | os.PathLike[str], vq_ckpt: str | os.PathLike[str], out: str | os.PathLike[str],
                     *, image_size: int | None = None, gpt_model: str | None = None, proximity: bool = True,
                     drafter: str | os.PathLike[str] | None = None, overwrite: bool = False,
                     progress: bool = False) -> Path:
    """Write the stack folder ``out`` from an official GPT and VQ checkpoint (see the module
    docstring); returns its path. ``image_size`` / ``gpt_model`` override what the files tell.
    ``drafter``: an EAGLE drafter folder for this model (LANTERN's ``jadohu/llamagen_drafter``),
    checked against it and copied in as ``OUT/drafter``."""
    gpt_path, vq_path = Path(gpt_ckpt), Path(vq_ckpt)
    check(drafter is None or Path(drafter).is_dir(), f"--drafter: no such folder {drafter}")
    check(gpt_model is None or gpt_model in GPT_CONFIGS,
          f"--gpt-model must be one of {', '.join(GPT_CONFIGS)}, got {gpt_model!r}")
    check(image_size is None or (isinstance(image_size, int) and image_size > 0),
          f"--image-size must be a positive number of pixels, got {image_size!r}")
    for flag, path in (("--gpt-ckpt", gpt_path), ("--vq-ckpt", vq_path)):
        check(path.is_file(), f"{flag}: no such file {path}")
    target = OutputFolder.check(out, "--out", overwrite,
                                reads={"--gpt-ckpt": gpt_path, "--vq-ckpt": vq_path, "--drafter": drafter})

    vq = VQModel.from_official_checkpoint(vq_path, config=None)
    model = LlamaGen.from_official_checkpoint(gpt_path, image_size=image_size, downsample=vq.config.downsample_factor,
                                              gpt_model=gpt_model)
    config = model.config
    check(config.vocab_size == vq.config.codebook_size,
          f"--gpt-ckpt {gpt_path} predicts {config.vocab_size} codes, --vq-ckpt {vq_path} has "
          f"{vq.config.codebook_size}: not a pair")
    name = next(n for n, c in GPT_CONFIGS.items() if (c["dim"], c["n_layer"]) == (config.dim, config.n_layer))
    vq_name = next((n for n, c in VQ_CONFIGS.items()
                    if replace(c, codebook_size=vq.config.codebook_size,
                               codebook_embed_dim=vq.config.codebook_embed_dim) == vq.config), "custom")
    size = config.grid_size * vq.config.downsample_factor
    if drafter is not None:
        _check_drafter(Path(drafter), model)
    with target.write() as folder:
        model.save_pretrained(folder / TARGET_DIR)
        vq.save_pretrained(folder / TOKENIZER_DIR)
        if proximity:
            codebook = vq.quantize.embedding.weight.detach()
            table = build_proximity(codebook, min(DEFAULT_K_MAX, codebook.shape[0] - 1), progress=progress)
            table.save(folder / PROXIMITY_FILE)
        write_json(folder / GENERATION_FILE, llamagen_sampling(config.model_type, config.vocab_size))
        if drafter is not None:
            shutil.copytree(drafter, folder / DRAFTER_DIR)
        write_json(folder / "provenance.json", _provenance(gpt_path, vq_path, name, vq_name, size, config))
    return target.path


def _check_drafter(path: Path, model: LlamaGen) -> None:
    """The checks a run makes when it loads the stack's drafter, made now: a stack is not written
    with a drafter of another model (LANTERN's Stage I drafter beside a Stage II target)."""
    from lantern.drafters.checks import check_drafter_layout, check_drafter_matches_target, check_t2i_drafter_layout
    from lantern.models.drafter import EagleDrafterModel

    loaded = EagleDrafterModel.from_pretrained(path)
    check_drafter_matches_target(loaded.config, model.config)
    check_t2i_drafter_layout(loaded, model.config, path)
    check_drafter_layout(loaded.config, model.config, path)


def _provenance(gpt: Path, vq: Path, name: str, vq_name: str, size: int, config: Any) -> dict[str, Any]:
    return {"kind": "converted from official LlamaGen checkpoints", "lantern": __version__,
            "gpt_ckpt": {"file": gpt.name, "bytes": gpt.stat().st_size},
            "vq_ckpt": {"file": vq.name, "bytes": vq.stat().st_size},
            "gpt_model": name, "vq_model": vq_name, "gpt_type": config.model_type, "image_size": size,
            "image_tokens": config.block_size}
