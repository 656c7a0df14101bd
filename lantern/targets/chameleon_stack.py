"""The Chameleon family's Stack: model folders (Anole, Lumina-mGPT), their VQGAN, prompt tokenizer and drafters."""

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
from lantern.decoding.drafting import DraftBackend
from lantern.decoding.loop import CodeHead, Target
from lantern.drafters.checks import drafter_dtype
from lantern.drafters.eagle import EagleBackend
from lantern.errors import TRANSFORMERS_LOAD_ERRORS, LanternError, check, transformers_reason
from lantern.models.chameleon import ChameleonLM, ImageLayout
from lantern.models.chameleon_drafter import ReleasedChameleonDrafter
from lantern.models.drafter import EagleDrafterModel
from lantern.targets.base import (
    COMMON_GENERATION_KEYS,
    Conditions,
    ConditionSet,
    StackFolder,
    check_condition_kind,
    negative_prompts,
    prompts_for,
)

if TYPE_CHECKING:
    from PIL import Image

    from lantern.models.janus import JanusLM
from lantern.drafters.checks import chameleon_drafter_config
from lantern.targets.chameleon import DEFAULT_PROMPT_WIDTH, ChameleonTarget, check_prompt_widths, encode_prompts

DEFAULT_SAMPLING = {"temperature": 1.0, "top_k": 2000, "top_p": 1.0, "cfg_scale": 3.0}  # Lumina / LANTERN defaults


VQ_NAMES = ("vqgan.ckpt", "tokenizer/vqgan.ckpt")  # where a model folder may hold the VQGAN


class Prompter:
    """How a Chameleon-family folder writes prompts as token ids, read without its weights (the
    tokenizer, the template, the layout's ends): what the stack encodes with, and what
    ``lantern generate`` checks against ``--prompt-width`` before the model is read."""

    def context_lengths(self, prompts: Sequence[str]) -> list[int]:
        """Each prompt's context length: its ids in the template, the layout's fixed tokens included."""
        raise NotImplementedError

    def check_fits(self, prompts: Sequence[str], width: int) -> None:
        """Every context ``prompts`` make fits a prompt width of ``width`` columns (one line naming
        the first that does not)."""
        check_prompt_widths(self.context_lengths(prompts), width)


class EndedPrompter(Prompter):
    """A family whose template writes the whole context, ended by the layout's prefix (Janus: the
    image-start token; Emu3: the size header), which every tokenized prompt is checked to end with."""

    root: Path
    tokenizer: Any

    def format_prompt(self, prompt: str) -> str:
        raise NotImplementedError

    def ending(self) -> tuple[tuple[int, ...], str]:
        """The prefix's ids, and how an error names them."""
        raise NotImplementedError

    def tokenize(self, prompts: Sequence[str]) -> list[list[int]]:
        """Token ids of each prompt, BOS first (the template writes it) and the prefix last."""
        end, name = self.ending()
        out = []
        for p in prompts:
            ids = [int(i) for i in self.tokenizer(self.format_prompt(p))["input_ids"]]
            check(tuple(ids[-len(end):]) == end,
                  f"--model {self.root}: the tokenizer does not end the prompt with {name} (ids {list(end)}); "
                  f"got ids {ids[-len(end) - 2:]}")
            out.append(ids)
        return out

    def context_lengths(self, prompts: Sequence[str]) -> list[int]:
        return [len(ids) for ids in self.tokenize(prompts)]  # the layout adds no token


@dataclass(frozen=True)
class ChameleonPrompter(Prompter):
    """Anole / Lumina-mGPT: the layout's template around the folder's tokenizer."""

    tokenizer: Any
    layout: ImageLayout

    def tokenize(self, prompts: Sequence[str]) -> list[list[int]]:
        return [list(self.tokenizer(self.layout.format_prompt(p), add_special_tokens=False)["input_ids"])
                for p in prompts]

    def context_lengths(self, prompts: Sequence[str]) -> list[int]:
        ends = len(self.layout.head) + len(self.layout.tail) + len(self.layout.prefix)  # as encode_prompts adds
        return [ends + len(ids) for ids in self.tokenize(prompts)]


# A Chameleon folder's generation.json may also name its image layout (instead of --layout).
CHAMELEON_GENERATION_KEYS = (*COMMON_GENERATION_KEYS, "layout", "image_size", "image_width")


