"""Calibration: run a probe tree and record the accepted ranks."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from lantern.autotree.model import DEFAULT_PROBE_WIDTHS, SPECULATIVE_METHODS, AcceptanceModel, Choice, RoundRecord
from lantern.decoding.config import SamplingConfig, TreeConfig
from lantern.decoding.loop import Acceptance, Drafter, DraftTree, GenerationOutput, Target, generate
from lantern.decoding.pjd import GridJacobiDrafter
from lantern.decoding.rng import RowRandom
from lantern.decoding.trees import probe_choices
from lantern.errors import check
from lantern.methods import MethodConfig, resolve_method
from lantern.parts import ModelParts
from lantern.run import image_seed, prepare_method
from lantern.targets.base import Stack


class RecordingDrafter:
    """Wraps the loop's drafter and records, per round and row, the ranks of the accepted path.

    The loop is not changed: ``commit`` receives ``next_tokens`` = the accepted drafts, then the
    next token, and ``num_new`` = accepted + 1. Static trees draw siblings without replacement
    (distinct tokens), so the accepted child at each depth is the unique child of the previous
    accepted node whose token matches; its rank is its position among the node's children
    (children are stored in sibling order). Works for any batch size; rows that are finished
    (``num_new == 0``) record nothing.
    """

    def __init__(self, inner: Drafter) -> None:
        self.inner = inner
        self.records: list[RoundRecord] = []
        self._last: tuple[Tensor, Tensor, Tensor] | None = None  # tokens, children, depth caps (CPU)

    @property
    def forwards(self) -> int:
        return int(self.inner.forwards)

    def start(self, hidden: Tensor, root: Tensor) -> None:
        self.inner.start(hidden, root)

    def propose(self, rng: RowRandom | None, active: Tensor, max_depth: Tensor) -> DraftTree:
        tree = self.inner.propose(rng, active, max_depth)
        self._last = (tree.tokens.cpu(), tree.buffers.children.cpu(), max_depth.cpu())
        return tree

    def commit(self, hidden: Tensor, next_tokens: Tensor, num_new: Tensor) -> None:
        assert self._last is not None, "commit before propose"
        tokens, children, caps = self._last
        nxt, new = next_tokens.cpu(), num_new.cpu()
        for b in range(tokens.shape[0]):
            if int(new[b]) > 0:
                self.records.append(RoundRecord(_accepted_ranks(tokens[b], children[b], nxt[b], int(new[b]) - 1),
                                                int(caps[b])))
        self.inner.commit(hidden, next_tokens, num_new)


def _accepted_ranks(tokens: Tensor, children: Tensor, next_tokens: Tensor, num_accepted: int) -> Choice:
    """Follow the accepted drafts down the tree: tokens [T], children [T, C], next_tokens [A]."""
    node, ranks = 0, []
    for j in range(num_accepted):
        kids = children[node]
        match = ((kids >= 0) & (tokens[kids.clamp(min=0)] == next_tokens[j])).nonzero().flatten()
        if match.numel() != 1:
            raise RuntimeError(f"accepted draft {j} matches {match.numel()} children of node {node}; "
                               "expected exactly one (siblings are distinct samples)")
        ranks.append(int(match[0]))
        node = int(kids[match[0]])
    return tuple(ranks)


def probe_tree(num_tokens: int, widths: Sequence[int] = DEFAULT_PROBE_WIDTHS) -> tuple[TreeConfig, list[list[int]]]:
    """The probe tree (``static:probe_<hash>``), no deeper than the image allows."""
    check(num_tokens >= 2, f"calibration needs an image of >= 2 tokens, got {num_tokens}")
    choices = probe_choices(list(widths)[: num_tokens - 1])
    return TreeConfig.from_choices(choices, prefix="probe"), choices


def record_rounds(
    target: Target,
    drafter: Drafter,
    cond: Tensor,
    generators: list[torch.Generator] | None,
    acceptance: Acceptance | None = None,
    cond_mask: Tensor | None = None,
) -> tuple[list[RoundRecord], GenerationOutput]:
    """Run one ``generate`` with ``drafter`` wrapped in a :class:`RecordingDrafter`."""
    recorder = RecordingDrafter(drafter)
    out = generate(target, cond, generators=generators, drafter=recorder, acceptance=acceptance, cond_mask=cond_mask)
    return recorder.records, out


def calibration_labels(num_classes: int, count: int = 4) -> list[int]:
    """``count`` labels spread over the classes (0 and evenly spaced ones)."""
    count = max(1, min(count, num_classes))
    return [i * num_classes // count for i in range(count)]


def _calibration_conditions(stack: Stack, count: int = 4) -> list[Any]:
    """Calibration conditions: labels spread over the classes, or the stack's measurement prompts."""
    return calibration_labels(stack.num_classes, count) if stack.num_classes else stack.sample_conditions(count)


