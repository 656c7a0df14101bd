"""Tiny random models for tests, smoke runs and benchmarks of the decoding machinery.

Random weights say nothing about image quality; they exercise shapes, caches, masks and the
acceptance rules on CPU in milliseconds. The output layer uses a larger init (``logit_std``) than
LlamaGen's zero init so next-token distributions are not uniform.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from lantern.io import write_json
from lantern.models.drafter import DrafterConfig, EagleDrafterModel
from lantern.models.llamagen import LlamaGen, LlamaGenConfig
from lantern.models.vq import VQConfig, VQModel


@contextmanager
def single_thread() -> Iterator[None]:
    """One intra-op thread for the block: tiny models only pay for thread synchronisation, and on
    a busy shared CPU a thread barrier can stall every small op."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


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


Z_999 = 3.090232306167813  # standard normal 0.999 quantile


def chi_square_pooled(codes: torch.Tensor, p: torch.Tensor, vocab: int) -> tuple[float, int]:
    """(statistic, degrees of freedom) of token rows ``codes [R, k]`` against the joint cell
    probabilities ``p [vocab^k]`` (row-major in x_0..x_{k-1}).

    Cells with expected count < 5 are pooled (and the pool merged with the smallest other cell
    while its expectation is still < 5), the textbook condition for the chi-square approximation.
    """
    k = codes.shape[1]
    cell = (codes * vocab ** torch.arange(k - 1, -1, -1)).sum(1)
    observed = torch.bincount(cell, minlength=vocab**k).double()
    expected = p * codes.shape[0]
    order = expected.argsort()
    obs, exp = observed[order].tolist(), expected[order].tolist()
    pool_o = pool_e = 0.0
    while obs and (exp[0] < 5 or pool_e < 5):
        pool_o, pool_e = pool_o + obs.pop(0), pool_e + exp.pop(0)
    cells = list(zip(obs, exp, strict=True)) + ([(pool_o, pool_e)] if pool_e > 0 else [])
    return sum((o - e) ** 2 / e for o, e in cells), len(cells) - 1


