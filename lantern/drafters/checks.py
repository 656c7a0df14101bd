"""Up-front compatibility checks between a target, a drafter and a draft tree.

Why a module of its own: these mismatches otherwise surface as a shape error deep inside a
matmul (a drafter built for another hidden size), as silently wrong results (a drafter over
another vocabulary would index the wrong lm_head rows), or as wasted work (a tree deeper than
the image can never be fully accepted). Each check raises :class:`LanternError` naming both sides.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from lantern.decoding.config import TreeConfig
from lantern.errors import check
from lantern.models.chameleon import ChameleonLM, ImageLayout
from lantern.models.drafter import DrafterConfig, EagleDrafterModel
from lantern.models.llamagen import LlamaGenConfig

if TYPE_CHECKING:  # Janus models load through transformers, an optional extra
    from lantern.models.emu3 import Emu3LM
    from lantern.models.janus import JanusLM

    AdapterLM = ChameleonLM | JanusLM | Emu3LM  # the models behind lantern.targets.chameleon.ChameleonTarget


def check_drafter_matches_target(drafter_cfg: DrafterConfig, target_cfg: LlamaGenConfig) -> None:
    """The drafter reads the target's features (hidden size) and shares its lm_head (vocabulary)."""
    check(
        drafter_cfg.hidden_size == target_cfg.dim,
        f"drafter hidden_size ({drafter_cfg.hidden_size}) does not match the target's hidden size "
        f"(dim {target_cfg.dim}): the drafter was trained for another target model",
    )
    check(
        drafter_cfg.vocab_size == target_cfg.vocab_size,
        f"drafter vocab_size ({drafter_cfg.vocab_size}) does not match the target's vocabulary "
        f"({target_cfg.vocab_size} image tokens)",
    )


HEAD_SHA_KEY = "target_head_bf16_sha256"  # drafter_training.json: the lm_head of the target it was trained for


def head_sha256(head: torch.Tensor) -> str:
    """sha256 of a target's lm_head weight rounded to bfloat16: the same for the target loaded in
    float32 or bfloat16 (the rounding of a float32 weight is exact and fixed), and different for a
    retrained or another target. (``target_fingerprint`` also hashes the config's JSON, which gains
    keys across lantern versions: a drafter's older record would not match its own target.)"""
    import hashlib

    bits = head.detach().to(device="cpu", dtype=torch.bfloat16).contiguous().view(torch.int16)
    return hashlib.sha256(bits.numpy().astype("<i2", copy=False).tobytes()).hexdigest()


def warn_if_trained_for_another_head(path: str | os.PathLike[str], head: torch.Tensor) -> None:
    """A drafter lantern trained for another target of the same shape passes every shape check and
    then has its drafts rejected (lossless methods stay exact, only slow): a warning names it. Only
    for a target held in float32 or bfloat16, whose bfloat16 rounding is the trained one's."""
    import warnings

    from lantern.io import LanternWarning, read_json_object
    from lantern.models.drafter import TRAINING_INFO_FILE

    record = Path(path) / TRAINING_INFO_FILE
    if head.dtype not in (torch.float32, torch.bfloat16) or not record.is_file():
        return
    recorded = read_json_object(record, "drafter training record").get(HEAD_SHA_KEY)
    if isinstance(recorded, str) and recorded != head_sha256(head):
        warnings.warn(f"--drafter {path} was trained for another target (its {TRAINING_INFO_FILE} records "
                      "another lm_head): it runs, and the lossless methods stay exact, but few drafts will be "
                      "accepted", LanternWarning, stacklevel=2)