@dataclass
class PromptStack(StackFolder):
    """What the stacks on the Chameleon adapter share (Chameleon, Janus, Emu3): the model and its
    image layout, the grid read off them, and prompts as conditions. Each family's stack narrows
    ``model`` to its own class and adds its fields after these."""

    model: Any  # ChameleonLM, JanusLM or Emu3LM: ``num_codes`` image codes
    layout: ImageLayout
    # columns every prompt context is padded to (ChameleonTarget's prompt_width; --prompt-width)
    prompt_width: int = field(default=DEFAULT_PROMPT_WIDTH, kw_only=True)

    num_classes = None
    kind: ClassVar[str]  # in records: "chameleon", "janus", "emu3"
    family: ClassVar[str]  # in messages: "Chameleon-family", "Janus", "Emu3"
    num_tokens: int = field(init=False)  # image codes (the layout's)
    grid_width: int = field(init=False)  # codes per image row (row-end tokens not counted)
    vocab_size: int = field(init=False)  # the model's image codes

    def __post_init__(self) -> None:
        self.num_tokens, self.grid_width = self.layout.num_tokens, self.layout.width
        self.vocab_size = self.model.num_codes

    def network(self) -> torch.nn.Module:
        return self.model

    def sample_conditions(self, n: int) -> list[Any]:
        return prompts_for(n, self.measurement_prompts)

    def make_target(self, sampling: SamplingConfig, max_tree_nodes: int = 1, compile: str | None = None,
                    cache_pool: CachePool | None = None) -> ChameleonTarget:
        """The family's target adapter (:meth:`Stack.make_target`)."""
        raise NotImplementedError

    def cache_bytes(self, sampling: SamplingConfig, max_tree_nodes: int, conditions: ConditionSet, batch: int) -> int:
        return self.make_target(sampling, max_tree_nodes).cache_bytes(batch)

    @property
    def prompter(self) -> Prompter:
        """The family's prompt side (what :func:`lantern.api.read_prompter` reads without the weights)."""
        raise NotImplementedError

    def prompt_ids(self, prompts: Sequence[str]) -> list[list[int]]:
        """Each prompt's token ids in the model's template, up to the layout's prefix (which
        ``encode_prompts`` appends, with the layout's head and tail)."""
        raise NotImplementedError

    def encode(self, conditions: Sequence[Any], repeats: int = 1, batch_size: int = 8,
               t5: str | os.PathLike[str] | None = None, negative: str | Sequence[str] | None = None) -> Conditions:
        check(t5 is None, f"--t5 is not used by {self.family} models (they read prompts with their own tokenizer)")
        prompts = check_condition_kind(conditions, str, self.root)
        guidance = self.negative_rows(negative_prompts(negative, len(prompts)), len(prompts), repeats)
        ids, mask = encode_prompts(self.prompt_ids(prompts), self.layout, self.prompt_width, repeats)
        return Conditions(ids.to(self.device), mask.to(self.device), guidance)

    def negative_rows(self, negatives: list[str] | None, count: int, repeats: int) -> Conditions | None:
        """CFG's unconditional rows of ``count`` conditions with ``negatives`` (a negative prompt
        each; None: none given), each ``repeats`` times; None where the target builds its own. Only Emu3 guides with
        a prompt: the other families refuse one."""
        check(negatives is None, f"negative_prompt: {self.family} models take no negative prompt (their "
                                 "unconditional rows are not a prompt; Emu3 models take one)", field="negative_prompt")
        return None

    def codebook(self) -> Tensor | None:
        return self.model.codebook()

    def model_shape(self) -> dict[str, int | str]:
        c = self.model.config
        return {"family": self.kind, "dim": c.hidden_size, "n_layer": c.num_hidden_layers,
                "block_size": self.num_tokens, "vocab_size": self.vocab_size}

    def load_drafter(self, path: str | os.PathLike[str]) -> torch.nn.Module:
        """A lantern-trained EAGLE drafter of this model."""
        from lantern.drafters.checks import load_trained_drafter

        drafter = load_trained_drafter(path, self.model, self.layout, self.family)
        return drafter.to(self.device, drafter_dtype(self.dtype, self.device)).eval()

    def draft_backend(self, drafter: torch.nn.Module, head: CodeHead, sampling: SamplingConfig,
                      target: Target, slots: int, compile: str | None = None,
                      cache_pool: CachePool | None = None) -> DraftBackend:
        """lantern's EAGLE backend: the drafter reads the features of the layout's prefix, then the
        codes' (both guidance streams), and shares the model's head over codes."""
        return eagle_backend(drafter, head, sampling, target, self.layout, slots, compile, cache_pool)


