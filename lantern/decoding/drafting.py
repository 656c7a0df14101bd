"""Drafting: build a tree of proposals per row from a backend that scores tree nodes.

The tree logic (chain / static EAGLE-1 [EAGLE] / dynamic [EAGLE-2]) lives in
:class:`TreeDrafter` and is written once. What scores a node is a :class:`DraftBackend`: the EAGLE
drafter (:class:`EagleBackend`), or, in tests, an oracle that runs the target itself.

Backends see *fed* nodes: each call to ``feed`` appends E nodes per row, numbered consecutively;
a node names its parent by feed number (-1 = the root) and its ancestors by a mask over earlier
feed numbers. Drafter K/V written while drafting are never committed, so nothing has to be rolled
back: the next round's context pass overwrites them.

Randomness: static trees sample each node's m children without replacement, one after another
by inverse CDF (draw from q, remove the drawn token, draw from the rest): the same law as EAGLE's
Gumbel-top-k race, for m uniforms per node instead of V exponentials. Every row draws the same
count per round (``TreeConfig``-fixed) from its own stream (``lantern.decoding.rng``) whatever its
batch-mates do, so its codes are independent of the batch.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from lantern.decoding.config import SamplingConfig, TreeConfig
from lantern.decoding.loop import CodeHead, DraftTree
from lantern.decoding.phases import phase
from lantern.decoding.rng import RowRandom
from lantern.decoding.sampling import apply_cfg, one_hot, probs_from_logits, process_logits, sample_from_probs
from lantern.decoding.trees import (
    StaticTree,
    TreeBuffers,
    dynamic_tree_select,
    static_tree,
    tree_from_parents,
)
from lantern.errors import check


class DraftBackend(Protocol):
    @property
    def forwards(self) -> int | Tensor: ...  # read-only to TreeDrafter: an int or a device counter

    def start(self, hidden: Tensor, root: Tensor, path_width: int | None = None) -> None:
        """path_width: the width of every round's commit (a backend may pad its first context to it)."""
        ...

    def commit(self, hidden: Tensor, next_tokens: Tensor, num_new: Tensor) -> None: ...

    def begin(self) -> Tensor:
        """Absorb the committed context; return guided logits at the root [B, V]."""
        ...

    def feed(self, parent: Tensor, tokens: Tensor, depth: int, ancestors: Tensor) -> Tensor:
        """parent [B, E] feed index (-1 = root), tokens [B, E], depth (1 = children of the root),
        ancestors [B, E, F_prev] bool over earlier fed nodes. Returns guided logits [B, E, V]."""
        ...


@dataclass(frozen=True)
class _LevelPlan:
    """What the drafter does at one level of a static tree (see :meth:`TreeDrafter._level_plans`)."""

    nodes: Tensor  # [E] nodes expanded at this level (depth d)
    parent_feed: Tensor  # [E] feed index of each node's parent (-1 = root); empty at level 0
    ancestors: Tensor  # [E, F_prev] bool: which earlier fed nodes are each node's ancestors
    children: Tensor  # [C] nodes at depth d + 1
    child_rows: Tensor  # [C] row of each child's parent within ``nodes``
    child_ranks: Tensor  # [C] sibling rank of each child = column of its draw
    num_samples: int  # draws per expanded node


# Static trees' schedules and buffers depend only on the tree (and batch size / device): built once
# per process, not per image (building them costs host syncs: sizes, nonzero). Tree names are
# unique per shape (other trees are named by their hash), so the name is the key.
_SHARED_PLANS: dict[tuple[str, str], list[_LevelPlan | None]] = {}
_SHARED_BUFFERS: dict[tuple[str, int, str], TreeBuffers] = {}


@functools.cache
def _static_tree_of(tree: TreeConfig) -> StaticTree:
    return static_tree(tree.fixed_choices())