def warn_if_the_tail_is_outrun(tree: TreeConfig, network: torch.nn.Module) -> None:
    """Deterministic mode on a CPU takes a query's last keys (the tail, 16) out of the attention
    kernel, so that a tree node's kernel part lies side by side as in an AR step; a static tree
    with a node that keeps more keys past the first slot of another branch (a fork, then a long
    branch: a custom ``--tree``) outruns it. It still decodes, and a row's codes still do not depend
    on its batch, but greedy decoding is no longer sure to give greedy AR's codes: a warning says so.
    The count is the tree's own; a Chameleon-family row end can add a new-line key to a branch,
    so the depth the warning names as safe is one less than the tail."""
    import warnings

    from lantern.decoding.trees import keys_past_first_gap, static_tree
    from lantern.io import LanternWarning

    tails = {calls.tail for m in network.modules() if (calls := getattr(m, "attention_calls", None)) is not None}
    if tree.kind != "static" or not tails or not min(tails):  # chains have no gap; dynamic trees are 4 deep
        return
    tail, past = min(tails), keys_past_first_gap(static_tree(tree.fixed_choices()).buffers.mask)
    if past > tail:
        warnings.warn(f"--tree {tree.spec}: a node keeps {past} keys past the first slot of another branch, more than "
                      f"the {tail} that deterministic attention takes out of the kernel: it runs, and a row's codes "
                      f"do not depend on its batch, but greedy decoding may leave greedy AR's codes (a tree at most "
                      f"{tail - 1} deep is always covered)", LanternWarning, stacklevel=2)


def check_tree_fits(tree: TreeConfig, num_tokens: int) -> None:
    """A tree whose depth reaches the number of image tokens can never be used in full.

    After the first token (sampled at prefill) only ``num_tokens - 1`` remain, so a draft of depth
    ``>= num_tokens`` is always cut by the loop's depth cap: almost surely a wrong ``--tree`` for
    this image size (e.g. a 2x2 test grid with a depth-5 static tree).
    """
    depth = tree.max_depth
    check(
        depth < num_tokens,
        f"--tree {_describe(tree)} has depth {depth}, not less than the image's {num_tokens} tokens", field="tree",
    )


def _describe(tree: TreeConfig) -> str:
    if tree.kind == "static":
        return f"'static:{tree.name}'"
    if tree.kind == "chain":
        return f"'chain:{tree.depth}'"
    return f"'dynamic' (depth {tree.depth}, top_k {tree.top_k}, total_tokens {tree.total_tokens})"


def check_t2i_drafter_layout(drafter: EagleDrafterModel, cfg: LlamaGenConfig, path: object) -> None:
    """A T2I drafter's RoPE table is laid out for one caption length and one image grid (LANTERN's
    ``t2i`` = Stage I, 256 tokens; ``t2i2`` = Stage II, 1024): with the other stage's target its
    positions would silently land on the wrong grid cells."""
    if cfg.model_type != "t2i":
        return
    d = drafter.config
    check(
        (d.target_cls_token_num, d.block_size) == (cfg.cls_token_num, cfg.block_size),
        f"drafter {path} was made for a target with {d.target_cls_token_num} caption tokens and {d.block_size} "
        f"image tokens, this target has {cfg.cls_token_num} and {cfg.block_size}: use the drafter of the same "
        "stage (LANTERN's llamagen_drafter for Stage I / 256 tokens, llamagen2_drafter for Stage II / 1024)",
    )


def check_drafter_layout(drafter: DrafterConfig, cfg: LlamaGenConfig, path: object) -> None:
    """A LlamaGen drafter's 2D RoPE table is laid out for one condition length and one image grid:
    with another target its positions would be clamped or land on the wrong grid cells, and it
    would run silently with a poor acceptance. (T2I drafters get the stage-specific message of
    :func:`check_t2i_drafter_layout` first.)"""
    problems = []
    if drafter.rope != "2d":
        problems.append(f"rope {drafter.rope!r} (LlamaGen targets need '2d')")
    if drafter.block_size != cfg.block_size:
        problems.append(f"block_size {drafter.block_size} (image tokens, {_grid(drafter.block_size)}; the target "
                        f"has {cfg.block_size}, {_grid(cfg.block_size)})")
    if drafter.target_cls_token_num != cfg.cls_token_num:
        problems.append(f"target_cls_token_num {drafter.target_cls_token_num} (the target has "
                        f"{cfg.cls_token_num} condition tokens)")
    check(not problems, f"drafter {path} does not fit this LlamaGen target: {'; '.join(problems)}; use a drafter "
                        "trained for this target (`lantern train-drafter`)")


def _grid(tokens: int) -> str:
    side = math.isqrt(tokens)
    return f"grid {side}x{side}" if side * side == tokens else "not a square grid"


