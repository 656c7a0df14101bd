"""HPS v2 / v2.1, the Human Preference Score (Wu et al. 2023): how much people would like an image
for its prompt, as LANTERN's ``eval_hpsv2.py`` reports it (``hpsv2.score(..., hps_version="v2.1")``).

HPS is OpenCLIP's ViT-H-14 fine-tuned on human choices; its score is the cosine of an image's and
its prompt's normalised embeddings (no scale, no clamp: published means are about 0.2-0.3). The
released file (``HPS_v2.1_compressed.pt``, ``{"state_dict": ...}``) is OpenCLIP's layout; lantern
renames it into transformers' ``CLIPModel`` (:func:`open_clip_to_transformers`) and runs it on the
config and tokenizer of a local ViT-H-14 folder in transformers' layout
(``laion/CLIP-ViT-H-14-laion2B-s32B-b79K``: the same architecture; its own weights are not read).
Images are resized bicubic to 224 and normalised with OpenAI's mean and std, as OpenCLIP's
preprocessing does for a square image (torch's resize, not PIL's: close, not equal).
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lantern.errors import LanternError, check
from lantern.eval.metrics import ClipFeatureExtractor, ClipScorer

# OpenCLIP's names -> transformers' CLIPModel names, for what is renamed as it is (weights [out, in]).
_VISION = {"visual.class_embedding": "vision_model.embeddings.class_embedding",
           "visual.positional_embedding": "vision_model.embeddings.position_embedding.weight",
           "visual.conv1.weight": "vision_model.embeddings.patch_embedding.weight",
           "visual.ln_pre": "vision_model.pre_layrnorm", "visual.ln_post": "vision_model.post_layernorm"}
_TEXT = {"token_embedding.weight": "text_model.embeddings.token_embedding.weight",
         "positional_embedding": "text_model.embeddings.position_embedding.weight",
         "ln_final": "text_model.final_layer_norm"}
_BLOCK = {"ln_1": "layer_norm1", "ln_2": "layer_norm2", "attn.out_proj": "self_attn.out_proj",
          "mlp.c_fc": "mlp.fc1", "mlp.c_proj": "mlp.fc2"}
_RESBLOCK = re.compile(r"^(visual\.)?transformer\.resblocks\.(\d+)\.(.+)\.(weight|bias)$")
_IN_PROJ = re.compile(r"^(visual\.)?transformer\.resblocks\.(\d+)\.attn\.in_proj_(weight|bias)$")
_UNUSED = ("logit_scale",)  # the contrastive temperature: a score is a plain cosine


def open_clip_to_transformers(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """An OpenCLIP ``CLIP`` state dict (a ViT image tower, the top-level text tower) under
    transformers' ``CLIPModel`` names: ``nn.MultiheadAttention``'s stacked ``in_proj`` split into
    q, k and v; the projections ``x @ proj`` transposed into ``Linear`` weights. A key of no known
    part (another tower type, layer scale, attention pooling) is refused, naming it."""
    if state and all(key.startswith("module.") for key in state):  # saved from DistributedDataParallel
        state = {key[len("module."):]: value for key, value in state.items()}
    out: dict[str, Tensor] = {}
    for key, value in state.items():
        if key in _UNUSED:
            continue
        renamed = _rename(key, value)
        if renamed is None:
            raise LanternError(f"--hps: key {key!r} is not part of an OpenCLIP ViT CLIP (HPS v2 is OpenCLIP's "
                               "ViT-H-14)")
        out.update(renamed)
    return out


def _rename(key: str, value: Tensor) -> dict[str, Tensor] | None:
    if key == "visual.proj":
        return {"visual_projection.weight": value.t().contiguous()}
    if key == "text_projection":
        return {"text_projection.weight": value.t().contiguous()}
    split = _IN_PROJ.match(key)
    if split is not None:
        tower = "vision_model" if split[1] else "text_model"
        prefix = f"{tower}.encoder.layers.{split[2]}.self_attn"
        q, k, v = value.chunk(3, dim=0)  # nn.MultiheadAttention stacks them in this order
        return {f"{prefix}.{name}_proj.{split[3]}": part.contiguous() for name, part in zip("qkv", (q, k, v),
                                                                                                strict=True)}
    block = _RESBLOCK.match(key)
    if block is not None and block[3] in _BLOCK:
        tower = "vision_model" if block[1] else "text_model"
        return {f"{tower}.encoder.layers.{block[2]}.{_BLOCK[block[3]]}.{block[4]}": value}
    for table in (_VISION, _TEXT):
        for name, target in table.items():
            if key == name:
                return {target: value}
            if key.startswith(name + ".") and key.count(".") == name.count(".") + 1:  # a norm's weight / bias
                return {f"{target}{key[len(name):]}": value}
    return None


@contextlib.contextmanager
def _no_init() -> Iterator[None]:
    """transformers' skip of random initialisation (ViT-H-14's billion weights are loaded next)."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:
        try:
            from transformers.modeling_utils import no_init_weights  # type: ignore[attr-defined,no-redef]
        except ImportError:
            no_init_weights = contextlib.nullcontext  # type: ignore[assignment]
    with no_init_weights():
        yield


