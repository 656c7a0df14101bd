"""Emu3 targets against transformers' own image generation, on tiny random folders built with
transformers' classes and ``save_pretrained`` (``lantern.testing.make_tiny_emu3_folder``).

The reference is ``Emu3ForConditionalGeneration.generate`` as transformers' Emu3 docs run it: the
prompt ids of ``Emu3Processor(text=..., return_for_image_generation=True)``, the negative prompt's
ids as ``negative_prompt_ids`` with a guidance scale, and the docs' ``prefix_allowed_tokens_fn``
(visual tokens in a row, the end-of-line token after each row, then end-of-frame, end-of-image,
end-of-sequence), one prompt at a time; lantern decodes the prompts together, left-padded. Checked:

* the prompt ids and the negative prompt's equal the processor's;
* greedy codes with CFG on equal transformers' token for token, and the guided logits of the first
  8 codes (two rows: across an end-of-line token) agree within 1e-5 (float32);
* the decoded pixels equal transformers' ``decode_image_tokens``, the PNG bytes its postprocess;
* the methods without a drafter run; greedy SJD / coupled SJD / SJD-PAC / PJD at lossless settings
  give AR's codes; sampled rows do not depend on their batch;
* a folder that needs remote code or holds only pickles is refused with one line; drafter methods
  without a drafter are refused with one line.
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
from lantern.targets.emu3 import NEGATIVE_PROMPT  # noqa: E402
from lantern.testing import TINY_EMU3_GRID, make_tiny_emu3_folder, tiny_emu3_processor  # noqa: E402

PROMPTS = ["a red car", "a cat on the grass", "a photo of a mountain lake at dawn"]  # three lengths
CFG = 3.0
STEPS = 8  # logits compared at the first 8 codes: two rows of 4, across an end-of-line token
G = TINY_EMU3_GRID


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_emu3_folder(tmp_path_factory.mktemp("emu3") / "model")


@pytest.fixture(scope="module")
def pipe(folder: Path) -> lantern.Pipeline:
    return lantern.load(folder)


def _reference_model(folder: Path) -> Any:
    from transformers import Emu3ForConditionalGeneration

    return Emu3ForConditionalGeneration.from_pretrained(str(folder), dtype=torch.float32).eval()


def _shape(grid: int | tuple[int, int]) -> tuple[int, int]:
    """(rows, codes per row) of a square side or a (rows, codes per row) grid."""
    return (grid, grid) if isinstance(grid, int) else grid


def _processor_inputs(prompt: str, grid: int | tuple[int, int] = G) -> dict[str, Tensor]:
    """Emu3Processor's image prompt for ``grid``: a square at its side's area, or another grid as
    its ratio W:H at an area of 8 x 8 pixels per code, which calculate_generate_size gives back exactly."""
    rows, columns = _shape(grid)
    out = tiny_emu3_processor()(text=[prompt], return_for_image_generation=True, ratio=f"{columns}:{rows}",
                                image_area=64 * rows * columns, return_tensors="pt")
    assert out.pop("image_sizes") == [[rows, columns]]
    return dict(out)


def _negative_inputs(header: bool = False, text: str = NEGATIVE_PROMPT) -> dict[str, Tensor]:
    if header:  # BAAI's image_generation.py: the negative prompt written like the prompt
        return _processor_inputs(text)
    return dict(tiny_emu3_processor()(text=[text], return_tensors="pt"))


def _allowed_tokens(model: Any, grid: int | tuple[int, int]) -> Any:
    """transformers' Emu3 docs' prefix_allowed_tokens_fn: visual tokens, the end-of-line token after
    each row, then end-of-frame, end-of-image, end-of-sequence and padding."""
    tok = tiny_emu3_processor().tokenizer
    visual, eol = model.vocabulary_mapping.image_tokens, model.vocabulary_mapping.eol_token_id
    rows, columns = _shape(grid)
    end = (columns + 1) * rows

    def allowed(batch_id: int, input_ids: Tensor) -> Any:
        offset = input_ids.shape[0] - int(torch.nonzero(input_ids == tok.image_wrapper_token_id)[0, 0])
        if offset % (columns + 1) == 0:
            return (eol,)
        forced = {end + 1: tok.eof_token_id, end + 2: tok.eoi_token_id, end + 3: tok.eos_token_id}
        return (forced.get(offset, tok.pad_token_id),) if offset > end else visual

    return allowed


@torch.no_grad()
def _transformers_generate(model: Any, prompt: str, grid: int | tuple[int, int] = G, header: bool = False,
                           negative: str = NEGATIVE_PROMPT) -> tuple[Tensor, list[Tensor], Tensor]:
    """transformers' greedy image generation of one prompt with CFG: codes [rows x codes per row], the guided
    scores of every code step at the visual tokens (in code order; what its processors hand the
    sampler), and the generated BPE sequence (row tokens and the closing tokens included)."""
    from transformers import LogitsProcessor, LogitsProcessorList

    scores: list[Tensor] = []

    class Record(LogitsProcessor):  # appended after transformers' own: sees the guided, constrained scores
        def __call__(self, input_ids: Tensor, s: Tensor) -> Tensor:
            scores.append(s[0].clone())
            return s

    rows, columns = _shape(grid)
    end = (columns + 1) * rows
    inputs, uncond = _processor_inputs(prompt, grid), _negative_inputs(header, negative)
    out = model.generate(**inputs, prefix_allowed_tokens_fn=_allowed_tokens(model, grid), do_sample=False,
                         guidance_scale=CFG, negative_prompt_ids=uncond["input_ids"],
                         negative_prompt_attention_mask=uncond["attention_mask"],
                         max_new_tokens=end + 3, logits_processor=LogitsProcessorList([Record()]))
    sequence = out[0, inputs["input_ids"].shape[1]:]
    codes = model.vocabulary_mapping.convert_bpe2img(sequence[:end].view(rows, columns + 1)).flatten()
    ids = torch.tensor([model.vocabulary_mapping.img2bpe[c] for c in range(len(model.vocabulary_mapping.img2bpe))])
    code_steps = [s[ids] for i, s in enumerate(scores) if (i + 1) % (columns + 1) != 0 and i < end]
    return codes.long(), code_steps, sequence


@cache
def _reference(folder: Path) -> list[tuple[Tensor, list[Tensor], Tensor]]:
    model = _reference_model(folder)
    return [_transformers_generate(model, p) for p in PROMPTS]


def test_prompt_ids_equal_the_processors(pipe: lantern.Pipeline) -> None:
    """BOS, prompt and size header exactly as transformers' Emu3Processor writes them for image
    generation; the negative prompt as it writes plain text; the batch is left-padded."""
    stack = pipe.stack
    ids = stack.tokenize(PROMPTS)
    for prompt, own in zip(PROMPTS, ids, strict=True):
        assert own == _processor_inputs(prompt)["input_ids"][0].tolist()
    assert list(stack.negative_ids) == _negative_inputs()["input_ids"][0].tolist()
    assert_left_padded(stack.encode(PROMPTS), ids)


def test_guidance_rows_are_the_negative_prompt(pipe: lantern.Pipeline) -> None:
    """The negative prompt (longer than these prompts) in every guidance row, left-padded; the
    prompts and the negative prompt are widened to the prompt width with masked columns."""
    stack = pipe.stack
    encoded = stack.encode(PROMPTS[:2])
    negative = list(stack.negative_ids)
    assert encoded.cond.shape[1] < len(negative) < stack.prompt_width
    target = stack.make_target(SamplingConfig(temperature=0.0, top_k=0, cfg_scale=CFG))
    target.start(encoded.cond, encoded.mask)
    assert target.key_mask is not None and target.key_mask.shape == (4, stack.prompt_width)
    for row in range(2):
        assert target.key_mask[row].sum() == encoded.mask[row].sum()  # no real column added
        assert target.key_mask[2 + row].tolist() == [False] * (stack.prompt_width - len(negative)) + [True] * len(
            negative)  # the negative, right-aligned
    u_ids, u_mask = target.guidance_rows(torch.zeros(1, len(negative) + 2, dtype=torch.long),
                                         torch.ones(1, len(negative) + 2, dtype=torch.bool))
    assert u_ids[0, 2:].tolist() == negative and u_mask[0].tolist() == [False] * 2 + [True] * len(negative)


def _step_logits(pipe: lantern.Pipeline, reference: list[tuple[Tensor, list[Tensor], Tensor]]) -> list[Tensor]:
    """lantern's guided logits [3, V] of the first STEPS codes, fed transformers' codes."""
    return guided_step_logits(pipe.stack, PROMPTS, torch.stack([codes for codes, _, _ in reference]), STEPS, CFG)


def test_greedy_codes_and_logits_equal_transformers(folder: Path, pipe: lantern.Pipeline) -> None:
    """Greedy AR with CFG on, three prompts of different lengths decoded together (left padding):
    every code equals transformers' per-prompt generation, whose sequence has the end-of-line token
    after every row and then end-of-frame, end-of-image and EOS; the guided logits of the first 8
    codes agree within 1e-5 in float32 (fed transformers' own codes)."""
    reference = _reference(folder)
    out = pipe(prompts=PROMPTS, method="ar", temperature=0.0, cfg_scale=CFG)
    eol = pipe.stack.layout.eol
    tok = tiny_emu3_processor().tokenizer
    for row, (codes, _, sequence) in enumerate(reference):
        assert out.codes[row].tolist() == codes.tolist(), row
        assert sequence.view(-1)[G :: G + 1][:G].tolist() == [eol] * G
        assert sequence[-3:].tolist() == [tok.eof_token_id, tok.eoi_token_id, tok.eos_token_id]
    assert len({c for codes, _, _ in reference for c in codes.tolist()}) > 8  # varied codes: the test has power
    for step, logits in enumerate(_step_logits(pipe, reference)):
        for row, (_, ref_logits, _) in enumerate(reference):
            torch.testing.assert_close(logits[row], ref_logits[step], atol=1e-5, rtol=0)


def test_the_logit_comparison_has_power(folder: Path, pipe: lantern.Pipeline,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Guiding the raw code logits instead of the full-vocabulary log-softmax gives the same greedy
    codes (a constant per row apart) but logits the 1e-5 comparison rejects."""
    from lantern.targets.chameleon import ChameleonTarget
    from lantern.targets.emu3 import Emu3Target

    reference = _reference(folder)
    monkeypatch.setattr(Emu3Target, "guided_logits", ChameleonTarget.guided_logits)
    out = pipe(prompts=PROMPTS, method="ar", temperature=0.0, cfg_scale=CFG)
    assert all(out.codes[row].tolist() == codes.tolist() for row, (codes, _, _) in enumerate(reference))
    first = _step_logits(pipe, reference)[0]
    assert float((first[0] - reference[0][1][0]).abs().max()) > 1e-2


def test_the_negative_image_header_variant_equals_transformers(folder: Path, tmp_path: Path) -> None:
    """``negative_image_header: true`` in generation.json writes the negative like the prompt (BAAI's
    own script): the codes equal transformers' generation fed those negative ids."""
    variant = copy_with_config(folder, tmp_path / "variant")
    (variant / "generation.json").unlink()
    settings = json.loads((folder / "generation.json").read_text()) | {"negative_image_header": True}
    (variant / "generation.json").write_text(json.dumps(settings))
    pipe = lantern.load(variant)
    assert list(pipe.stack.negative_ids) == _negative_inputs(header=True)["input_ids"][0].tolist()
    codes, _, _ = _transformers_generate(_reference_model(folder), PROMPTS[1], header=True)
    assert pipe(prompts=PROMPTS[1:2], method="ar", temperature=0.0, cfg_scale=CFG).codes[0].tolist() == codes.tolist()
    assert codes.tolist() != _reference(folder)[1][0].tolist()


NEGATIVES = ["blurry, dark", "", "a photo of a dog, low quality, jpeg artifacts"]  # three lengths, one empty


def test_a_negative_prompt_per_row_equals_transformers(folder: Path, pipe: lantern.Pipeline) -> None:
    """``negative_prompt=`` a list: each prompt's own guidance rows. Decoded together (prompts and
    negatives of different lengths, left-padded), each row's greedy codes with CFG equal
    transformers' generation fed that negative's ids (``negative_prompt_ids`` of
    ``processor(text=[negative])``), and the guided logits of the first 8 codes agree within 1e-5.
    Power: every row's codes differ from those of the folder's negative prompt."""
    model = _reference_model(folder)
    reference = [_transformers_generate(model, p, negative=n) for p, n in zip(PROMPTS, NEGATIVES, strict=True)]
    out = pipe(prompts=PROMPTS, negative_prompt=NEGATIVES, method="ar", temperature=0.0, cfg_scale=CFG)
    default = _reference(folder)
    for row, (codes, _, _) in enumerate(reference):
        assert out.codes[row].tolist() == codes.tolist(), row
        assert codes.tolist() != default[row][0].tolist(), row
    codes = torch.stack([c for c, _, _ in reference])
    for step, logits in enumerate(guided_step_logits(pipe.stack, PROMPTS, codes, STEPS, CFG, NEGATIVES)):
        for row, (_, ref_logits, _) in enumerate(reference):
            torch.testing.assert_close(logits[row], ref_logits[step], atol=1e-5, rtol=0)
    assert out.settings["negative_prompt"] == NEGATIVES and out.config["negative_prompt"] == NEGATIVES
    assert torch.equal(pipe(prompts=PROMPTS, **out.settings).codes, out.codes)  # the settings replay it


def test_a_negative_prompt_with_the_image_header_equals_transformers(folder: Path, tmp_path: Path) -> None:
    """With ``negative_image_header: true`` a call's negative prompt is written like the prompt too
    (BAAI's script's format): the codes equal transformers fed those ids."""
    variant = copy_with_config(folder, tmp_path / "variant")
    (variant / "generation.json").unlink()  # a link to the folder's
    settings = json.loads((folder / "generation.json").read_text()) | {"negative_image_header": True}
    (variant / "generation.json").write_text(json.dumps(settings))
    pipe = lantern.load(variant)
    codes, _, _ = _transformers_generate(_reference_model(folder), PROMPTS[0], header=True, negative=NEGATIVES[0])
    out = pipe(prompts=PROMPTS[:1], negative_prompt=NEGATIVES[0], method="ar", temperature=0.0, cfg_scale=CFG)
    assert out.codes[0].tolist() == codes.tolist()
    assert codes.tolist() != _transformers_generate(_reference_model(folder), PROMPTS[0], negative=NEGATIVES[0])[
        0].tolist()


def test_decoded_pixels_equal_the_vq_decoder(folder: Path, pipe: lantern.Pipeline) -> None:
    """``decode`` is transformers' ``decode_image_tokens`` of the generated sequence (bit for bit),
    and the images are the bytes of the processor's postprocess."""
    model = _reference_model(folder)
    reference = _reference(folder)
    codes = torch.stack([c for c, _, _ in reference])
    with torch.no_grad():
        pixels = model.decode_image_tokens(image_tokens=torch.stack([s for _, _, s in reference]), height=G, width=G)
    assert torch.equal(pipe.stack.decode(codes), pixels)
    expected = tiny_emu3_processor().postprocess(list(pixels.float()), return_tensors="PIL.Image.Image")
    ours = pipe.stack.to_pil(codes)
    assert ours[0].size == (8 * G, 8 * G)
    for a, b in zip(ours, expected["pixel_values"], strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow
def test_larger_model_equals_transformers(tmp_path: Path) -> None:
    """The golden equality on a 4-layer model with 6 x 6 codes (42 steps with the row ends; prompts
    of three lengths decoded together): codes, the first 8 codes' guided logits, pixels, and greedy
    PJD at context = row. Its head is scaled down as the deeper stack's logits grow, so float32
    rounding stays under 1e-5."""
    grid = 6
    folder = make_tiny_emu3_folder(tmp_path / "model", seed=1, num_layers=4, grid=grid, logit_std=0.025)
    pipe = lantern.load(folder)
    out = _assert_equals_transformers(pipe, _reference_model(folder), (grid, grid), min_codes=8)
    greedy_pjd = pipe(prompts=PROMPTS, method="pjd", temperature=0.0, cfg_scale=CFG, pjd_window=3, pjd_context=grid)
    assert torch.equal(greedy_pjd.codes, out.codes)


def _assert_equals_transformers(pipe: lantern.Pipeline, model: Any, grid: tuple[int, int], min_codes: int) -> Any:
    """Greedy AR with CFG of PROMPTS (three lengths, decoded together) against transformers' per-prompt
    generation of ``grid`` = (rows, codes per row): codes, the first STEPS codes' guided logits
    (within 1e-5, fed transformers' codes), decoded pixels and the PNG size. Returns the output."""
    rows, columns = grid
    reference = [_transformers_generate(model, p, grid) for p in PROMPTS]
    out = pipe(prompts=PROMPTS, method="ar", temperature=0.0, cfg_scale=CFG)
    for row, (codes, _, _) in enumerate(reference):
        assert out.codes[row].tolist() == codes.tolist(), row
    codes = torch.stack([c for c, _, _ in reference])
    assert len(set(codes.flatten().tolist())) > min_codes  # varied codes: the equality has power
    for step, logits in enumerate(guided_step_logits(pipe.stack, PROMPTS, codes, STEPS, CFG)):
        for row, (_, ref_logits, _) in enumerate(reference):
            torch.testing.assert_close(logits[row], ref_logits[step], atol=1e-5, rtol=0)
    with torch.no_grad():
        pixels = model.decode_image_tokens(image_tokens=torch.stack([s for _, _, s in reference]), height=rows,
                                           width=columns)
    assert torch.equal(pipe.stack.decode(codes), pixels)
    assert pipe.stack.to_pil(codes[:1])[0].size == (8 * columns, 8 * rows)  # PIL: (width, height)
    return out


@pytest.mark.parametrize("grid", [(3, 6), (6, 3)])
def test_a_wide_or_tall_image_equals_transformers_at_its_ratio(folder: Path, grid: tuple[int, int]) -> None:
    """``image_size`` (the height) with ``image_width``: the prompt is Emu3Processor's for that ratio
    (W:H, its size header H*W), and greedy codes with CFG, the guided logits, the decoded pixels and
    the PNG size equal transformers' generation of that grid (end-of-line token after every row of W);
    lossless methods whose windows cross the row ends (SJD, PJD at context = row) give AR's codes."""
    rows, columns = grid
    pipe = lantern.load(folder, image_size=8 * rows, image_width=8 * columns)
    assert (pipe.stack.layout.height, pipe.stack.layout.width) == grid
    for prompt in PROMPTS:
        assert pipe.stack.tokenize([prompt])[0] == _processor_inputs(prompt, grid)["input_ids"][0].tolist()
    out = _assert_equals_transformers(pipe, _reference_model(folder), grid, min_codes=6)
    for method, settings in (("sjd-coupled", {"sjd_window": 4}), ("pjd", {"pjd_window": 2, "pjd_context": columns})):
        same = pipe(prompts=PROMPTS, method=method, temperature=0.0, cfg_scale=CFG, **settings)
        assert torch.equal(same.codes, out.codes), method


def test_a_square_grid_is_not_the_wide_ones(folder: Path) -> None:
    """Power for the test above: the wide grid's prompt, codes and pixels are not the square's
    (a stack that ignored ``image_width`` would fail it there)."""
    wide, square = lantern.load(folder, image_size=24, image_width=48), lantern.load(folder, image_size=24)
    assert wide.stack.tokenize(PROMPTS[:1]) != square.stack.tokenize(PROMPTS[:1])
    assert wide.stack.num_tokens == 18 and square.stack.num_tokens == 9


LOSSLESS = {"sjd": {"sjd_window": 6}, "sjd-coupled": {"sjd_window": 6}, "sjd-pac": {"sjd_window": 6},
            "pjd": {"pjd_window": 2, "pjd_context": G}}  # pjd: context = the row length


@pytest.mark.parametrize("method", list(LOSSLESS))
def test_greedy_lossless_methods_reproduce_ar(pipe: lantern.Pipeline, method: str) -> None:
    """Windows of 6 cross the end of a row (its new-line token inserted in the tree); PJD opens each
    row after the row above ends (its new-line shadow committed with the row's last code)."""
    assert_greedy_method_reproduces_ar(pipe, PROMPTS, method, LOSSLESS[method])


def test_pjd_reads_the_rows_end_from_the_layout(folder: Path, pipe: lantern.Pipeline,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Power for the equalities above: without the end-of-line tokens (a layout without ``eol``),
    greedy AR and PJD no longer give transformers' codes."""
    from dataclasses import replace

    stack = pipe.stack
    monkeypatch.setattr(stack, "layout", replace(stack.layout, eol=None))
    reference = _reference(folder)
    for method in ("ar", "pjd"):
        out = pipe(prompts=PROMPTS, method=method, temperature=0.0, cfg_scale=CFG, **LOSSLESS.get(method, {}))
        assert any(out.codes[row].tolist() != codes.tolist() for row, (codes, _, _) in enumerate(reference))


@pytest.mark.parametrize("method,settings", SAMPLED_METHODS)
def test_sampled_methods_run_and_rows_do_not_depend_on_the_batch(pipe: lantern.Pipeline, method: str,
                                                                 settings: dict[str, Any]) -> None:
    """Every method without a drafter runs sampled (the relaxed row with the folder's proximity
    table); a row's codes are the same alone and in a batch of three (other prompt lengths)."""
    assert_sampled_rows_do_not_depend_on_the_batch(pipe, PROMPTS, method, settings, num_codes=G * G)


def test_drafter_methods_without_a_drafter_are_refused(pipe: lantern.Pipeline) -> None:
    """(Drafters trained for Emu3 models: tests/test_emu3_drafter.py.)"""
    with pytest.raises(LanternError, match="^method lantern\\+\\+ needs a drafter: pass drafter=DIR"):
        pipe(prompts=PROMPTS[:1], method="lantern++")


def test_folders_that_need_code_or_pickles_are_refused(folder: Path, tmp_path: Path) -> None:
    """auto_map (trust_remote_code, e.g. BAAI's original Emu3-Gen) and pickled-only weights: one
    line each, before any weight or tokenizer is read."""
    remote = copy_with_config(folder, tmp_path / "remote",
                              auto_map={"AutoModelForCausalLM": "modeling_emu3.Emu3ForCausalLM"})
    with pytest.raises(LanternError, match="auto_map") as e:
        lantern.load(remote)
    assert "\n" not in str(e.value)
    pickles = copy_with_pickles_only(folder, tmp_path / "pickles")
    with pytest.raises(LanternError, match="safetensors only") as e:
        lantern.load(pickles)
    assert "\n" not in str(e.value)


def test_flags_of_other_families_and_bad_sizes_are_refused(folder: Path) -> None:
    assert_load_refuses(folder, [*OTHER_FAMILIES_OPTIONS, ({"image_size": 30}, "multiple of 8")])


def test_image_size_sets_the_grid(folder: Path, tmp_path: Path) -> None:
    """``image_size`` (pixels a side) gives the size header and the grid: 48 px, 6 x 6 codes; without
    one in generation.json, Emu3Processor's default 720 px (90 x 90 codes)."""
    pipe = lantern.load(folder, image_size=48)
    assert pipe.stack.layout.height == pipe.stack.layout.width == 6
    assert pipe.stack.tokenize(["a cat"])[0] == _processor_inputs("a cat", grid=6)["input_ids"][0].tolist()
    out = pipe(prompts=["a cat"], method="pjd", pjd_window=2, pjd_context=6, temperature=0.0)
    assert out.codes.shape == (1, 36) and out.images[0].size == (48, 48)
    bare = copy_with_config(folder, tmp_path / "bare")
    (bare / "generation.json").unlink()
    layout = lantern.load(bare).stack.layout
    assert (layout.height, layout.width, layout.pixel_size) == (90, 90, (720, 720))
    with pytest.raises(LanternError, match="exceed the model's 9216 positions"):
        lantern.load(folder, image_size=768)  # 96 rows of 97 tokens


def test_labels_are_refused(pipe: lantern.Pipeline) -> None:
    with pytest.raises(LanternError, match="text-to-image"):
        pipe(labels=[1])


def test_sampling_defaults_come_from_the_folder(pipe: lantern.Pipeline) -> None:
    """generation.json (top_k 8, cfg 3) over generation_config.json (top_k 2048) over BAAI's (cfg 3)."""
    assert pipe.stack.default_sampling() == {"temperature": 1.0, "top_k": 8, "top_p": 1.0, "cfg_scale": 3.0}
    assert pipe.stack.sampling_defaults == {"top_k": 2048}
    assert pipe.stack.model_shape()["family"] == "emu3"


def test_the_code_head_is_a_view_when_the_visual_tokens_are_one_run() -> None:
    """Emu3's visual tokens are consecutive ids: the code head shares the LM head's rows (no copy);
    the tiny folder's permuted ids get a copy. Either way it is the LM head at the codes."""
    from lantern.models.emu3 import Emu3LM
    from lantern.testing import tiny_emu3

    hf = tiny_emu3()
    hidden = torch.randn(3, hf.config.text_config.hidden_size)
    permuted = Emu3LM(hf)
    assert permuted.image_head.weight.data_ptr() != hf.lm_head.weight.data_ptr()
    vocab = dict(hf.config.vocabulary_map)
    for c in range(32):
        vocab[f"<|visual token{c:06d}|>"] = 96 + c
    hf.config.vocabulary_map = vocab
    run = Emu3LM(hf)
    assert run.image_head.weight.data_ptr() == hf.lm_head.weight[96].data_ptr()
    for lm in (permuted, run):
        torch.testing.assert_close(lm.image_logits(hidden), hf.lm_head(hidden)[:, lm.image_ids])


# -- slow tier: the law of the lossless methods across a row end -----------------------------------


DIST_ROWS = 3000
DIST_CODES = (2, 3, 4)  # the last two codes of row 0 and the first of row 1: across an end-of-line token
DIST = {"temperature": 1.0, "top_k": 4, "cfg_scale": 2.0}
DIST_METHODS = {"sjd-coupled": {"sjd_window": 4, "sjd_init": "random"}, "pjd": {"pjd_window": 2, "pjd_context": G}}


@torch.no_grad()
def _exact_law(folder: Path, cfg_scale: float, grid: tuple[int, int] = (G, G)) -> Tensor:
    """The law of codes 2..4 [32^3], from transformers' modules by full recomputation of both
    branches (the prompt, and the negative prompt, then the BPE sequence with its end-of-line
    token after every row of ``grid``'s codes per row), guided by transformers' CFG processor,
    restricted to the visual tokens, then top-k 4; codes 0 and 1 summed out."""
    from transformers.generation.logits_process import UnbatchedClassifierFreeGuidanceLogitsProcessor

    from lantern.decoding.sampling import probs_from_logits

    model = _reference_model(folder)
    prompt, negative = _processor_inputs(PROMPTS[0], grid)["input_ids"], _negative_inputs()["input_ids"]
    width = grid[1]
    mapping = model.vocabulary_mapping
    visual = torch.tensor([mapping.img2bpe[c] for c in range(32)])
    sampling = SamplingConfig(**{**DIST, "cfg_scale": cfg_scale})
    memo: dict[tuple[int, ...], Tensor] = {}

    def probs(codes: tuple[int, ...]) -> Tensor:
        if codes not in memo:
            bpe = [int(visual[c]) for c in codes]
            if len(bpe) >= width:  # the row's end-of-line token, before the next row's first code
                bpe.insert(width, mapping.eol_token_id)
            tail = torch.tensor([bpe], dtype=torch.long)
            guide = UnbatchedClassifierFreeGuidanceLogitsProcessor(cfg_scale, model, torch.cat([negative, tail], 1),
                                                                   use_cache=False)
            ids = torch.cat([prompt, tail], 1)
            guided = guide(ids, model(ids).logits[:, -1])
            memo[codes] = probs_from_logits(guided[:, visual], sampling)[0].double()
        return memo[codes]

    law = torch.zeros(32, 32, 32, dtype=torch.float64)

    def walk(codes: tuple[int, ...], p: float) -> None:
        if len(codes) == 5:
            law[codes[2], codes[3], codes[4]] += p
            return
        step = probs(codes)
        for c in step.nonzero().flatten().tolist():
            walk((*codes, c), p * float(step[c]))

    walk((), 1.0)
    return law.flatten()


@cache
def _dist_codes(folder: Path, method: str) -> Tensor:
    return dist_codes(folder, PROMPTS[0], method, {**DIST, **DIST_METHODS[method]}, DIST_ROWS, list(DIST_CODES))


# slow (~10 s for both methods): 3000 images each, a chi-square run like the other families'
@pytest.mark.slow
@pytest.mark.parametrize("method", list(DIST_METHODS))
def test_lossless_methods_keep_the_models_law_across_a_row_end(folder: Path, method: str) -> None:
    """Chi-square goodness of fit of codes 2..4 against the exact law from transformers' modules, at
    significance 0.001 (fixed seeds: deterministic)."""
    assert_law(_dist_codes(folder, method), _exact_law(folder, DIST["cfg_scale"]), min_df=20)


# slow (~10 s): a tall image, 6 rows of 3 codes: codes 2..4 cross the end-of-line token after code 2, where a
# square grid's 18 tokens would put none (and a window of 4 crosses it)
@pytest.mark.slow
@pytest.mark.parametrize("method", list(DIST_METHODS))
def test_lossless_methods_keep_the_models_law_on_a_tall_image(folder: Path, method: str) -> None:
    assert_law(_tall_codes(folder, method), _exact_law(folder, DIST["cfg_scale"], TALL), min_df=20)


TALL = (6, 3)


@cache
def _tall_codes(folder: Path, method: str) -> Tensor:
    settings = {**DIST, **DIST_METHODS[method], **({"pjd_context": TALL[1]} if method == "pjd" else {})}
    rows, columns = TALL
    return dist_codes(folder, PROMPTS[0], method, settings, DIST_ROWS, list(DIST_CODES), image_size=8 * rows,
                      image_width=8 * columns)


# slow: reuses the sjd-coupled run above
@pytest.mark.slow
def test_the_law_test_has_power(folder: Path) -> None:
    """The same samples are rejected against another guidance scale (2.5 instead of 2), and the tall
    image's against the square grid's law (its size header, and its row end after code 4, not 2)."""
    from lantern.testing import chi_square_pooled, chi_square_threshold

    stat, df = chi_square_pooled(_dist_codes(folder, "sjd-coupled"), _exact_law(folder, 2.5), 32)
    assert stat > chi_square_threshold(df)
    stat, df = chi_square_pooled(_tall_codes(folder, "sjd-coupled"), _exact_law(folder, DIST["cfg_scale"]), 32)
    assert stat > chi_square_threshold(df)


def test_a_prompt_the_tokenizer_does_not_end_with_the_size_header_is_refused() -> None:
    """The prompt side checks that every tokenized prompt ends with the layout's prefix (here the
    size header): a tokenizer that splits it otherwise would put the image at another place."""
    from lantern.targets.emu3 import Emu3Prompter, Emu3Prompting

    def tokenizer(cut: int) -> Any:
        def encode(text: str) -> dict[str, list[int]]:
            ids = [1, *(ord(c) % 50 + 10 for c in text.removesuffix("<boi>2*2<wrap>")), 7, 8]
            return {"input_ids": ids[: len(ids) - cut]}
        return encode

    def prompter(cut: int) -> Emu3Prompter:
        return Emu3Prompter(Path("m"), tokenizer(cut), Emu3Prompting(bos="", boi="<boi>", wrapper="<wrap>"),
                            grid=(2, 2), header=(7, 8), negative=(1, 9))

    assert prompter(0).context_lengths(["a cat", "mountains"]) == [8, 12]
    with pytest.raises(LanternError, match=r"^--model m: the tokenizer does not end the prompt with the size header "
                                           r"'<boi>2\*2<wrap>' \(ids \[7, 8\]\); got ids \[\d+, \d+, \d+, 7\]$"):
        prompter(1).tokenize(["a cat"])


def test_code_ids_live_on_the_models_device() -> None:
    """``Emu3LM`` wraps a model already on its device (``load_emu3``) and is not moved after, so its
    code -> token table must be made there: on a GPU a CPU table met CUDA codes in ``code_to_bpe`` and
    CUDA logits in ``image_log_probs``. A meta model stands in for a CUDA one."""
    from lantern.models.emu3 import Emu3LM
    from lantern.testing import tiny_emu3

    lm = Emu3LM(tiny_emu3().to("meta"))
    assert lm.image_ids.device.type == "meta"
    assert lm.code_to_bpe(torch.zeros(2, 3, dtype=torch.long, device="meta")).device.type == "meta"
    hidden = torch.zeros(2, lm.config.hidden_size, device="meta")
    assert lm.image_log_probs(hidden).shape == (2, lm.num_codes)
