"""Janus / Janus-Pro targets against transformers' own image generation, on tiny random folders
built with transformers' classes and ``save_pretrained`` (``lantern.testing.make_tiny_janus_folder``).

The reference is ``JanusForConditionalGeneration.generate(generation_mode="image")`` on the
prompt ids of transformers' ``JanusProcessor`` (chat template, then ``generation_mode="image"``),
one prompt at a time; lantern decodes the prompts together, left-padded. Checked:

* the prompt ids equal the processor's;
* greedy codes with CFG on equal transformers' token for token, and the guided logits of the first
  8 steps agree within 1e-5 (float32);
* the decoded pixels equal the model's own VQ decoder's, and the PNG bytes transformers'
  postprocess;
* the methods without a drafter run; greedy SJD / coupled SJD / SJD-PAC / PJD at lossless settings
  give AR's codes; sampled rows do not depend on their batch;
* a folder that needs remote code (or is DeepSeek's original release, or holds only pickles) is
  refused with one line; drafter methods without a drafter are refused with one line.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import Tensor

pytest.importorskip("transformers")

from conftest import (  # noqa: E402
    OTHER_FAMILIES_OPTIONS,
    SAMPLED_METHODS,
    assert_greedy_method_reproduces_ar,
    assert_law,
    assert_left_padded,
    assert_load_refuses,
    assert_sampled_rows_do_not_depend_on_the_batch,
    copy_with_config,
    copy_with_pickles_only,
    dist_codes,
    guided_step_logits,
)

import lantern  # noqa: E402
from lantern.decoding.config import SamplingConfig  # noqa: E402
from lantern.errors import LanternError  # noqa: E402
from lantern.testing import make_tiny_janus_folder, tiny_janus_processor  # noqa: E402

PROMPTS = ["a red car", "a cat on the grass", "a photo of a mountain lake at dawn"]  # three lengths
CFG = 3.0
STEPS = 8  # logits compared at the first 8 codes


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_janus_folder(tmp_path_factory.mktemp("janus") / "model")


@pytest.fixture(scope="module")
def pipe(folder: Path) -> lantern.Pipeline:
    return lantern.load(folder)


def _reference_model(folder: Path) -> Any:
    from transformers import JanusForConditionalGeneration

    model = JanusForConditionalGeneration.from_pretrained(str(folder), dtype=torch.float32).eval()
    # generation_config.json holds generation_kwargs.boi_token_id, but GenerationConfig does not
    # keep that key when it loads; transformers' image generate reads it from there
    saved = json.loads((folder / "generation_config.json").read_text())
    model.generation_config.generation_kwargs = saved["generation_kwargs"]
    return model


def _processor_inputs(prompt: str) -> dict[str, Tensor]:
    processor = tiny_janus_processor()
    messages = [{"role": "user", "content": [{"type": "text", "text": prompt}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    return dict(processor(text=[text], generation_mode="image", return_tensors="pt"))


@torch.no_grad()
def _transformers_generate(model: Any, prompt: str) -> tuple[Tensor, list[Tensor]]:
    """transformers' greedy image generation of one prompt: codes [N] and the guided logits [V] of
    every step (the generation head's [cond; uncond] output, guided by transformers' own CFG
    processor, as its loop does)."""
    from transformers.generation.logits_process import ClassifierFreeGuidanceLogitsProcessor

    raw: list[Tensor] = []
    hook = model.model.generation_head.register_forward_hook(lambda m, i, out: raw.append(out.detach().clone()))
    try:
        codes = model.generate(**_processor_inputs(prompt), generation_mode="image", do_sample=False,
                               guidance_scale=CFG)
    finally:
        hook.remove()
    guide = ClassifierFreeGuidanceLogitsProcessor(CFG)
    cond_rows = torch.zeros(1, 1, dtype=torch.long)  # the processor reads only their count
    return codes[0], [guide(cond_rows, r)[0] for r in raw]


@cache
def _reference(folder: Path) -> list[tuple[Tensor, list[Tensor]]]:
    model = _reference_model(folder)
    return [_transformers_generate(model, p) for p in PROMPTS]


def test_prompt_ids_equal_the_processors(pipe: lantern.Pipeline) -> None:
    """Chat template, BOS and image-start token exactly as transformers' JanusProcessor writes them;
    the batch is left-padded with the prompt at the end."""
    stack = pipe.stack
    ids = stack.tokenize(PROMPTS)
    for prompt, own in zip(PROMPTS, ids, strict=True):
        assert own == _processor_inputs(prompt)["input_ids"][0].tolist()
    assert_left_padded(stack.encode(PROMPTS), ids)


def test_guidance_rows_are_the_prompt_with_pad_tokens(pipe: lantern.Pipeline) -> None:
    """As transformers' generate: every token but BOS and image-start becomes pad; same mask."""
    stack = pipe.stack
    encoded = stack.encode(PROMPTS[:2])
    target = stack.make_target(SamplingConfig(temperature=0.0, top_k=0, cfg_scale=CFG))
    u_ids, u_mask = target.guidance_rows(encoded.cond, encoded.mask)
    assert torch.equal(u_mask, encoded.mask)
    t = stack.tokens
    for row in range(2):
        real = encoded.cond[row][encoded.mask[row]].tolist()
        want = [i if i in (t.bos, t.boi) else t.pad for i in real]
        assert u_ids[row][encoded.mask[row]].tolist() == want and want[0] == t.bos and want[-1] == t.boi


