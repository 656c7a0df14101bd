"""Tiny random models for tests, smoke runs and benchmarks of the decoding machinery.

Random weights say nothing about image quality; they exercise shapes, caches, masks and the
acceptance rules on CPU in milliseconds. The output layer uses a larger init (``logit_std``) than
LlamaGen's zero init so next-token distributions are not uniform.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from lantern.io import write_json
from lantern.models.drafter import DrafterConfig, EagleDrafterModel
from lantern.models.llamagen import LlamaGen, LlamaGenConfig
from lantern.models.vq import VQConfig, VQModel


def tiny_llamagen_config(**overrides: Any) -> LlamaGenConfig:
    base: dict[str, Any] = dict(
        dim=64,
        n_layer=2,
        n_head=4,
        vocab_size=256,
        block_size=64,
        num_classes=10,
        cls_token_num=1,
        multiple_of=32,
        class_dropout_prob=0.1,
        token_dropout_p=0.0,
        resid_dropout_p=0.0,
        ffn_dropout_p=0.0,
    )
    base.update(overrides)
    return LlamaGenConfig(**base)


def tiny_llamagen(seed: int = 0, logit_std: float = 0.5, **overrides: Any) -> LlamaGen:
    """A small random LlamaGen in eval mode with non-flat next-token distributions."""
    torch.manual_seed(seed)
    model = LlamaGen(tiny_llamagen_config(**overrides))
    model.init_weights(std=0.3, zero_output=False, seed=seed)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed + 1)
        model.output.weight.copy_(torch.randn(model.output.weight.shape, generator=gen) * logit_std)
    return model.eval()


def tiny_vq_config(vocab: int = 256) -> VQConfig:
    return VQConfig(
        codebook_size=vocab,
        codebook_embed_dim=8,
        z_channels=32,
        ch=32,
        ch_mult=(1, 1, 2),
        num_res_blocks=1,
        norm_groups=8,
    )


def tiny_vq(seed: int = 0, vocab: int = 256) -> VQModel:
    torch.manual_seed(seed)
    return VQModel(tiny_vq_config(vocab)).eval()


def make_random_stack(
    out: str | os.PathLike[str], seed: int = 0, num_classes: int = 10, grid: int = 8, vocab: int = 256
) -> Path:
    """Write a tiny random stack: target, tokenizer, (untrained) drafter and proximity table."""
    out = Path(out)
    target = tiny_llamagen(seed, num_classes=num_classes, block_size=grid * grid, vocab_size=vocab)
    target.save_pretrained(out / "target")
    vq = tiny_vq(seed, vocab)
    vq.save_pretrained(out / "tokenizer")
    torch.manual_seed(seed + 2)
    EagleDrafterModel(DrafterConfig.for_target(target.config)).save_pretrained(out / "drafter")
    from lantern.proximity import build_proximity

    table = build_proximity(vq.quantize.embedding.weight.detach(), k_max=min(64, vocab - 1))
    table.save(out / "proximity.safetensors")
    write_json(out / "provenance.json", {"kind": "random", "seed": seed, "note": "untrained: for smoke tests only"})
    return out