@dataclass
class ChameleonStack(PromptStack):
    """An Anole / Lumina-mGPT folder loaded: the :class:`~lantern.targets.base.Stack` for Chameleon targets.

    Conditions are prompts (the layout's template around the model's own tokenizer; CFG's
    unconditional rows are the layout's guidance context, built by :class:`ChameleonTarget`),
    images come from the VQGAN, drafters are lantern-trained EAGLE drafters with 1D RoPE or
    LANTERN's released ones (``lantern.drafters.released``)."""

    GENERATION_KEYS: ClassVar[tuple[str, ...]] = CHAMELEON_GENERATION_KEYS
    model: ChameleonLM
    vq: Any  # lantern.models.chameleon_vq.ChameleonVQGAN, or None when only codes are wanted
    tokenizer: Any  # a transformers tokenizer for the prompts

    FAMILY_SAMPLING: ClassVar[dict[str, float]] = DEFAULT_SAMPLING

    kind = "chameleon"
    family = "Chameleon-family"

    @property
    def prompter(self) -> ChameleonPrompter:
        return ChameleonPrompter(self.tokenizer, self.layout)

    def tokenize(self, prompts: Sequence[str]) -> list[list[int]]:
        """Text token ids of each prompt in the layout's template (no special tokens: the layout adds them)."""
        return self.prompter.tokenize(prompts)

    prompt_ids = tokenize  # the layout's head, tail and prefix are all special tokens

    def codebook(self) -> Tensor | None:
        return None if self.vq is None else self.vq.codebook()

    def model_shape(self) -> dict[str, int | str]:
        return {**super().model_shape(), "layout": self.layout.name}

    def make_target(self, sampling: SamplingConfig, max_tree_nodes: int = 1, compile: str | None = None,
                    cache_pool: CachePool | None = None) -> ChameleonTarget:
        return ChameleonTarget(self.model, self.layout, sampling, max_tree_nodes=max_tree_nodes, compile=compile,
                               cache_pool=cache_pool, prompt_width=self.prompt_width)

    def load_drafter(self, path: str | os.PathLike[str]) -> torch.nn.Module:
        from lantern.drafters.released import load_chameleon_drafter

        drafter = load_chameleon_drafter(path, self.model, self.layout)
        return drafter.to(self.device, drafter_dtype(self.dtype, self.device)).eval()

    def draft_backend(self, drafter: torch.nn.Module, head: CodeHead, sampling: SamplingConfig,
                      target: Target, slots: int, compile: str | None = None,
                      cache_pool: CachePool | None = None) -> DraftBackend:
        """LANTERN's released drafters read the whole model sequence (row-end tokens included) through
        the target (static shapes where the target has them: compiled or deterministic); lantern's
        EAGLE drafters the image prefix's features, like LlamaGen's."""
        if isinstance(drafter, ReleasedChameleonDrafter):
            from lantern.drafters.released import ReleasedDrafterBackend

            assert isinstance(target, ChameleonTarget)
            return ReleasedDrafterBackend(drafter, head, sampling, target, 2 * slots)
        return eagle_backend(drafter, head, sampling, target, self.layout, slots, compile, cache_pool)

    @torch.no_grad()
    def decode(self, codes: Tensor) -> Tensor:
        return self.vq.decode_grid(codes.to(self.device), self.layout.height, self.layout.width)

    def to_pil(self, codes: Tensor) -> list[Image.Image]:
        from lantern.images import to_pil

        return to_pil(self.decode(codes), "truncate")  # as Chameleon's _pil_from_chw_tensor


def find_vq(root: Path, vq: str | os.PathLike[str] | None) -> Path:
    if vq is not None:
        path = Path(vq)
        if path.is_dir():  # a folder (e.g. a Hub snapshot) holding the checkpoint
            path = next((path / name for name in VQ_NAMES if (path / name).is_file()), path)
        check(path.is_file(), f"--vq: no such file {path} (the Chameleon VQGAN checkpoint, vqgan.ckpt)")
        return path
    for name in VQ_NAMES:
        if (root / name).is_file():
            return root / name
    raise LanternError(
        f"--model {root} holds no {' or '.join(VQ_NAMES)}: pass --vq PATH (vqgan.ckpt from the Chameleon release, "
        "with vqgan.yaml beside it)"
    )