def test_greedy_codes_and_logits_equal_transformers(folder: Path, pipe: lantern.Pipeline) -> None:
    """Greedy AR with CFG on, three prompts of different lengths decoded together (left padding):
    every code equals transformers' per-prompt generation, and the guided logits of the first 8
    steps agree within 1e-5 in float32 (fed transformers' own codes)."""
    reference = _reference(folder)
    out = pipe(prompts=PROMPTS, method="ar", temperature=0.0, cfg_scale=CFG)
    for row, (codes, _) in enumerate(reference):
        assert out.codes[row].tolist() == codes.tolist(), row
    assert len({c for codes, _ in reference for c in codes.tolist()}) > 8  # varied codes: the test has power
    # the logits, step by step through the target adapter
    fed = torch.stack([codes for codes, _ in reference])
    for step, logits in enumerate(guided_step_logits(pipe.stack, PROMPTS, fed, STEPS, CFG)):
        for row, (_, ref_logits) in enumerate(reference):
            torch.testing.assert_close(logits[row], ref_logits[step], atol=1e-5, rtol=0)


def test_decoded_pixels_equal_the_vq_decoder(folder: Path, pipe: lantern.Pipeline) -> None:
    """``decode`` is the model's own VQ decoder (bit for bit), and the images are the bytes of
    transformers' ``decode_image_tokens`` + ``JanusProcessor.postprocess``."""
    model = _reference_model(folder)
    codes = torch.stack([c for c, _ in _reference(folder)])
    with torch.no_grad():
        reference = model.decode_image_tokens(codes)  # [N, H, W, 3]
    assert torch.equal(pipe.stack.decode(codes).permute(0, 2, 3, 1), reference)
    # channels first: the PIL image processor's normalize assumes them (the torchvision one, which
    # transformers' docs feed [H, W, 3], is not installed here)
    chw = list(reference.permute(0, 3, 1, 2).float())
    pixels = tiny_janus_processor().postprocess(chw, return_tensors="PIL.Image.Image")
    ours = pipe.stack.to_pil(codes)
    assert ours[0].size == (8, 8)  # 4 x 4 codes, the VQ decoder upsamples twice
    for a, b in zip(ours, pixels["pixel_values"], strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))


LOSSLESS = {"sjd": {"sjd_window": 4}, "sjd-coupled": {"sjd_window": 4}, "sjd-pac": {"sjd_window": 4},
            "pjd": {"pjd_window": 2, "pjd_context": 4}}  # pjd: context = the row length


@pytest.mark.parametrize("method", list(LOSSLESS))
def test_greedy_lossless_methods_reproduce_ar(pipe: lantern.Pipeline, method: str) -> None:
    assert_greedy_method_reproduces_ar(pipe, PROMPTS, method, LOSSLESS[method])


@pytest.mark.parametrize("method,settings", SAMPLED_METHODS)
def test_sampled_methods_run_and_rows_do_not_depend_on_the_batch(pipe: lantern.Pipeline, method: str,
                                                                 settings: dict[str, Any]) -> None:
    """Every method without a drafter runs sampled (the relaxed row with the folder's proximity
    table); a row's codes are the same alone and in a batch of three (other prompt lengths)."""
    assert_sampled_rows_do_not_depend_on_the_batch(pipe, PROMPTS, method, settings, num_codes=16)


