"""The Emu3 family (BAAI's Emu3-Gen in transformers' layout): its target adapter and its Stack.

The target is the Chameleon adapter (:class:`~lantern.targets.chameleon.ChameleonTarget`: left-padded
prompts with per-row positions, tree verification, PJD's grid, new-line shadows) over an
:class:`~lantern.models.emu3.Emu3LM`. What is Emu3's own:

* **Prompt.** ``<BOS>{prompt}<|image start|>{H}*{W}<|image token|>``, tokenized whole: what
  transformers' ``Emu3Processor(text=..., return_for_image_generation=True)`` builds (its
  ``prepare_inputs_layout`` adds the BOS text, its ``calculate_generate_size`` the grid: 90 x 90 codes
  for the default 1:1 image of 518,400 pixels). No chat template: image generation has none.
* **Guidance rows.** The negative prompt, as transformers' Emu3 docs pass it to ``generate``
  (``negative_prompt_ids`` of ``processor(text=[neg_prompt])``: BOS and the text, no size header),
  left-padded to the batch's width; prompts shorter than it get masked left padding (no position,
  never attended), so no extra field in :class:`~lantern.targets.base.Conditions` is needed: the
  negative prompt is one per model. ``generation.json`` may change its text (``negative_prompt``)
  or add the size header to it (``negative_image_header: true``, as BAAI's own
  ``image_generation.py`` formats both prompts).
* **Guidance.** ``u + s (c - u)`` of the log-softmax over the whole vocabulary of each branch, as
  transformers' ``UnbatchedClassifierFreeGuidanceLogitsProcessor`` (``Emu3LM.image_log_probs``).
* **Rows.** The end-of-line token after every row is the layout's ``eol``: forced, never sampled,
  inserted by the adapter after each row's last code in trees and in PJD's grid, so PJD's windows
  are the image rows; the end-of-frame / end-of-image tokens after the last row follow the codes and
  are never needed for them.

The stack reads a transformers-format folder (safetensors, tokenizer, ``generation_config.json``:
top-k, temperature and guidance as sampling defaults) and lantern's usual extras (``generation.json``:
also ``image_size``; ``proximity.safetensors``). Images come from the model's own VQ decoder.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor

from lantern.decoding.cache import CachePool
from lantern.decoding.config import SamplingConfig
from lantern.decoding.sampling import apply_cfg
from lantern.errors import LanternError, check
from lantern.models.chameleon import ImageLayout
from lantern.models.emu3 import DEFAULT_IMAGE_SIZE, PIXELS_PER_CODE, Emu3LM, emu3_layout, grid_for
from lantern.targets.base import COMMON_GENERATION_KEYS, Conditions, read_generation_settings
from lantern.targets.chameleon import DEFAULT_PROMPT_WIDTH, ChameleonTarget, left_padded
from lantern.targets.chameleon_stack import EndedPrompter, PromptStack, load_prompt_tokenizer
from lantern.targets.janus import read_generation_config

if TYPE_CHECKING:
    from PIL import Image

# BAAI's image_generation.py: guidance 3, top-k 2048 (also the converted generation_config.json's), temperature 1.
DEFAULT_SAMPLING = {"temperature": 1.0, "top_k": 2048, "top_p": 1.0, "cfg_scale": 3.0}
# The negative prompt of BAAI's image_generation.py and of transformers' Emu3 docs.
NEGATIVE_PROMPT = ("lowres, bad anatomy, bad hands, text, error, missing fingers, extra digit, fewer digits, cropped, "
                   "worst quality, low quality, normal quality, jpeg artifacts, signature, watermark, username, "
                   "blurry.")
BOI_TOKEN, WRAPPER_TOKEN = "<|image start|>", "<|image token|>"  # the tokenizer's boi_token, image_wrapper_token


@dataclass(frozen=True)
class Emu3Prompting:
    """How an Emu3 prompt and its negative are written (texts; the stack tokenizes them)."""

    bos: str  # the BOS token's text (Emu3: <|extra_203|>), written first as Emu3Processor does
    boi: str = BOI_TOKEN
    wrapper: str = WRAPPER_TOKEN
    negative: str = NEGATIVE_PROMPT
    negative_header: bool = False  # True: the negative carries the size header too (BAAI's own script)

    def header(self, grid: tuple[int, int]) -> str:
        """The size header that ends every prompt: ``<|image start|>H*W<|image token|>`` (rows, codes per row)."""
        return f"{self.boi}{grid[0]}*{grid[1]}{self.wrapper}"

    def prompt(self, text: str, grid: tuple[int, int]) -> str:
        return f"{self.bos}{text}{self.header(grid)}"

    def negative_prompt(self, grid: tuple[int, int]) -> str:
        return self.prompt(self.negative, grid) if self.negative_header else f"{self.bos}{self.negative}"


@dataclass(frozen=True)
class Emu3Prompter(EndedPrompter):
    """An Emu3 folder's prompts: BOS, the text, then the size header of an image of ``grid`` = (rows,
    codes per row)."""

    root: Path
    tokenizer: Any
    prompting: Emu3Prompting
    grid: tuple[int, int]  # (rows, codes per row)
    header: tuple[int, ...]  # the size header's ids: the layout's prefix, which ends every prompt
    negative: tuple[int, ...]  # the negative prompt's ids: the guidance rows, padded to the prompt width too

    def format_prompt(self, prompt: str) -> str:
        """The text transformers' Emu3Processor tokenizes for an image prompt."""
        return self.prompting.prompt(prompt, self.grid)

    def ending(self) -> tuple[tuple[int, ...], str]:
        return self.header, f"the size header {self.prompting.header(self.grid)!r}"

    def check_fits(self, prompts: Sequence[str], width: int) -> None:
        super().check_fits(prompts, width)
        check_negative_fits(len(self.negative), width)

    def with_negative(self, text: str) -> Emu3Prompter:
        """The same prompts with ``text`` as the negative prompt (a call's own, in the folder's format)."""
        prompting = replace(self.prompting, negative=text)
        return replace(self, prompting=prompting,
                       negative=tuple(tokenize_text(self.tokenizer, prompting.negative_prompt(self.grid))))