class TreeDrafter:
    """Implements the loop's ``Drafter`` protocol for chain, static and dynamic trees."""

    def __init__(
        self,
        backend: DraftBackend,
        tree: TreeConfig,
        sampling: SamplingConfig,
        vocab_size: int,
    ) -> None:
        check(tree.kind != "none", "a drafter needs a tree (chain, static or dynamic)")
        if tree.kind == "dynamic":
            check(
                tree.top_k <= vocab_size,
                f"tree top_k ({tree.top_k}) is larger than the vocabulary ({vocab_size})",
            )
        self.backend, self.tree, self.sampling, self.vocab_size = backend, tree, sampling, vocab_size
        self.static: StaticTree | None = None
        if tree.kind in ("static", "chain"):
            self.static = _static_tree_of(tree)
        self.root: Tensor | None = None
        self._static_buffers: TreeBuffers | None = None
        self._plans: tuple[torch.device, list[_LevelPlan | None]] | None = None

    @property
    def forwards(self) -> int | Tensor:
        return self.backend.forwards

    @property
    def num_nodes(self) -> int:
        """Tree size including the root (what the target cache must hold per round)."""
        return self.tree.num_nodes

    @property
    def max_depth(self) -> int:
        return self.tree.max_depth

    def start(self, hidden: Tensor, root: Tensor) -> None:
        # A copy: the loop holds ``root`` too, and a compiled round must not see the two aliased in
        # its first round only (dynamo guards on aliasing: that would be a second graph).
        self.root = root.clone()
        self.backend.start(hidden, root, path_width=self.tree.max_depth + 1)
        if self.static is not None:  # schedules and buffers cost host syncs: built here, not in a round
            self._level_plans(root.device)
            self._static_batch(root.shape[0], root.device)

    def row_tensors(self) -> list[tuple[Tensor | None, int, int]]:
        """Per-row state (``lantern.decoding.rows``): the pending root, then the backend's, if it lists it."""
        backend = self.backend.row_tensors() if hasattr(self.backend, "row_tensors") else None
        check(backend is not None, f"{type(self.backend).__name__} cannot move decode rows")
        assert backend is not None
        return [(self.root, 1, 0), *backend]

    def commit(self, hidden: Tensor, next_tokens: Tensor, num_new: Tensor) -> None:
        last = next_tokens.gather(1, (num_new - 1).clamp(min=0)[:, None])[:, 0]
        assert self.root is not None
        self.root.copy_(torch.where(num_new > 0, last, self.root))  # in place: round state keeps its address
        self.backend.commit(hidden, next_tokens, num_new)

    def propose(self, rng: RowRandom | None, active: Tensor, max_depth: Tensor) -> DraftTree:
        assert self.root is not None
        root_logits = self.backend.begin()  # [B, V]
        if self.static is None:
            return self._dynamic(root_logits)
        return self._static(root_logits, rng)

    # -- static trees (EAGLE-1 / LANTERN++), chains ------------------------------------------------

    def _static(self, root_logits: Tensor, rng: RowRandom | None) -> DraftTree:
        """Unrolled level by level (a Python loop over the tree's static levels: under a compiled
        round every level's feed and draws land in the one graph)."""
        st = self.static
        assert st is not None and self.root is not None
        b, t, v = root_logits.shape[0], st.num_nodes, root_logits.shape[-1]
        device = root_logits.device
        tokens = torch.zeros(b, t, dtype=torch.long, device=device)
        tokens[:, 0] = self.root
        sampled = not self.sampling.greedy
        q_draft = torch.zeros(b, t, v, device=device) if sampled else None
        plans = self._level_plans(device)
        with phase("draft_sampling"):  # one fixed count per row and round: sum over levels of E * m
            u = rng.uniform(sum(p.nodes.shape[0] * p.num_samples for p in plans if p is not None)) \
                if sampled and rng is not None else None
        offset = 0
        for d, plan in enumerate(plans):
            if plan is None:
                continue
            if d == 0:
                logits = root_logits[:, None]  # [B, 1, V] the root is expanded from the context
            else:
                parent = plan.parent_feed[None].expand(b, -1)
                anc = plan.ancestors[None].expand(b, -1, -1)
                logits = self.backend.feed(parent, tokens[:, plan.nodes], d, anc)
            e, m = plan.nodes.shape[0], plan.num_samples
            with phase("draft_sampling"):
                level_u = None if u is None else u[:, offset : offset + e * m].view(b, e, m)
                offset += e * m
                q, draws = _draw_level(logits, level_u, self.sampling, m)
                if q_draft is not None:
                    assert q is not None  # sampled: the loop has an rng then, so _draw_level drew from q
                    q_draft[:, plan.nodes] = q
                tokens[:, plan.children] = draws[:, plan.child_rows, plan.child_ranks]
        with phase("tree"):
            buffers = self._static_batch(b, device)
        return DraftTree(tokens=tokens, buffers=buffers, q_draft=q_draft)

    def _level_plans(self, device: torch.device) -> list[_LevelPlan | None]:
        """The static tree's drafting schedule, level by level; the same every round, so built once
        (per device) instead of re-deriving feed indices and ancestor masks in the hot loop."""
        if self._plans is not None and self._plans[0] == device:
            return self._plans[1]
        key = (self.tree.choices_name, str(device))
        if key in _SHARED_PLANS:  # built by an earlier image's drafter: no per-image syncs
            self._plans = (device, _SHARED_PLANS[key])
            return self._plans[1]
        st = self.static
        assert st is not None
        feed_of = torch.full((st.num_nodes,), -1, dtype=torch.long)  # node -> feed index
        fed: list[int] = []  # node ids in feed order
        plans: list[_LevelPlan | None] = []
        for d, nodes in enumerate(st.expand_levels):
            nodes = nodes.cpu()
            if nodes.numel() == 0:
                plans.append(None)
                continue
            parent_feed = torch.zeros(0, dtype=torch.long)
            ancestors = torch.zeros(len(nodes), 0, dtype=torch.bool)
            if d > 0:
                parent_feed = feed_of[st.parents[nodes].cpu()]
                ancestors = st.buffers.mask[0].cpu()[nodes][:, fed]
                feed_of[nodes] = torch.arange(len(fed), len(fed) + len(nodes))
                fed.extend(nodes.tolist())
            children = (st.depth.cpu() == d + 1).nonzero().flatten()
            plans.append(
                _LevelPlan(
                    nodes=nodes.to(device),
                    parent_feed=parent_feed.to(device),
                    ancestors=ancestors.to(device),
                    children=children.to(device),
                    child_rows=st.sample_row.cpu()[children].to(device),
                    child_ranks=st.rank.cpu()[children].to(device),
                    num_samples=st.num_samples[d],
                )
            )
        self._plans = (device, plans)
        _SHARED_PLANS[key] = plans
        return plans

    def _static_batch(self, b: int, device: torch.device) -> TreeBuffers:
        cached = self._static_buffers
        if cached is None or cached.parents.shape[0] != b:
            assert self.static is not None
            key = (self.tree.choices_name, b, str(device))
            if key not in _SHARED_BUFFERS:
                parents = self.static.parents.to(device)[None].expand(b, -1).contiguous()
                _SHARED_BUFFERS[key] = tree_from_parents(parents)
            cached = self._static_buffers = _SHARED_BUFFERS[key]
        return cached

    # -- dynamic trees (EAGLE-2 / LANTERN) --------------------------------------------------------

    def _dynamic(self, root_logits: Tensor) -> DraftTree:
        """[EAGLE-2] ([LANTERN code]): expand the top_k frontier ``depth`` times by cumulative log q, then
        keep the ``total_tokens`` best nodes. Drafts are deterministic (q = point mass)."""
        assert self.root is not None
        k, depth = self.tree.top_k, self.tree.depth
        b, device = root_logits.shape[0], root_logits.device
        score, tok = self._log_q(root_logits).topk(k, dim=-1)  # [B, K] level 1
        all_scores, all_tokens = [score], [tok]
        all_parents = [torch.zeros(b, k, dtype=torch.long, device=device)]  # flat parent + 1; 0 = root
        flat = torch.arange(k, device=device).expand(b, -1)  # [B, K] flat index of the frontier
        feed_parent = torch.full((b, k), -1, dtype=torch.long, device=device)  # -1 = root
        ancestors = torch.zeros(b, k, 0, dtype=torch.bool, device=device)  # over fed nodes
        for i in range(depth):
            logits = self.backend.feed(feed_parent, tok, i + 1, ancestors)  # frontier = fed i*K..
            child_score, child_tok = self._log_q(logits).topk(k, dim=-1)  # [B, K, K]
            cum = (score[:, :, None] + child_score).flatten(1)  # [B, K*K] cumulative log q
            all_scores.append(cum)
            all_tokens.append(child_tok.flatten(1))
            all_parents.append((flat + 1).repeat_interleave(k, dim=1))
            if i == depth - 1:
                break
            # The next frontier: the K best children by cumulative score.
            score, best = cum.topk(k, dim=-1)  # [B, K]
            pj = best // k  # index of the parent within the current frontier
            tok = child_tok.flatten(1).gather(1, best)
            flat = k + i * k * k + best
            grow = one_hot(i * k + pj, (i + 1) * k, torch.bool)  # the parent itself
            inherited = ancestors.gather(1, pj[:, :, None].expand(-1, -1, ancestors.shape[2]))
            ancestors = torch.cat([inherited, torch.zeros(b, k, k, dtype=torch.bool, device=device)], 2) | grow
            feed_parent = i * k + pj
        scores, tokens_flat, parent_flat = torch.cat(all_scores, 1), torch.cat(all_tokens, 1), torch.cat(all_parents, 1)
        total = min(self.tree.total_tokens, scores.shape[1])
        with phase("tree"):
            sel, parents = dynamic_tree_select(scores, parent_flat, total)
            tokens = torch.cat([self.root[:, None], tokens_flat.gather(1, sel)], dim=1)
            # Static sizes (no sync): depth <= depth + 1, at most top_k children, at most total leaves,
            # and at most k * k nodes at one depth (k expanded nodes, k children each).
            buffers = tree_from_parents(parents, bounds=(depth + 1, min(k, total), total, min(k * k, total)))
        return DraftTree(tokens=tokens, buffers=buffers, q_draft=None)

    def _log_q(self, logits: Tensor) -> Tensor:
        return torch.log_softmax(process_logits(logits.float(), self.sampling), dim=-1)