def chi_square_threshold(df: int) -> float:
    """Wilson-Hilferty approximation of the chi-square 0.999 quantile."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + Z_999 * math.sqrt(a)) ** 3


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
    from lantern.targets.proximity import build_proximity

    table = build_proximity(vq.quantize.embedding.weight.detach(), k_max=min(64, vocab - 1))
    table.save(out / "proximity.safetensors")
    write_json(out / "provenance.json", {"kind": "random", "seed": seed, "note": "untrained: for smoke tests only"})
    return out


# ----------------------------------------------------------------------------------------------
# Chameleon family (tests only; needs transformers)

TINY_CHAMELEON_VOCAB = 8832  # covers the real special ids (8197, 8710, 8803, 8804 + n), so real layouts apply
TINY_TEXT_IDS = range(100, 200)  # token ids tiny prompts are made of


def tiny_chameleon(seed: int = 0, num_codes: int = 16, logit_std: float = 0.3, **overrides: Any) -> Any:
    """A small random transformers ``ChameleonForConditionalGeneration`` (eval mode).

    Its ``vocabulary_map`` puts code ``c`` at BPE id ``4 + perm[c]`` for a seeded permutation, so a
    code/BPE mix-up shows; GQA (2 key/value heads for 4 query heads) and biased q/k LayerNorms are
    on so every Chameleon-specific piece of the layer is exercised.
    """
    from transformers import ChameleonConfig, ChameleonForConditionalGeneration

    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(num_codes, generator=gen).tolist()
    letters = {str(i): chr(ord("A") + i) for i in range(10)}
    vocab_map = {"IMGIMG" + "".join(letters[d] for d in str(c)) + "Z": 4 + perm[c] for c in range(num_codes)}
    vocab_map["<image>"] = 8711
    base: dict[str, Any] = dict(
        vocab_size=TINY_CHAMELEON_VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.1,
        vocabulary_map=vocab_map,
        vq_config=dict(num_embeddings=num_codes, embed_dim=8, latent_channels=8, base_channels=32,
                       channel_multiplier=[1, 1], resolution=16, num_res_blocks=1),
    )
    base.update(overrides)
    torch.manual_seed(seed)
    model = ChameleonForConditionalGeneration(ChameleonConfig(**base))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # move LayerNorm / RMSNorm params off their defaults
                p.add_(torch.randn(p.shape, generator=gen) * 0.1)
        model.lm_head.weight.copy_(torch.randn(model.lm_head.weight.shape, generator=gen) * logit_std)
    return model.eval()


TINY_WORDS = ("a", "cat", "dog", "red", "car", "on", "the", "grass", "Generate", "an", "image", "of")


def make_tiny_chameleon_folder(out: str | os.PathLike[str], layout_name: str = "lumina-mgpt",
                               image_size: int | None = 64, seed: int = 0) -> Path:
    """A tiny random Chameleon folder laid out like a real download, for CLI tests: HF weights,
    a word-level tokenizer, ``vqgan.ckpt`` + ``vqgan.yaml`` in the release's format, a drafter
    (``drafter/``), a proximity table and ``generation.json`` naming the layout."""
    import yaml
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    from lantern.models.chameleon import ChameleonLM, layout_by_name
    from lantern.models.chameleon_vq import ChameleonVQConfig, ChameleonVQGAN
    from lantern.targets.chameleon_stack import init_chameleon_drafter
    from lantern.targets.proximity import build_proximity

    out = Path(out)
    hf = tiny_chameleon(seed=seed)
    hf.save_pretrained(out)
    vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3} | {w: 100 + i for i, w in enumerate(TINY_WORDS)}
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                            pad_token="<pad>").save_pretrained(out)
    vq_cfg = ChameleonVQConfig(embed_dim=8, n_embed=16, z_channels=16, resolution=16, ch=32, ch_mult=(1, 2),
                               num_res_blocks=1)
    torch.manual_seed(seed + 1)
    vq = ChameleonVQGAN(vq_cfg)
    torch.save({"state_dict": vq.state_dict(), "global_step": 0}, out / "vqgan.ckpt")
    dd = {k: v for k, v in vq_cfg.to_dict().items() if k not in ("embed_dim", "n_embed")}
    params = {"embed_dim": vq_cfg.embed_dim, "n_embed": vq_cfg.n_embed, "ddconfig": dd}
    (out / "vqgan.yaml").write_text(yaml.safe_dump({"model": {"target": "taming.models.vqgan.VQModel",
                                                               "params": params}}))
    layout = layout_by_name(layout_name, image_size)
    init_chameleon_drafter(ChameleonLM(hf), layout, seed=seed + 2).save_pretrained(out / "drafter")
    build_proximity(vq.codebook().detach(), k_max=15).save(out / "proximity.safetensors")
    write_json(out / "generation.json", {"layout": layout_name, "temperature": 1.0, "top_k": 8, "cfg_scale": 3.0})
    return out


def tiny_released_drafter(lm: Any, layout_name: str = "lumina-mgpt", seed: int = 0, **overrides: Any) -> Any:
    """A random drafter in the key layout of LANTERN's released Chameleon drafters, sized for the
    tiny Chameleon ``lm`` (a :class:`lantern.models.chameleon.ChameleonLM`). Its embedding is the
    target's, as the official training starts (``load_emb``); norm parameters are moved off their
    defaults so a wrong norm layout shows."""
    from lantern.models.chameleon_drafter import ReleasedChameleonDrafter, ReleasedDrafterConfig

    cfg = lm.config
    base: dict[str, Any] = dict(
        hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
        vocab_size=cfg.vocab_size, rms_norm_eps=cfg.rms_norm_eps, layout=layout_name,
    )
    base.update(overrides)
    torch.manual_seed(seed)
    model = ReleasedChameleonDrafter(ReleasedDrafterConfig(**base))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(lm.hf.model.embed_tokens.weight.float())
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn(p.shape, generator=gen) * 0.1)
    return model.eval()


def chameleon_parts(lm: Any, layout: Any, sampling: Any, method: Any, drafter: torch.nn.Module | None,
                    head: torch.nn.Linear) -> tuple[Any, Any]:
    """A fresh Chameleon target adapter and drafter for one batch, as the run path builds them
    (``PreparedMethod.parts``), for a bare ``ChameleonLM`` and layout: tests drive the loop with these."""
    from lantern.decoding.loop import Acceptance
    from lantern.run import PreparedMethod
    from lantern.targets.chameleon_stack import ChameleonStack

    stack = ChameleonStack(root=Path("."), model=lm, layout=layout, vq=None, tokenizer=None)
    prepared = PreparedMethod(stack, method, sampling, drafter if method.tree.kind != "none" else None, Acceptance())
    return prepared.parts(head)