def check_negative_fits(tokens: int, width: int) -> None:
    check(tokens <= width, f"Emu3's negative prompt takes {tokens} tokens, more than --prompt-width {width}: raise it",
          field="prompt_width")


def read_emu3_prompter(root: Path, image_size: int | None = None, image_width: int | None = None) -> Emu3Prompter:
    """The folder's prompt side, without its weights (``image_size``, ``image_width``: as
    :func:`load_emu3_stack`)."""
    from lantern.models.emu3 import check_emu3_folder

    check_emu3_folder(root)  # before the tokenizer: a remote-code folder is refused first
    settings = read_generation_settings(root, Emu3Stack.GENERATION_KEYS)
    grid = image_grid(root, settings, image_size, image_width)
    tokenizer = load_prompt_tokenizer(root, "Emu3")
    prompting = emu3_prompting(root, tokenizer, settings)
    return Emu3Prompter(root, tokenizer, prompting, grid, tuple(tokenize_text(tokenizer, prompting.header(grid))),
                        tuple(tokenize_text(tokenizer, prompting.negative_prompt(grid))))


class Emu3Target(ChameleonTarget):
    """The Chameleon adapter over an Emu3 model: negative-prompt guidance rows, guided log-probs."""

    def __init__(self, model: Emu3LM, layout: ImageLayout, sampling: SamplingConfig, negative: Sequence[int],
                 max_tree_nodes: int = 1, compile: str | None = None, cache_pool: CachePool | None = None,
                 prompt_width: int = DEFAULT_PROMPT_WIDTH) -> None:
        super().__init__(model, layout, sampling, max_tree_nodes=max_tree_nodes, compile=compile,
                         cache_pool=cache_pool, prompt_width=prompt_width)
        self.emu3 = model
        self.negative = torch.tensor(list(negative), dtype=torch.long)

    def guidance_rows(self, cond: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        """The negative prompt in every row, left-padded to the prompt width."""
        b, length = cond.shape
        n = len(self.negative)
        check_negative_fits(n, length)
        u_ids = torch.zeros(b, length, dtype=torch.long, device=cond.device)
        u_ids[:, length - n :] = self.negative.to(cond.device)
        u_mask = torch.zeros(b, length, dtype=torch.bool, device=cond.device)
        u_mask[:, length - n :] = True
        return u_ids, u_mask

    def guided_logits(self, hidden: Tensor) -> Tensor:
        """With guidance, ``u + s (c - u)`` of each branch's log-softmax over the whole vocabulary at
        the codes (transformers' UnbatchedClassifierFreeGuidanceLogitsProcessor, which then keeps the
        visual tokens); without, the raw code logits (what transformers samples from then)."""
        if self.streams == 1:
            return self.emu3.image_logits(hidden)
        return apply_cfg(self.emu3.image_log_probs(hidden), self.sampling.cfg_scale, self.streams)


@dataclass
class Emu3Stack(PromptStack):
    """An Emu3 folder loaded: the :class:`~lantern.targets.base.Stack` for Emu3 targets.

    Conditions are prompts with Emu3's size header; guidance rows the negative prompt; images come
    from the model's VQ decoder; drafters are lantern-trained EAGLE drafters (1D RoPE, the size
    header's features as their prefix), as for Chameleon and Janus models.

    The drafter backend guides raw code logits, and that gives the target's law over codes: the
    target guides full-vocabulary log-softmaxes, which differ from the raw logits by one constant
    per row and stream, and ``u + s (c - u)`` of those constants is again one constant per row,
    which softmax drops."""

    # generation.json may also set the image side and the negative prompt (one per model).
    GENERATION_KEYS: ClassVar[tuple[str, ...]] = (*COMMON_GENERATION_KEYS, "image_size", "image_width",
                                                  "negative_prompt",
                                                  "negative_image_header")
    model: Emu3LM
    tokenizer: Any  # a transformers tokenizer
    prompting: Emu3Prompting
    negative_ids: tuple[int, ...]
    sampling_defaults: dict[str, float] = field(default_factory=dict)  # from generation_config.json

    FAMILY_SAMPLING: ClassVar[dict[str, float]] = DEFAULT_SAMPLING

    kind = "emu3"
    family = "Emu3"

    def config_sampling(self) -> dict[str, float]:
        """generation_config.json's, between BAAI's defaults and generation.json's."""
        return self.sampling_defaults

    @property
    def prompter(self) -> Emu3Prompter:
        return Emu3Prompter(self.root, self.tokenizer, self.prompting, (self.layout.height, self.layout.width),
                            self.layout.prefix, self.negative_ids)

    def format_prompt(self, prompt: str) -> str:
        return self.prompter.format_prompt(prompt)

    def tokenize(self, prompts: Sequence[str]) -> list[list[int]]:
        return self.prompter.tokenize(prompts)

    def prompt_ids(self, prompts: Sequence[str]) -> list[list[int]]:
        p = len(self.layout.prefix)  # the layout's prefix is the size header
        return [ids[:-p] for ids in self.tokenize(prompts)]

    def negative_rows(self, negatives: list[str] | None, count: int, repeats: int) -> Conditions:
        """The guidance rows of ``count`` conditions: each one's negative prompt in the folder's
        format (BOS and the text; with ``negative_image_header``, the size header too), or the
        folder's own negative prompt where none is given, left-padded to the longest, each
        ``repeats`` times. Always written, so that conditions with and without a given negative
        prompt batch together (a server's requests)."""
        if negatives is None:
            check_negative_fits(len(self.negative_ids), self.prompt_width)
            rows = [self.negative_ids] * count
        else:
            prompter = self.prompter
            rows = [prompter.with_negative(text).negative for text in negatives]
            over = [i for i, row in enumerate(rows) if len(row) > self.prompt_width]
            if over:
                which = f"entry {over[0]} " if len(set(negatives)) > 1 else ""
                raise LanternError(f"negative_prompt: {which}takes {len(rows[over[0]])} tokens in the model's format, "
                                   f"more than the prompt width {self.prompt_width} (--prompt-width): shorten it, or "
                                   "raise the width", field="negative_prompt")
        u_ids, u_mask = left_padded([r for r in rows for _ in range(repeats)])
        return Conditions(u_ids.to(self.device), u_mask.to(self.device))

    def make_target(self, sampling: SamplingConfig, max_tree_nodes: int = 1, compile: str | None = None,
                    cache_pool: CachePool | None = None) -> Emu3Target:
        return Emu3Target(self.model, self.layout, sampling, self.negative_ids, max_tree_nodes=max_tree_nodes,
                          compile=compile, cache_pool=cache_pool, prompt_width=self.prompt_width)

    @torch.no_grad()
    def decode(self, codes: Tensor) -> Tensor:
        return self.model.decode_codes(codes.to(self.device), self.layout.height, self.layout.width)

    def to_pil(self, codes: Tensor) -> list[Image.Image]:
        from lantern.images import to_pil

        # (x + 1) / 2 * 255, truncated: transformers' Emu3ImageProcessor.postprocess with the
        # released mean = std = 0.5 (tested equal)
        return to_pil(self.decode(codes), "truncate")


def tokenize_text(tokenizer: Any, text: str) -> list[int]:
    """Ids of ``text`` as Emu3Processor tokenizes it (the BOS is in the text; Emu3's tokenizer adds none)."""
    return [int(i) for i in tokenizer(text)["input_ids"]]


def load_emu3_stack(model: str | os.PathLike[str], dtype: torch.dtype | None = None,
                    device: str | torch.device = "cpu", image_size: int | None = None,
                    image_width: int | None = None) -> Emu3Stack:
    """An Emu3 folder as a stack: the model (safetensors only), tokenizer, size header, negative prompt.
    ``image_size``: the image's height in pixels, ``image_width`` its width (default: the height); both
    None: generation.json's ``image_size`` / ``image_width``, else Emu3Processor's 720 x 720."""
    from lantern.models.emu3 import load_emu3

    root = Path(model)
    prompter = read_emu3_prompter(root, image_size, image_width)
    tokenizer, grid, header, negative = prompter.tokenizer, prompter.grid, prompter.header, prompter.negative
    lm = load_emu3(root, dtype=dtype, device=device)
    check(bool(header) and max(header + negative) < lm.config.vocab_size,
          f"--model {root}: the size header / negative prompt ids {header} / {negative[:4]}... do not fit the "
          f"vocabulary ({lm.config.vocab_size})")
    max_len = int(lm.config.max_position_embeddings)
    (rows, columns), pixels = grid, lm.pixels_per_code
    check(len(negative) + rows * (columns + 1) <= max_len,
          f"--image-size {rows * pixels} (--image-width {columns * pixels}): {rows} x {columns} codes and their row "
          f"tokens exceed the model's {max_len} positions")
    return Emu3Stack(root=root, model=lm, layout=emu3_layout(lm, header, grid), tokenizer=tokenizer,
                     prompting=prompter.prompting, negative_ids=negative,
                     sampling_defaults=sampling_from_config(read_generation_config(root)))


def image_grid(root: Path, settings: dict[str, Any], image_size: int | None,
               image_width: int | None) -> tuple[int, int]:
    """(rows, codes per row): ``image_size`` high (else generation.json's ``image_size``, else
    Emu3Processor's 720) and ``image_width`` wide (else, with no ``image_size`` given, generation.json's
    ``image_width``; else as high)."""
    rows = grid_for(image_size) if image_size is not None else folder_grid(root, settings, "image_size")
    if image_width is not None:
        return rows, grid_for(image_width, "--image-width")
    if image_size is None and "image_width" in settings:  # the file's size, not half of it beside a flag
        return rows, folder_grid(root, settings, "image_width")
    return rows, rows


def folder_grid(root: Path, settings: dict[str, Any], key: str) -> int:
    """generation.json's ``key`` (``image_size``, ``image_width``: checked) in codes, else
    Emu3Processor's default side's."""
    value = settings.get(key, DEFAULT_IMAGE_SIZE)
    check(isinstance(value, int) and not isinstance(value, bool) and value >= PIXELS_PER_CODE
          and value % PIXELS_PER_CODE == 0,
          f"{root / 'generation.json'}: {key}: expected a positive multiple of {PIXELS_PER_CODE} (pixels), "
          f"got {value!r}")
    return int(value) // PIXELS_PER_CODE


def emu3_prompting(root: Path, tokenizer: Any, settings: dict[str, Any]) -> Emu3Prompting:
    """The tokenizer's BOS, image-start and wrapper tokens (Emu3Processor reads the same
    attributes), and generation.json's negative prompt settings (checked)."""
    bos = getattr(tokenizer, "bos_token", None)
    check(isinstance(bos, str) and bool(bos), f"--model {root}: the tokenizer names no BOS token")
    negative = settings.get("negative_prompt", NEGATIVE_PROMPT)
    check(isinstance(negative, str), f"{root / 'generation.json'}: negative_prompt: expected a string, "
                                     f"got {negative!r}")
    header = settings.get("negative_image_header", False)
    check(isinstance(header, bool), f"{root / 'generation.json'}: negative_image_header: expected true or false, "
                                    f"got {header!r}")
    boi = getattr(tokenizer, "boi_token", None) or BOI_TOKEN
    wrapper = getattr(tokenizer, "image_wrapper_token", None) or WRAPPER_TOKEN
    return Emu3Prompting(bos=str(bos), boi=str(boi), wrapper=str(wrapper), negative=negative,
                         negative_header=header)


def sampling_from_config(settings: dict[str, Any]) -> dict[str, float]:
    """Sampling defaults an Emu3 generation_config.json states: guidance scale, temperature, top-k."""
    out: dict[str, float] = {}
    for key, name in (("guidance_scale", "cfg_scale"), ("temperature", "temperature"), ("top_k", "top_k")):
        value = settings.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[name] = int(value) if name == "top_k" else float(value)
    return out