def load_chameleon_stack(
    model: str | os.PathLike[str],
    layout: ImageLayout,
    vq: str | os.PathLike[str] | None = None,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
) -> ChameleonStack:
    from lantern.models.chameleon import check_chameleon_folder, load_chameleon
    from lantern.models.chameleon_vq import ChameleonVQGAN

    root = Path(model)
    check_chameleon_folder(root)  # the folder's files, before any of them is read (a drafter's folder too)
    vq_path = find_vq(root, vq)  # checked before the (large) target is read
    tokenizer = load_prompt_tokenizer(root)
    lm = load_chameleon(root, dtype=dtype, device=device)
    vq_model = ChameleonVQGAN.from_checkpoint(vq_path).to(device).eval()
    codes = vq_model.codebook().shape[0]
    check(codes == lm.num_codes, f"--vq {vq_path} has {codes} codes, the target's image vocabulary {lm.num_codes}")
    vocab = lm.config.vocab_size
    special = (*layout.prefix, *layout.uncond, *([layout.eol] if layout.eol is not None else []))
    past = [t for t in special if t >= vocab]  # Lumina-mGPT's grid tokens grow with the image size
    height, width = layout.pixel_size
    size = f"--image-size {height}" + (f" --image-width {width}" if width != height else "")
    check(not past, f"{size}: the layout's token {past[0] if past else 0} (its image size and grid) is past this "
                    f"model's vocabulary ({vocab} tokens); use a smaller size")
    return ChameleonStack(root=root, model=lm, layout=layout, vq=vq_model, tokenizer=tokenizer)


def load_prompt_tokenizer(root: Path, family: str = "Chameleon") -> Any:
    """The folder's own prompt tokenizer (Chameleon-family and Janus folders), never its code."""
    try:
        from transformers import AutoTokenizer
    except ImportError as e:  # pragma: no cover
        raise LanternError(f"{family} targets need transformers: pip install 'lantern-ar[t2i]'") from e
    try:
        # trust_remote_code=False: a folder whose config asks for its own code (auto_map) is refused
        # at once; left unset, transformers asks on the terminal whether to run that code.
        tokenizer = AutoTokenizer.from_pretrained(str(root), trust_remote_code=False)
    except TRANSFORMERS_LOAD_ERRORS as e:
        if not (root / "tokenizer.json").is_file():  # the cause; transformers' text would only bury it
            raise LanternError(f"--model {root}: no tokenizer for the prompts (expected tokenizer.json in the "
                               "folder)") from None
        raise LanternError(f"--model {root}: no usable tokenizer (tokenizer.json) for the prompts: "
                           f"{transformers_reason(e)}") from None
    # With no tokenizer file at all transformers still returns a tokenizer (the config's class,
    # e.g. GPT-2's, with an empty vocabulary) that turns every prompt into nothing.
    own = [name for name in dict.fromkeys(getattr(tokenizer, "vocab_files_names", {}).values())
           if name != "tokenizer.json"]
    check((root / "tokenizer.json").is_file() or (bool(own) and all((root / name).is_file() for name in own)),
          f"--model {root}: no tokenizer for the prompts (expected tokenizer.json"
          f"{', or ' + ' and '.join(own) if own else ''} in the folder)")
    return tokenizer


def init_chameleon_drafter(model: ChameleonLM | JanusLM, layout: ImageLayout, seed: int = 0) -> EagleDrafterModel:
    """A fresh drafter whose token embedding is the target's embedding of each code (EAGLE's start):
    ``model.embed`` of the code's model id, so a Janus model's codes start from its generation
    embedding and aligner, as its own input path embeds them."""
    torch.manual_seed(seed)
    drafter = EagleDrafterModel(chameleon_drafter_config(model, layout))
    with torch.no_grad():
        codes = torch.arange(model.num_codes, device=model.device)
        drafter.embed_tokens.weight.copy_(model.embed(model.code_to_bpe(codes)[None])[0].float())
    return drafter


def eagle_backend(drafter: torch.nn.Module, head: CodeHead, sampling: SamplingConfig, target: Target,
                  layout: ImageLayout, slots: int, compile: str | None, cache_pool: CachePool | None) -> EagleBackend:
    """lantern's EAGLE backend for a target on the Chameleon adapter (Chameleon, Janus, Emu3): its
    cache holds the image prefix's features, every code's and one round's drafts."""
    assert isinstance(drafter, EagleDrafterModel)
    context = len(layout.prefix) + layout.num_tokens + slots
    return EagleBackend(drafter, head, sampling, target.streams, context, compile=compile, cache_pool=cache_pool)