def test_drafter_methods_without_a_drafter_are_refused(pipe: lantern.Pipeline) -> None:
    """(Drafters trained for Janus models: tests/test_janus_drafter.py.)"""
    with pytest.raises(LanternError, match="^method lantern\\+\\+ needs a drafter: pass drafter=DIR"):
        pipe(prompts=PROMPTS[:1], method="lantern++")


def test_folders_that_need_code_or_pickles_are_refused(folder: Path, tmp_path: Path) -> None:
    """auto_map (trust_remote_code), DeepSeek's original release and pickled-only weights: one line
    each, before any weight or tokenizer is read."""
    remote = copy_with_config(folder, tmp_path / "remote", auto_map={"AutoModel": "modeling_janus_x.JanusX"})
    with pytest.raises(LanternError, match="auto_map") as e:
        lantern.load(remote)
    assert "\n" not in str(e.value)
    original = copy_with_config(folder, tmp_path / "original", model_type="multi_modality")
    with pytest.raises(LanternError, match="DeepSeek's original Janus release"):
        lantern.load(original)
    pickles = copy_with_pickles_only(folder, tmp_path / "pickles")
    with pytest.raises(LanternError, match="safetensors only"):
        lantern.load(pickles)


def test_flags_of_other_families_are_refused(folder: Path) -> None:
    assert_load_refuses(folder, OTHER_FAMILIES_OPTIONS)


def test_labels_are_refused(pipe: lantern.Pipeline) -> None:
    with pytest.raises(LanternError, match="text-to-image"):
        pipe(labels=[1])


def test_sampling_defaults_come_from_the_folder(pipe: lantern.Pipeline) -> None:
    """generation.json (top_k 8, cfg 3) over generation_config.json (guidance 3, temperature 1)
    over DeepSeek's defaults (cfg 5, no top-k)."""
    assert pipe.stack.default_sampling() == {"temperature": 1.0, "top_k": 8, "top_p": 1.0, "cfg_scale": 3.0}
    assert pipe.stack.model_shape()["family"] == "janus"