def _draw_level(
    logits: Tensor, u: Tensor | None, sampling: SamplingConfig, num_samples: int
) -> tuple[Tensor | None, Tensor]:
    """One level's draws: q [B, E, V] (None for greedy) and the children's tokens [B, E, m],
    sampled from q without replacement in draw order (draw r by inverse CDF with uniform
    ``u[..., r]`` from q with draws 0..r-1 removed: the law of EAGLE's Gumbel-top-k race);
    greedy drafts are the top-m logits."""
    if u is None:
        return None, logits.topk(num_samples, dim=-1).indices
    q = probs_from_logits(logits, sampling)
    b, e, v = q.shape
    rest = q.reshape(b * e, v)
    draws = []
    for r in range(num_samples):
        x = sample_from_probs(rest, u[:, :, r].reshape(-1))  # [B*E]
        draws.append(x.view(b, e))
        if r + 1 < num_samples:
            rest = rest.scatter(1, x[:, None], 0.0)
    return q, torch.stack(draws, dim=-1)


def guided_logits(lm_head: CodeHead, hidden: Tensor, cfg_scale: float, streams: int) -> Tensor:
    """``lm_head`` of ``hidden`` in float32, classifier-free guided over ``streams`` (:func:`apply_cfg`)."""
    return apply_cfg(lm_head(hidden.to(lm_head.weight.dtype)).float(), cfg_scale, streams)