def drafter_dtype(target_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The drafter's precision: the target's, except float32 on CPUs.

    Its features come from the target and its logits from the target's lm_head, so on GPUs it
    simply follows the target. On a CPU a bf16 target pays off because its many layers no longer
    fit in cache (halving the bytes read per token), but the drafter is one layer that stays in
    cache, and CPU bf16 kernels at the drafter's tiny row counts are slower than float32 ones
    (measured on the photos preset: 237 vs 175 us of matmuls per drafter step).
    """
    return torch.float32 if device.type == "cpu" else target_dtype


def chameleon_drafter_config(model: AdapterLM, layout: ImageLayout, **overrides: Any) -> DrafterConfig:
    """An EAGLE drafter sized like one Chameleon layer, in code space, with 1D RoPE."""
    cfg = model.config
    # One Chameleon layer's sizes, in code space, positions counted from the image prefix.
    sizes = {name: getattr(cfg, name) for name in ("hidden_size", "intermediate_size", "num_attention_heads",
                                                     "num_key_value_heads", "rms_norm_eps")}
    return DrafterConfig(**{**sizes, "vocab_size": model.num_codes, "target_cls_token_num": len(layout.prefix),
                            "block_size": layout.num_tokens, "rope_base": float(_rope_theta(cfg)), "rope": "1d",
                            **overrides})


def _rope_theta(cfg: Any) -> float:
    params = getattr(cfg, "rope_parameters", None)  # transformers 5; 4.x keeps rope_theta on the config
    return float(params["rope_theta"]) if isinstance(params, dict) and "rope_theta" in params else float(cfg.rope_theta)


# What a drafter's training record names, as the family it was trained for.
TRAINED_FOR = {"llamagen": "a LlamaGen target", "anole": "a Chameleon-family model (layout 'anole')",
               "lumina-mgpt": "a Chameleon-family model (layout 'lumina-mgpt')", "janus": "a Janus model",
               "emu3": "an Emu3 model"}


def load_trained_drafter(path: str | os.PathLike[str], model: JanusLM | Emu3LM, layout: ImageLayout,
                         family: str) -> EagleDrafterModel:
    """A lantern-trained drafter folder (``lantern train-chameleon-drafter --model`` a folder of
    ``family``) for a model on the Chameleon adapter that has no released drafters, checked
    against the model: what it was trained for, then its shapes."""
    from lantern.models.chameleon_drafter import is_released_drafter_folder

    hint = f"train one with `lantern train-chameleon-drafter --model <this {family} folder>`"
    # LANTERN's released drafters read Chameleon's BPE ids: the shape checks could not say why they fail here
    check(not is_released_drafter_folder(path), f"--drafter {path} is one of LANTERN's released Anole / "
                                                f"Lumina-mGPT drafters, not a drafter for this {family} model: {hint}")
    trained = trained_layout(Path(path))
    check(trained in (None, layout.name), f"--drafter {path} was trained for "
                                          f"{TRAINED_FOR.get(str(trained), repr(trained))}, not this {family} model: "
                                          f"{hint}")
    drafter = EagleDrafterModel.from_pretrained(path)
    check_chameleon_drafter(drafter.config, model, layout, path, family=family)
    return drafter


def trained_layout(path: Path) -> str | None:
    """The layout a drafter's training record (``drafter_training.json``) names ("llamagen" for
    train-drafter's record of a LlamaGen target); None without a record. A drafter for another
    family's model of the same sizes would otherwise pass the shape checks and only draft badly."""
    from lantern.io import read_json_object
    from lantern.models.drafter import TRAINING_INFO_FILE

    info_file = path / TRAINING_INFO_FILE
    if not info_file.is_file():
        return None
    info = read_json_object(info_file, "drafter training record")
    if "target_fingerprint" in info:
        return "llamagen"
    return None if info.get("layout") is None else str(info["layout"])


def check_chameleon_drafter(drafter: DrafterConfig, model: AdapterLM, layout: ImageLayout, path: object,
                            family: str = "Chameleon") -> None:
    want = chameleon_drafter_config(model, layout)
    problems = [
        f"{name} {getattr(drafter, name)} (target needs {getattr(want, name)})"
        for name in ("hidden_size", "vocab_size", "rope", "target_cls_token_num")
        if getattr(drafter, name) != getattr(want, name)
    ]
    if drafter.block_size < layout.num_tokens:  # its RoPE table would run out before the image ends
        problems.append(f"block_size {drafter.block_size} (the layout has {layout.num_tokens} image tokens)")
    check(not problems, f"drafter {path} does not fit this {family} target and layout: {'; '.join(problems)}")
