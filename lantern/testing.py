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
    size = {} if image_size is None else {"image_size": image_size}
    write_json(out / "generation.json", {"layout": layout_name, **size, "temperature": 1.0, "top_k": 8,
                                         "cfg_scale": 3.0})
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
                    head: torch.nn.Linear, compile: str | None = None,
                    prompt_width: int | None = None) -> tuple[Any, Any]:
    """A fresh Chameleon target adapter and drafter for one batch, as the run path builds them
    (``PreparedMethod.parts``), for a bare ``ChameleonLM`` and layout: tests drive the loop with these.
    ``compile``: a resolved mode (the parts' static shapes; pass it to ``generate`` too);
    ``prompt_width``: the target's (None: the default)."""
    from lantern.decoding.loop import Acceptance
    from lantern.run import PreparedMethod
    from lantern.targets.chameleon_stack import ChameleonStack

    stack = ChameleonStack(root=Path("."), model=lm, layout=layout, vq=None, tokenizer=None)
    if prompt_width is not None:
        stack.prompt_width = prompt_width
    prepared = PreparedMethod(stack, method, sampling, drafter if method.tree.kind != "none" else None, Acceptance(),
                              compile=compile)
    return prepared.parts(head)


# ----------------------------------------------------------------------------------------------
# Janus / Janus-Pro (tests only; needs transformers)

# DeepSeek's special tokens (the real tokenizer's names), then the tiny prompts' words.
JANUS_SPECIAL = {"<｜begin▁of▁sentence｜>": 0, "<｜▁pad▁｜>": 1, "<｜end▁of▁sentence｜>": 2, "<unk>": 3,
                 "<image_placeholder>": 4, "<begin_of_image>": 5, "<end_of_image>": 6, "<|User|>": 7,
                 "<|Assistant|>": 8}
JANUS_WORDS = (":", ".", ",", *TINY_WORDS, "photo", "mountain", "lake", "at", "dawn", "bowl", "fruit", "sofa")
TINY_JANUS_VOCAB = 48  # text ids; the special tokens and words above fill 0 .. 31
TINY_JANUS_CODES = 32
WIDER_INIT = ("language_model", "generation_aligner", "proj_out")
# transformers' conversion script's chat template (convert_janus_weights_to_hf.py, CHAT_TEMPLATE),
# the one the released transformers folders (deepseek-community/Janus-Pro-*) carry.
JANUS_CHAT_TEMPLATE = (
    "{%set seps=['\n\n','<\uff5cend\u2581of\u2581sentence\uff5c>']%}{%set i=0%}{%for message in messages%}"
    "{%if message['role']|lower=='user'%}<|User|>: {%elif message['role']|lower=='assistant'%}<|Assistant|>:"
    "{%if not (loop.last and not add_generation_prompt and message['content'][0]['type']=='text' and "
    "message['content'][0]['text']=='')%} {%endif%}{%else%}{{message['role'].capitalize()}}: {%endif%}"
    "{%for content in message['content']%}{%if content['type']=='image'%}{%if not loop.first%}{{'\n'}}{%endif%}"
    "<image_placeholder>{%if not loop.last%}{{'\n'}}{%endif%}{%elif content['type']=='text'%}"
    "{%set text=content['text']%}{%if loop.first%}{%set text=text.lstrip()%}{%endif%}"
    "{%if loop.last%}{%set text=text.rstrip()%}{%endif%}"
    "{%if not loop.first and message['content'][loop.index0-1]['type']=='text'%}{{' '+text}}{%else%}{{text}}"
    "{%endif%}{%endif%}{%endfor%}{%if not loop.last or add_generation_prompt%}"
    "{%if message['role']|lower=='user'%}{{seps[0]}}{%else%}{{seps[1]}}{%endif%}{%endif%}{%endfor%}"
    "{%if add_generation_prompt%}<|Assistant|>:{%endif%}"
)