class HpsScorer(ClipScorer):
    """HPS v2 / v2.1 of images against their prompts (:meth:`scores`: the plain cosine, per image).
    ``weights``: HPS's file (``HPS_v2.1_compressed.pt``, read without running code, or a
    safetensors of the same state dict); ``folder``: a local ViT-H-14 CLIP folder in transformers'
    layout, for its config and tokenizer."""

    def __init__(self, weights: str | os.PathLike[str], folder: str | os.PathLike[str],
                 device: torch.device | str = "cpu") -> None:
        try:
            from transformers import (
                AutoTokenizer,
                CLIPConfig,
                CLIPTextModelWithProjection,
                CLIPVisionModelWithProjection,
            )
        except ImportError as e:
            raise LanternError("--hps needs the 'transformers' package: pip install transformers") from e
        weights, folder = Path(weights), Path(folder)
        check(weights.is_file(), f"--hps: no such file {weights} (HPS_v2.1_compressed.pt)")
        check(folder.is_dir(), f"--hps-clip: no such folder {folder} (a ViT-H-14 CLIP folder in transformers' layout, "
                               "laion/CLIP-ViT-H-14-laion2B-s32B-b79K)")
        try:
            config = CLIPConfig.from_pretrained(str(folder), local_files_only=True)
            self.tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        except (OSError, ValueError) as e:
            raise LanternError(f"--hps-clip: {folder} is not a CLIP folder with a config and a tokenizer: "
                               f"{str(e).splitlines()[0]}") from None
        state = _state_dict(weights)
        renamed = open_clip_to_transformers(state)
        text_config: Any = config.text_config
        vision_config: Any = config.vision_config
        text_config.projection_dim = vision_config.projection_dim = config.projection_dim
        with _no_init():
            self.text = CLIPTextModelWithProjection(text_config)
            vision = CLIPVisionModelWithProjection(vision_config)
        for tower, prefixes in ((self.text, ("text_model.", "text_projection.")),
                                (vision, ("vision_model.", "visual_projection."))):
            _load(tower, {k: v for k, v in renamed.items() if k.startswith(prefixes)}, weights, folder)
        self.vision = ClipFeatureExtractor(folder, model=vision)
        self.text.eval().to(device)
        self.vision.to(device)
        self.max_length = int(text_config.max_position_embeddings)
        self.prefix = ""
        self.name = f"HPS {weights.name} on {folder.name}"

    def scores(self, images: Tensor, prompts: Any, batch_size: int = 64) -> Tensor:
        """[N] HPS of ``images`` [N, C, H, W] in [-1, 1] against ``prompts`` (one each): the cosine."""
        return self.cosines(images, prompts, batch_size)


def _state_dict(path: Path) -> dict[str, Tensor]:
    from lantern.io import load_checkpoint, load_safetensors

    state: Any = (load_safetensors(path, "--hps") if path.suffix == ".safetensors"
                  else load_checkpoint(path, "--hps"))
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):  # hpsv2's {"state_dict": ...}
        state = state["state_dict"]
    check(isinstance(state, dict) and bool(state) and all(isinstance(v, Tensor) for v in state.values()),
          f"--hps: {path} holds no state dict of tensors (HPS_v2.1_compressed.pt holds {{'state_dict': ...}})")
    return state


def _load(tower: torch.nn.Module, state: dict[str, Tensor], weights: Path, folder: Path) -> None:
    """Strictly, with the tower's own position ids where the file has none (a buffer, not a weight)."""
    from lantern.io import load_state_dict_strict

    load_state_dict_strict(tower, state, f"--hps {weights} (on {folder.name}'s config)", own=("position_ids",))