# Calibration images use seeds of image indices from here on, so they never repeat the seeds of
# the images a run then generates (image_seed(seed, 0..N-1)).
CALIBRATION_SEED_OFFSET = 1_000_000


def calibrate(
    stack: Stack,
    method: str | MethodConfig,
    sampling: SamplingConfig,
    *,
    labels: Sequence[Any] | None = None,
    seed: int = 0,
    batch_size: int = 1,
    widths: Sequence[int] = DEFAULT_PROBE_WIDTHS,
    parts: ModelParts | None = None,
    progress: bool = False,
) -> AcceptanceModel:
    """Generate a few images with the method's acceptance rule and a probe tree; estimate a[d][r].

    ``method`` is a method name or a resolved :class:`lantern.methods.MethodConfig`; only its
    acceptance rule (and relaxation parameters) matter, its tree is replaced by the probe.
    ``parts``: the loaded drafter and proximity table (default: the stack's own, read now).
    """
    from tqdm.auto import tqdm

    from lantern.decoding.sampling import make_generators

    method_cfg = _method_config(method)
    labels = list(labels) if labels is not None else _calibration_conditions(stack)
    check(len(labels) >= 1, "calibration needs at least one label")
    tree, choices = probe_tree(stack.num_tokens, widths)
    prepared = prepare_method(stack, replace(method_cfg, tree=tree), sampling, parts)
    conditions = stack.encode(labels)
    records: list[RoundRecord] = []
    for lo in tqdm(range(0, len(labels), batch_size), desc=f"calibrate {method_cfg.method}", disable=not progress,
                   leave=False):
        chunk = conditions.rows(lo, lo + batch_size)
        gens = make_generators([image_seed(seed, CALIBRATION_SEED_OFFSET + i) for i in range(lo, lo + len(chunk))],
                               stack.device)
        assert prepared.drafter is not None
        target, drafter = prepared.parts()
        # a tree-drafting method (_method_config), never PJD's grid
        assert drafter is not None and not isinstance(drafter, GridJacobiDrafter)
        got, _ = record_rounds(target, drafter, chunk.cond, None if sampling.greedy else gens, prepared.acceptance,
                               chunk.mask)
        records.extend(got)
    return AcceptanceModel.from_records(records, choices, method=method_cfg.method)


def _method_config(method: str | MethodConfig) -> MethodConfig:
    if isinstance(method, MethodConfig):
        cfg = method
    else:
        check(isinstance(method, str), f"method must be a name or a MethodConfig, got {type(method).__name__}")
        check(method in SPECULATIVE_METHODS,
              f"--tree auto needs a speculative --method ({', '.join(SPECULATIVE_METHODS)}), got {method!r}")
        cfg = resolve_method(method)
    check(cfg.method in SPECULATIVE_METHODS,
          f"--tree auto needs a speculative --method ({', '.join(SPECULATIVE_METHODS)}), got {cfg.method!r}")
    return cfg