def tiny_janus(seed: int = 0, num_layers: int = 2, grid: int = 4, num_codes: int = TINY_JANUS_CODES,
               logit_std: float = 0.05, **text_overrides: Any) -> Any:
    """A small random transformers ``JanusForConditionalGeneration`` (eval mode, float32).

    GQA (2 key/value heads for 4 query heads) and attention biases are on; norms are moved off their
    initial values and the weights widened so the context decides the next code; the head's scale
    (``logit_std``) keeps logits of a few units, where float32 rounding stays well under 1e-5; ``grid``
    x ``grid`` codes per image (the vision tower's image size / patch size, as in a real config);
    generation settings (pad, BOS, image-start token, guidance 3) as the converted folders hold them.
    """
    from transformers import JanusConfig, JanusForConditionalGeneration

    text: dict[str, Any] = dict(model_type="llama", vocab_size=TINY_JANUS_VOCAB, hidden_size=32,
                                intermediate_size=64, num_hidden_layers=num_layers, num_attention_heads=4,
                                num_key_value_heads=2, attention_bias=True, max_position_embeddings=512,
                                initializer_range=0.1, pad_token_id=1, bos_token_id=0, eos_token_id=2)
    text.update(text_overrides)
    config = JanusConfig(
        text_config=text,
        vision_config=dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, image_size=4 * grid,
                           patch_size=4, num_image_tokens=grid * grid, projection_dim=text["hidden_size"],
                           mlp_ratio=2),
        vq_config=dict(embed_dim=8, num_embeddings=num_codes, latent_channels=8, base_channels=32,
                       channel_multiplier=[1, 2], num_res_blocks=1, projection_dim=text["hidden_size"],
                       image_token_embed_dim=text["hidden_size"], initializer_range=0.1),
        image_token_id=JANUS_SPECIAL["<image_placeholder>"],
    )
    torch.manual_seed(seed)
    model = JanusForConditionalGeneration(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and "vqmodel" not in name:  # RMSNorm weights off their ones
                p.add_(torch.randn(p.shape, generator=gen) * 0.1)
            elif p.dim() == 2 and any(k in name for k in WIDER_INIT) and "embed" not in name:
                p.mul_(3.0)  # without it the last code alone decides the next: greedy images repeat one code
        head = model.model.generation_head.vision_head.weight
        head.copy_(torch.randn(head.shape, generator=gen) * logit_std)
        emb = model.model.generation_embeddings.weight
        emb.copy_(torch.randn(emb.shape, generator=gen))
    g = model.generation_config
    g.pad_token_id, g.bos_token_id, g.eos_token_id = 1, 0, 2
    g.guidance_scale, g.temperature = 3.0, 1.0
    # (GenerationConfig keeps any attribute it is given; its class declares no generation_kwargs)
    g.generation_kwargs = {"boi_token_id": JANUS_SPECIAL["<begin_of_image>"]}  # type: ignore[attr-defined]
    return model.eval()


def tiny_janus_tokenizer() -> Any:
    """A word-level tokenizer with DeepSeek's special tokens, BOS added as the real one does, and the
    image tokens transformers' ``JanusProcessor`` reads (``image_token``, ``boi_token``, ``eoi_token``)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast

    vocab = dict(JANUS_SPECIAL) | {w: len(JANUS_SPECIAL) + i for i, w in enumerate(JANUS_WORDS)}
    assert max(vocab.values()) < TINY_JANUS_VOCAB
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = Whitespace()
    tok.add_special_tokens(list(JANUS_SPECIAL))  # matched whole, before the words are split
    bos = "<｜begin▁of▁sentence｜>"
    tok.post_processor = TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, 0)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=bos, eos_token="<｜end▁of▁sentence｜>", pad_token="<｜▁pad▁｜>",
        unk_token="<unk>", extra_special_tokens={"image_token": "<image_placeholder>", "boi_token": "<begin_of_image>",
                              "eoi_token": "<end_of_image>"},
    )


def tiny_janus_processor(tokenizer: Any | None = None) -> Any:
    """transformers' own ``JanusProcessor`` (the PIL image processor: no torchvision needed) around
    the tiny tokenizer, with the released chat template: the reference for prompts and pixels."""
    from transformers import JanusProcessor
    from transformers.models.janus.image_processing_pil_janus import JanusImageProcessorPil

    # mean = std = 0.5, as the released preprocessor_config.json (SigLIP's), so postprocess maps [-1, 1] to pixels
    pixels = JanusImageProcessorPil(image_mean=[0.5] * 3, image_std=[0.5] * 3, size={"height": 16, "width": 16})
    return JanusProcessor(image_processor=pixels, tokenizer=tokenizer or tiny_janus_tokenizer(),
                          chat_template=JANUS_CHAT_TEMPLATE, use_default_system_prompt=True)


def make_tiny_janus_folder(out: str | os.PathLike[str], seed: int = 0, num_layers: int = 2, grid: int = 4,
                           logit_std: float = 0.05) -> Path:
    """A tiny random Janus folder laid out like a converted download (deepseek-community/Janus-Pro-*):
    ``save_pretrained`` of transformers' model (safetensors, config.json, generation_config.json) and
    of its processor (tokenizer, chat template, image processor), plus a proximity table built from
    the VQ codebook and a ``generation.json`` with small-model sampling defaults."""
    from lantern.models.janus import JanusLM
    from lantern.targets.proximity import build_proximity

    out = Path(out)
    hf = tiny_janus(seed=seed, num_layers=num_layers, grid=grid, logit_std=logit_std)
    hf.save_pretrained(out)
    tiny_janus_processor().save_pretrained(out)
    build_proximity(JanusLM(hf).codebook().detach(), k_max=15).save(out / "proximity.safetensors")
    write_json(out / "generation.json", {"temperature": 1.0, "top_k": 8, "cfg_scale": 3.0})
    return out


# ----------------------------------------------------------------------------------------------
# Emu3 (tests only; needs transformers)

# Emu3's special tokens (the converted tokenizer's names: BOS, EOS, pad, the image placeholder,
# image start / end, the size header's wrapper, end of frame, end of line), then the tiny words.
EMU3_SPECIAL = ("<|extra_203|>", "<|extra_204|>", "<|endoftext|>", "<image>", "<|image start|>", "<|image end|>",
                "<|image token|>", "<|extra_201|>", "<|extra_200|>")
EMU3_NEGATIVE_WORDS = ("lowres", "bad", "anatomy", "hands", "text", "error", "missing", "fingers", "extra", "digit",
                       "fewer", "digits", "cropped", "worst", "quality", "low", "normal", "jpeg", "artifacts",
                       "signature", "watermark", "username", "blurry")
EMU3_WORDS = (*JANUS_WORDS, "*", *"0123456789", *EMU3_NEGATIVE_WORDS)
TINY_EMU3_TEXT = 96  # text and special ids 0 .. 95; the visual tokens follow
TINY_EMU3_CODES = 32
TINY_EMU3_GRID = 4  # codes per side (image_size 32: Emu3Processor's 8 pixels per code)


def tiny_emu3_vocab(num_codes: int = TINY_EMU3_CODES, seed: int = 0) -> dict[str, int]:
    """The tiny tokenizer's vocabulary, which is also the config's ``vocabulary_map``: special tokens,
    words, digits, then ``<|visual token{c:06d}|>`` at id ``TINY_EMU3_TEXT + perm[c]`` for a seeded
    permutation (so a code / BPE mix-up shows)."""
    vocab = {t: i for i, t in enumerate(EMU3_SPECIAL)} | {"<unk>": len(EMU3_SPECIAL)}
    for w in EMU3_WORDS:
        vocab.setdefault(w, len(vocab))
    assert len(vocab) <= TINY_EMU3_TEXT
    perm = torch.randperm(num_codes, generator=torch.Generator().manual_seed(seed)).tolist()
    return vocab | {f"<|visual token{c:06d}|>": TINY_EMU3_TEXT + perm[c] for c in range(num_codes)}


def tiny_emu3(seed: int = 0, num_layers: int = 2, num_codes: int = TINY_EMU3_CODES, logit_std: float = 0.05,
              **text_overrides: Any) -> Any:
    """A small random transformers ``Emu3ForConditionalGeneration`` (eval mode, float32).

    GQA (2 key/value heads for 4 query heads) and Emu3's 9216 positions; norms moved off their initial
    values and the decoder widened so the context decides the next code; the LM head's scale
    (``logit_std``) keeps logits of a few units, where float32 rounding stays well under 1e-5. The
    VQ-VAE has Emu3's four levels (8 pixels per code, as Emu3Processor assumes), its temporal blocks
    and attention, at 32 channels. The generation config is the converted folders' (top-k 2048,
    sampling on, pad and EOS)."""
    from transformers import Emu3Config, Emu3ForConditionalGeneration

    vocab = tiny_emu3_vocab(num_codes, seed)
    text: dict[str, Any] = dict(vocab_size=TINY_EMU3_TEXT + num_codes, hidden_size=32, intermediate_size=64,
                                num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                                max_position_embeddings=9216, initializer_range=0.1,
                                pad_token_id=vocab["<|endoftext|>"], bos_token_id=vocab["<|extra_203|>"],
                                eos_token_id=vocab["<|extra_204|>"])
    text.update(text_overrides)
    config = Emu3Config(
        text_config=text,
        vq_config=dict(codebook_size=num_codes, embed_dim=4, latent_channels=4, base_channels=32,
                       channel_multiplier=[1, 1, 1, 1], num_res_blocks=1, attn_resolutions=[3], hidden_size=32,
                       num_attention_heads=1, temporal_downsample_factor=4),
        vocabulary_map=vocab,
    )
    torch.manual_seed(seed)
    model = Emu3ForConditionalGeneration(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and "vqmodel" not in name:  # RMSNorm weights off their ones
                p.add_(torch.randn(p.shape, generator=gen) * 0.1)
            elif p.dim() == 2 and "text_model.layers" in name:
                p.mul_(3.0)  # without it the last code alone decides the next: greedy images repeat one code
        model.lm_head.weight.copy_(torch.randn(model.lm_head.weight.shape, generator=gen) * logit_std)
        emb = model.model.text_model.embed_tokens.weight
        emb.copy_(torch.randn(emb.shape, generator=gen))
    g = model.generation_config
    g.do_sample, g.top_k = True, 2048
    g.pad_token_id, g.eos_token_id = text["pad_token_id"], text["eos_token_id"]
    return model.eval()


def tiny_emu3_tokenizer(num_codes: int = TINY_EMU3_CODES) -> Any:
    """A word-level tokenizer with Emu3's special tokens (digits split one by one, as in a size header
    ``12*12``), no BOS added (the processor writes it), left padding, and the token attributes
    transformers' ``Emu3Processor`` reads (``image_token``, ``boi_token``, ``eoi_token``,
    ``image_wrapper_token``, ``eof_token``), as the conversion script sets them."""
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = tiny_emu3_vocab(num_codes)
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace(),
                                                 pre_tokenizers.Digits(individual_digits=True)])
    tok.add_special_tokens([*EMU3_SPECIAL, *(t for t in vocab if t.startswith("<|visual token"))])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|extra_203|>", eos_token="<|extra_204|>", pad_token="<|endoftext|>",
        unk_token="<unk>", extra_special_tokens={"image_token": "<image>", "boi_token": "<|image start|>",
                                                 "eoi_token": "<|image end|>", "image_wrapper_token": "<|image token|>",
                                                 "eof_token": "<|extra_201|>"})
    tokenizer.padding_side = "left"
    return tokenizer


def tiny_emu3_processor(tokenizer: Any | None = None) -> Any:
    """transformers' own ``Emu3Processor`` around the tiny tokenizer (the image processor with
    mean = std = 0.5, as the released VisionTokenizer's): the reference for prompts and pixels."""
    from transformers import Emu3ImageProcessor, Emu3Processor

    pixels = Emu3ImageProcessor(image_mean=[0.5] * 3, image_std=[0.5] * 3)
    return Emu3Processor(image_processor=pixels, tokenizer=tokenizer or tiny_emu3_tokenizer())


def make_tiny_emu3_folder(out: str | os.PathLike[str], seed: int = 0, num_layers: int = 2,
                          grid: int = TINY_EMU3_GRID, logit_std: float = 0.05) -> Path:
    """A tiny random Emu3 folder laid out like a converted download (BAAI/Emu3-Gen-hf):
    ``save_pretrained`` of transformers' model (safetensors, config.json with the vocabulary map,
    generation_config.json) and of its processor (tokenizer, image processor), plus a proximity table
    built from the VQ codebook and a ``generation.json`` with the image size (``grid`` codes a side)
    and small-model sampling defaults."""
    from lantern.models.emu3 import PIXELS_PER_CODE
    from lantern.targets.proximity import build_proximity

    out = Path(out)
    hf = tiny_emu3(seed=seed, num_layers=num_layers, logit_std=logit_std)
    hf.save_pretrained(out)
    tiny_emu3_processor().save_pretrained(out)
    codebook = hf.model.vqmodel.quantize.embedding.weight.detach()
    build_proximity(codebook, k_max=15).save(out / "proximity.safetensors")
    write_json(out / "generation.json", {"image_size": grid * PIXELS_PER_CODE, "temperature": 1.0, "top_k": 8,
                                         "cfg_scale": 3.0})
    return out
