"""The Janus family (Janus, Janus-Pro): its target adapter and its Stack.

The target is the Chameleon adapter (:class:`~lantern.targets.chameleon.ChameleonTarget`: left-padded
prompts with per-row positions, tree verification, PJD's grid) over a
:class:`~lantern.models.janus.JanusLM`; only classifier-free guidance differs. Janus's
unconditional rows are the prompt itself with every token but BOS and the image-start token
replaced by the pad token, attended exactly like the prompt (transformers'
``JanusForConditionalGeneration.generate(generation_mode="image")``; DeepSeek's
``generation_inference.py`` pads ``tokens[1:-1]``). Its grid has no row tokens, so the
adapter's new-line shadows never appear.

The stack reads a transformers-format folder: the model (safetensors), its tokenizer and chat
template (``chat_template.jinja``, or the tokenizer's own), ``generation_config.json`` (the pad,
BOS and image-start ids; guidance scale and temperature as sampling defaults) and lantern's usual
extras (``generation.json``, ``proximity.safetensors``). Images come from the model's own VQ decoder.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor

from lantern.decoding.cache import CachePool
from lantern.decoding.config import SamplingConfig
from lantern.errors import check
from lantern.models.chameleon import ImageLayout
from lantern.models.janus import BOI_TOKEN, JanusLM, janus_layout
from lantern.targets.chameleon import DEFAULT_PROMPT_WIDTH, ChameleonTarget
from lantern.targets.chameleon_stack import EndedPrompter, PromptStack, load_prompt_tokenizer

if TYPE_CHECKING:
    from PIL import Image

# DeepSeek's defaults (generation_inference.py: cfg_weight 5, temperature 1, no top-k / top-p);
# the folder's generation_config.json and generation.json come on top.
DEFAULT_SAMPLING = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "cfg_scale": 5.0}


@dataclass(frozen=True)
class JanusTokens:
    """The ids that shape a Janus image prompt and its guidance rows."""

    bos: int  # kept in the unconditional rows
    pad: int  # replaces every other prompt token there
    boi: int  # <begin_of_image>: ends every prompt (the layout's prefix), kept in the unconditional rows
    boi_text: str = BOI_TOKEN  # the token's text, appended to the templated prompt before tokenizing


class JanusTarget(ChameleonTarget):
    """The Chameleon adapter over a Janus model, with Janus's guidance rows."""

    def __init__(self, model: JanusLM, layout: ImageLayout, sampling: SamplingConfig, tokens: JanusTokens,
                 max_tree_nodes: int = 1, compile: str | None = None, cache_pool: CachePool | None = None,
                 prompt_width: int = DEFAULT_PROMPT_WIDTH) -> None:
        super().__init__(model, layout, sampling, max_tree_nodes=max_tree_nodes, compile=compile,
                         cache_pool=cache_pool, prompt_width=prompt_width)
        self.tokens = tokens

    def guidance_rows(self, cond: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        """The prompt with every real token but BOS and image-start replaced by pad; same mask."""
        keep = mask & ((cond == self.tokens.bos) | (cond == self.tokens.boi))
        return torch.where(keep, cond, torch.full_like(cond, self.tokens.pad)), mask


@dataclass(frozen=True)
class JanusPrompter(EndedPrompter):
    """A Janus folder's prompts: its chat template around its tokenizer, ended by the image-start token."""

    root: Path
    tokenizer: Any
    tokens: JanusTokens
    chat_template: str | None  # None: the tokenizer's own

    def format_prompt(self, prompt: str) -> str:
        """The text transformers tokenizes for an image prompt: the chat template's user turn with
        the generation prompt, then the image-start token."""
        messages = [{"role": "user", "content": [{"type": "text", "text": prompt}]}]
        text = self.tokenizer.apply_chat_template(messages, chat_template=self.chat_template, tokenize=False,
                                                  add_generation_prompt=True)
        return str(text) + self.tokens.boi_text

    def ending(self) -> tuple[tuple[int, ...], str]:
        return (self.tokens.boi,), f"the image-start token {self.tokens.boi_text!r}"


def read_janus_prompter(root: Path) -> JanusPrompter:
    """The folder's prompt side, without its weights."""
    from lantern.models.janus import check_janus_folder

    check_janus_folder(root)  # before the tokenizer: a remote-code folder is refused first
    tokenizer = load_prompt_tokenizer(root, "Janus")
    template = read_chat_template(root, tokenizer)
    return JanusPrompter(root, tokenizer, janus_tokens(root, tokenizer, read_generation_config(root)), template)


@dataclass
class JanusStack(PromptStack):
    """A Janus / Janus-Pro folder loaded: the :class:`~lantern.targets.base.Stack` for Janus targets.

    Conditions are prompts in the model's chat template, ended by the image-start token;
    images come from the model's VQ decoder; drafters are lantern-trained EAGLE drafters (1D RoPE,
    the image-start token's feature as their prefix), as for Chameleon models."""

    model: JanusLM
    tokenizer: Any  # a transformers tokenizer
    tokens: JanusTokens
    chat_template: str | None = None  # None: the tokenizer's own
    sampling_defaults: dict[str, float] = field(default_factory=dict)  # from generation_config.json

    FAMILY_SAMPLING: ClassVar[dict[str, float]] = DEFAULT_SAMPLING

    kind = "janus"
    family = "Janus"

    def config_sampling(self) -> dict[str, float]:
        """generation_config.json's, between DeepSeek's defaults and generation.json's."""
        return self.sampling_defaults

    @property
    def prompter(self) -> JanusPrompter:
        return JanusPrompter(self.root, self.tokenizer, self.tokens, self.chat_template)

    def format_prompt(self, prompt: str) -> str:
        return self.prompter.format_prompt(prompt)

    def tokenize(self, prompts: Sequence[str]) -> list[list[int]]:
        return self.prompter.tokenize(prompts)

    def prompt_ids(self, prompts: Sequence[str]) -> list[list[int]]:
        return [ids[:-1] for ids in self.tokenize(prompts)]  # the layout's prefix is the image-start token

    def make_target(self, sampling: SamplingConfig, max_tree_nodes: int = 1, compile: str | None = None,
                    cache_pool: CachePool | None = None) -> JanusTarget:
        return JanusTarget(self.model, self.layout, sampling, self.tokens, max_tree_nodes=max_tree_nodes,
                           compile=compile, cache_pool=cache_pool, prompt_width=self.prompt_width)

    @torch.no_grad()
    def decode(self, codes: Tensor) -> Tensor:
        return self.model.decode_codes(codes.to(self.device))

    def to_pil(self, codes: Tensor) -> list[Image.Image]:
        from lantern.images import to_pil

        # (x + 1) / 2 * 255, truncated: DeepSeek's generation_inference.py, and transformers'
        # JanusImageProcessor.postprocess with the released mean = std = 0.5 (tested equal)
        return to_pil(self.decode(codes), "truncate")


def load_janus_stack(model: str | os.PathLike[str], dtype: torch.dtype | None = None,
                     device: str | torch.device = "cpu") -> JanusStack:
    """A Janus folder as a stack: the model (safetensors only), tokenizer, chat template, token ids."""
    from lantern.models.janus import load_janus

    root = Path(model)
    prompter = read_janus_prompter(root)
    settings = read_generation_config(root)
    tokens = prompter.tokens
    lm = load_janus(root, dtype=dtype, device=device)
    stack = JanusStack(root=root, model=lm, layout=janus_layout(lm, tokens.boi), tokenizer=prompter.tokenizer,
                       tokens=tokens, chat_template=prompter.chat_template,
                       sampling_defaults=sampling_from_config(settings))
    check(max(tokens.bos, tokens.pad, tokens.boi) < lm.text_vocab,
          f"--model {root}: special token ids {tokens} past the text vocabulary ({lm.text_vocab})")
    return stack


def read_chat_template(root: Path, tokenizer: Any) -> str | None:
    """The folder's chat template: ``chat_template.jinja`` (what transformers' processor saves),
    ``chat_template.json``, else the tokenizer's own (None); one of them must exist."""
    from lantern.io import read_json_object

    jinja, json_file = root / "chat_template.jinja", root / "chat_template.json"
    if jinja.is_file():
        return jinja.read_text()
    if json_file.is_file():
        template = read_json_object(json_file, "chat template").get("chat_template")
        check(isinstance(template, str), f"{json_file}: chat_template: expected a string")
        return str(template)
    check(getattr(tokenizer, "chat_template", None) is not None,
          f"--model {root} has no chat template (chat_template.jinja): Janus prompts are written in it")
    return None


def read_generation_config(root: Path) -> dict[str, Any]:
    """``generation_config.json`` ({} when absent)."""
    from lantern.io import read_json_object

    path = root / "generation_config.json"
    return read_json_object(path, "generation config") if path.is_file() else {}


def janus_tokens(root: Path, tokenizer: Any, settings: dict[str, Any]) -> JanusTokens:
    """BOS, pad and image-start ids as transformers' generate reads them (generation_config.json:
    ``bos_token_id``, ``pad_token_id``, ``generation_kwargs.boi_token_id``), else the tokenizer's."""
    kwargs = settings.get("generation_kwargs") or {}
    boi_text = getattr(tokenizer, "boi_token", None) or BOI_TOKEN
    boi = kwargs.get("boi_token_id", settings.get("boi_token_id"))
    if boi is None:
        found = tokenizer.convert_tokens_to_ids(boi_text)
        boi = None if found == tokenizer.unk_token_id else found
    values = {"bos": settings.get("bos_token_id", tokenizer.bos_token_id),
              "pad": settings.get("pad_token_id", tokenizer.pad_token_id), "boi": boi}
    for name, value in values.items():
        check(isinstance(value, int) and not isinstance(value, bool),
              f"--model {root}: no {name} token id (generation_config.json or the tokenizer), got {value!r}")
    return JanusTokens(bos=values["bos"], pad=values["pad"], boi=values["boi"], boi_text=boi_text)


def sampling_from_config(settings: dict[str, Any]) -> dict[str, float]:
    """Sampling defaults a Janus generation_config.json states: guidance scale and temperature."""
    out: dict[str, float] = {}
    for key, name in (("guidance_scale", "cfg_scale"), ("temperature", "temperature")):
        value = settings.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[name] = float(value)
    return out