@pytest.mark.parametrize("rule", ["chameleon's guidance context", "the prompt itself", "BOS padded too"])
def test_the_golden_test_has_power(folder: Path, pipe: lantern.Pipeline, rule: str,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Other guidance rows give other greedy codes than transformers' (so the equality above is
    a real check of the rows transformers builds)."""
    from lantern.targets.chameleon import ChameleonTarget
    from lantern.targets.janus import JanusTarget

    def only_boi(self: JanusTarget, cond: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        return torch.where(mask & (cond == self.tokens.boi), cond, torch.full_like(cond, self.tokens.pad)), mask

    wrong = {"chameleon's guidance context": ChameleonTarget.guidance_rows,
             "the prompt itself": lambda self, cond, mask: (cond, mask), "BOS padded too": only_boi}[rule]
    monkeypatch.setattr(JanusTarget, "guidance_rows", wrong)
    out = pipe(prompts=PROMPTS, method="ar", temperature=0.0, cfg_scale=CFG)
    assert all(out.codes[row].tolist() != codes.tolist() for row, (codes, _) in enumerate(_reference(folder)))


# -- slow tier: a larger model; the law of the lossless methods ------------------------------------


# slow (~5 s): the slow tier, a second, larger folder (4 layers, 6 x 6 codes) built and generated twice
@pytest.mark.slow
def test_larger_model_equals_transformers(tmp_path: Path) -> None:
    """The golden equality on a 4-layer model with 6 x 6 codes (36 steps; prompts of three lengths
    decoded together): codes, the first 8 steps' logits, pixels, and greedy PJD at context = row.
    Its head is scaled to logits of a few units as in the 2-layer model (the deeper widened
    stack doubles them), where float32 rounding stays under 1e-5."""
    folder = make_tiny_janus_folder(tmp_path / "model", seed=1, num_layers=4, grid=6, logit_std=0.025)
    model, pipe = _reference_model(folder), lantern.load(folder)
    reference = [_transformers_generate(model, p) for p in PROMPTS]
    out = pipe(prompts=PROMPTS, method="ar", temperature=0.0, cfg_scale=CFG)
    for row, (codes, _) in enumerate(reference):
        assert out.codes[row].tolist() == codes.tolist(), row
    codes = torch.stack([c for c, _ in reference])
    for step, logits in enumerate(guided_step_logits(pipe.stack, PROMPTS, codes, STEPS, CFG)):
        for row, (_, ref_logits) in enumerate(reference):
            torch.testing.assert_close(logits[row], ref_logits[step], atol=1e-5, rtol=0)
    with torch.no_grad():
        assert torch.equal(pipe.stack.decode(codes).permute(0, 2, 3, 1), model.decode_image_tokens(codes))
    greedy_pjd = pipe(prompts=PROMPTS, method="pjd", temperature=0.0, cfg_scale=CFG, pjd_window=3, pjd_context=6)
    assert torch.equal(greedy_pjd.codes, out.codes)


DIST_ROWS = 4000
DIST_TOKENS = 3  # codes 0..2: 4^3 = 64 cells under top-k 4
DIST = {"temperature": 1.0, "top_k": 4, "cfg_scale": 2.0}
DIST_METHODS = {"ar": {}, "sjd-coupled": {"sjd_window": 3, "sjd_init": "random"}, "sjd-pac": {"sjd_window": 3},
                "pjd": {"pjd_window": 2, "pjd_context": 4}}  # pjd at context = row: lossless


@torch.no_grad()
def _exact_joint(folder: Path, cfg_scale: float) -> Tensor:
    """The law of codes 0..2 [32^3], from transformers' modules by full recomputation: the prompt's
    text embeddings, each code through the generation embedding and aligner, the Llama decoder
    uncached, the generation head, guidance with transformers' CFG processor, then top-k 4."""
    from transformers.generation.logits_process import ClassifierFreeGuidanceLogitsProcessor

    from lantern.decoding.sampling import probs_from_logits

    model = _reference_model(folder)
    ids = _processor_inputs(PROMPTS[0])["input_ids"]
    bos, boi, pad = 0, 5, 1
    uncond = torch.where((ids == bos) | (ids == boi), ids, pad)
    prompt = model.get_input_embeddings()(torch.cat([ids, uncond]))  # [2, L, D]
    sampling = SamplingConfig(**{**DIST, "cfg_scale": cfg_scale})
    guide = ClassifierFreeGuidanceLogitsProcessor(cfg_scale)
    v = model.config.vq_config.num_embeddings

    def probs(prefix: list[int]) -> Tensor:
        x = prompt
        if prefix:
            codes = torch.tensor([prefix, prefix])
            x = torch.cat([prompt, model.prepare_embeddings_for_image_generation(codes)], dim=1)
        hidden = model.model.language_model(inputs_embeds=x, use_cache=False).last_hidden_state[:, -1]
        guided = guide(torch.zeros(1, 1, dtype=torch.long), model.model.generation_head(hidden))
        return probs_from_logits(guided, sampling)[0].double()

    joint = torch.zeros(v**DIST_TOKENS, dtype=torch.float64)
    p0 = probs([])
    for a in p0.nonzero().flatten().tolist():
        p1 = probs([a])
        for b in p1.nonzero().flatten().tolist():
            p2 = probs([a, b])
            joint[(a * v + b) * v : (a * v + b + 1) * v] = p0[a] * p1[b] * p2
    return joint


@cache
def _dist_codes(folder: Path, method: str) -> Tensor:
    return dist_codes(folder, PROMPTS[0], method, {**DIST, **DIST_METHODS[method]}, DIST_ROWS, slice(0, DIST_TOKENS))


# slow (~25 s for the four methods): 4000 images per method, a chi-square run like the other families'
@pytest.mark.slow
@pytest.mark.parametrize("method", list(DIST_METHODS))
def test_lossless_methods_keep_the_models_law(folder: Path, method: str) -> None:
    """Chi-square goodness of fit of codes 0..2 against the exact joint from transformers' modules,
    at significance 0.001 (fixed seeds: deterministic)."""
    assert_law(_dist_codes(folder, method), _exact_joint(folder, DIST["cfg_scale"]), min_df=30)


# slow: reuses the sjd-coupled run above (4000 images)
@pytest.mark.slow
def test_the_law_test_has_power(folder: Path) -> None:
    """The same samples are rejected against another guidance scale (2.5 instead of 2)."""
    from lantern.testing import chi_square_pooled, chi_square_threshold

    stat, df = chi_square_pooled(_dist_codes(folder, "sjd-coupled"), _exact_joint(folder, 2.5), 32)
    assert stat > chi_square_threshold(df)
