"""A model's optional parts, each read from disk at most once: the EAGLE drafter, the latent
proximity table and the T5 prompt encoder.

A :class:`ModelParts` holds where each part comes from (a path, a loaded object, or the stack's
own ``drafter/`` / ``proximity.safetensors`` / ``t5/``) and loads it on first need. Everything that
prepares a method (``lantern.run.prepare_method``, ``--tree auto``'s profile and calibration, the
bench) takes one of these instead of paths, so one process reads each part once however many
methods, trees or calls use it (diffusers' pipelines hold their components the same way).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from lantern.errors import check
from lantern.models.invariant import follow_batch_invariance

if TYPE_CHECKING:
    from lantern.targets.base import Conditions, PackedConditions, Stack
    from lantern.targets.llamagen_stack import ModelStack
    from lantern.targets.proximity import ProximityTable
    from lantern.targets.text import T5Encoder

PathLike = str | os.PathLike[str]


class ModelParts:
    """The drafter, proximity table and T5 encoder of one stack, loaded lazily and kept.

    ``drafter``: a folder (read with ``stack.load_drafter``) or a loaded module (placed on the
    stack's device in the drafter's dtype); None: the stack's own ``drafter/``. ``proximity`` and
    ``t5``: a file / folder, None for the stack's own. Loads are serialised by a lock, so two
    threads (a server's request and decode threads) never read a part twice."""

    def __init__(self, stack: Stack, drafter: PathLike | torch.nn.Module | None = None,
                 proximity: PathLike | None = None, t5: PathLike | None = None) -> None:
        self.stack = stack
        self._drafter: torch.nn.Module | None = None
        self._drafter_path: str | None = None
        if isinstance(drafter, torch.nn.Module):
            self._drafter = _placed(stack, drafter)
        elif drafter is not None:
            self._drafter_path = str(drafter)
        self._proximity_path = None if proximity is None else str(proximity)
        self._t5_path = None if t5 is None else str(t5)
        self._table: ProximityTable | None = None
        self._t5: T5Encoder | None = None
        self._lock = threading.Lock()

    # -- where each part comes from ------------------------------------------------------------

    @property
    def drafter_source(self) -> str | None:
        """The drafter's folder (given, else the stack's), or None (none, or given loaded)."""
        path = self._drafter_path or self.stack.drafter_dir
        return None if path is None else str(path)

    @property
    def proximity_source(self) -> str | None:
        path = self._proximity_path or self.stack.proximity_file
        return None if path is None else str(path)

    @property
    def has_drafter(self) -> bool:
        return self._drafter is not None or self.drafter_source is not None

    @property
    def has_table(self) -> bool:
        return self.proximity_source is not None

    # -- the parts, loaded on first use ----------------------------------------------------------

    def drafter(self, method: str = "sd") -> torch.nn.Module:
        """The drafter on the stack's device, read once; ``method`` names the refusal when there is none."""
        with self._lock:
            if self._drafter is None:
                refusal = getattr(self.stack, "DRAFTER_REFUSAL", None)  # a family without drafters
                check(refusal is None, f"--method {method}: {refusal}")
                path = self.drafter_source
                check(path is not None,
                      f"--method {method} needs a drafter: pass --drafter DIR (the model folder has none)")
                assert path is not None
                self._drafter = self.stack.load_drafter(path)
            return self._drafter

    def table(self, method: str = "lantern") -> ProximityTable:
        """The proximity table, read once and checked against the stack's codebook once."""
        with self._lock:
            if self._table is None:
                path = self.proximity_source
                check(path is not None,
                      f"--method {method} needs a latent proximity table: pass --proximity FILE "
                      "(build one with `lantern build-proximity`)")
                assert path is not None
                from lantern.targets.proximity import ProximityTable

                table = ProximityTable.load(path)
                codebook = self.stack.codebook()
                if codebook is not None:
                    table.validate(codebook)
                self._table = table
            return self._table

    def _text_stack(self) -> ModelStack:
        """The stack, where it encodes prompts through T5: text-to-image stacks are LlamaGen's."""
        return cast("ModelStack", self.stack)

    def t5_dir(self) -> Path:
        """The T5 folder of a text-to-image stack, checked without loading it."""
        return Path(self._text_stack().t5_folder(self._t5_path))

    def t5(self) -> T5Encoder:
        """The T5 prompt encoder of a text-to-image stack, read once and kept (flan-t5-xl's encoder
        is larger than GPT-XL: the price of not reading it again per call)."""
        with self._lock:
            if self._t5 is None:
                from lantern.targets.text import load_t5

                stack = self._text_stack()
                cfg = stack.target.config
                self._t5 = load_t5(self.t5_dir(), cfg.cls_token_num, stack.device, stack.dtype, cfg.caption_dim)
                # a deterministic target's captions must not depend on the prompts encoded beside them
                follow_batch_invariance(self._t5.model, stack.network())
            return self._t5

    def encode(self, conditions: list[Any], repeats: int = 1, batch_size: int = 8,
               progress: bool = False, negative: str | list[str] | None = None) -> PackedConditions:
        """The conditions of a request (each ``repeats`` times in a row), packed on the host
        (:class:`~lantern.targets.base.PackedConditions`): ``stack.encode``, with this T5 encoder for
        the prompts of a text-to-image stack, ``batch_size`` prompts at a time (``progress``: a bar),
        each batch packed before the next is encoded. ``negative``: a negative prompt, one for all
        or one per condition (models that guide with a prompt: Emu3)."""
        from lantern.targets.base import PackedConditions, check_condition_kind, negative_prompts

        if self.stack.kind != "t2i":
            return PackedConditions.pack([self.stack.encode(conditions, 1, batch_size, negative=negative)], repeats)
        self.stack.negative_rows(negative_prompts(negative, len(conditions)), len(conditions), 1)  # refused
        prompts = check_condition_kind(conditions, str, self.stack.root)
        return PackedConditions.pack(self._captions(prompts, batch_size, progress), repeats)

    def _captions(self, prompts: list[str], batch_size: int, progress: bool) -> Iterator[Conditions]:
        """The prompts' T5 captions as the stack's conditions, ``batch_size`` prompts at a time."""
        from tqdm.auto import tqdm

        encoder = self.t5()
        with tqdm(total=len(prompts), desc="encoding prompts", unit="prompt",
                  disable=not progress or len(prompts) <= batch_size) as bar:
            for lo in range(0, len(prompts), batch_size):
                chunk = prompts[lo : lo + batch_size]
                yield self._text_stack().from_captions(encoder.encode(chunk, batch_size))
                bar.update(len(chunk))


def _placed(stack: Stack, drafter: torch.nn.Module) -> torch.nn.Module:
    """A drafter given loaded, on the stack's device in the precision drafters run in."""
    from lantern.drafters.checks import drafter_dtype

    return drafter.to(stack.device, drafter_dtype(stack.dtype, stack.device)).eval()


def parts_of(stack: Stack, parts: ModelParts | None) -> ModelParts:
    """``parts``, or the stack's own (its drafter/ and proximity table, loaded on first need)."""
    if parts is None:
        return ModelParts(stack)
    check(parts.stack is stack, "the model parts belong to another stack")
    return parts
