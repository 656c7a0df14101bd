"""Draft-tree shapes and the index buffers that tree verification needs.

A draft tree is stored as a parent array: node 0 is the root (the token the target has already
sampled), and every other node's parent has a smaller index. Everything the decoding loop needs,
the attention mask, the rotary depth, the children lists and the root-to-leaf paths, is derived
from that array by :func:`tree_from_parents`, so static trees (EAGLE-1, LANTERN++) and dynamic
trees (EAGLE-2, LANTERN) share one code path.

Static trees are named lists of "choices" ([LANTERN code] choices.py): a node is the list of sibling ranks from the
root, ``[a, b]`` being the b-th child of the root's a-th child. :func:`static_tree` turns one into
the target-side buffers plus the drafter-side schedule (which nodes to expand at each level and
where each drawn sample lands). :func:`dynamic_tree_select` is the pure selection step of the
EAGLE-2 builder ([EAGLE-2]; [LANTERN code] topK_genrate).

Pure functions of the tree: no model code lives here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

import torch
from torch import Tensor

from lantern.errors import LanternError, check

# Named static trees, the lists of the official choices.py ([LANTERN code] models/drafters/choices.py).
_NAMED_TREES: dict[str, list[list[int]]] = {
    "mc_sim_7b_63": [
        [0], [1], [2], [3], [0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [2, 0], [2, 1], [3, 0],
        [0, 0, 0], [0, 0, 1], [0, 0, 2], [0, 1, 0], [0, 1, 1], [0, 2, 0], [0, 2, 1], [1, 0, 0],
        [0, 0, 0, 0], [0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 0, 0, 0], [0, 0, 0, 0, 1],
    ],
    "mc_sim_7b_63_balanced": [
        [0], [1], [2], [0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [1, 2], [2, 0], [2, 1],
        [0, 0, 0], [0, 0, 1], [0, 0, 2], [0, 1, 0], [0, 1, 1], [1, 0, 0], [1, 0, 1], [1, 1, 0],
        [1, 1, 1], [0, 0, 0, 0], [0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 0, 0, 0], [0, 0, 0, 0, 1],
    ],
    "naive_extend_57": [
        [0], [1], [2], [3], [4],
        [0, 0], [0, 1], [0, 2], [0, 3], [1, 0], [1, 1], [1, 2], [2, 0], [2, 1], [2, 2], [3, 0],
        [3, 1], [4, 0],
        [0, 0, 0], [0, 0, 1], [0, 0, 2], [0, 0, 3], [0, 1, 0], [0, 1, 1], [0, 1, 2], [0, 2, 0],
        [0, 2, 1], [0, 2, 2], [0, 3, 0], [0, 3, 1], [1, 0, 0], [1, 0, 1], [1, 1, 0], [2, 0, 0],
        [0, 0, 0, 0], [0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 0, 3], [0, 0, 1, 0], [0, 0, 1, 1],
        [0, 0, 1, 2], [0, 0, 2, 0], [0, 0, 2, 1], [0, 0, 3, 0], [0, 1, 0, 0], [0, 1, 0, 1],
        [0, 1, 1, 0], [0, 2, 0, 0],
        [0, 0, 0, 0, 0], [0, 0, 0, 0, 1], [0, 0, 0, 0, 2], [0, 0, 0, 1, 0], [0, 0, 0, 1, 1],
        [0, 0, 1, 0, 0], [0, 0, 1, 0, 1], [0, 0, 1, 1, 0], [0, 0, 2, 0, 0],
    ],
    "medusa_2_7b_63": [  # 10, 23, 23 and 7 nodes a level
        [0], [1], [2], [3], [4], [5], [6], [7], [8], [9],
        [0, 0], [0, 1], [0, 2], [0, 3], [0, 4], [0, 5], [0, 6], [0, 7], [0, 8], [0, 9], [1, 0], [1, 1], [1, 2],
        [1, 3], [1, 4], [2, 0], [2, 1], [3, 0], [3, 1], [4, 0], [5, 0], [6, 0], [7, 0],
        [0, 0, 0], [0, 0, 1], [0, 0, 2], [0, 0, 3], [0, 0, 4], [0, 0, 5], [0, 0, 6], [0, 0, 7], [0, 0, 8],
        [0, 1, 0], [0, 1, 1], [0, 1, 2], [0, 1, 3], [0, 2, 0], [0, 2, 1], [0, 3, 0], [0, 4, 0], [0, 5, 0],
        [1, 0, 0], [1, 0, 1], [1, 0, 2], [1, 1, 0], [2, 0, 0],
        [0, 0, 0, 0], [0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 0, 3], [0, 0, 1, 0], [0, 0, 2, 0], [0, 1, 0, 0],
    ],
    "reverse_balanced_25": [
        [0], [1], [2], [0, 0], [0, 1], [1, 0], [2, 0], [0, 0, 0], [0, 0, 1], [0, 0, 2],
        [0, 1, 0], [0, 1, 1], [1, 0, 0], [0, 0, 0, 0], [0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 1, 0],
        [0, 0, 1, 1], [0, 0, 0, 0, 0], [0, 0, 0, 0, 1], [0, 0, 0, 0, 2], [0, 0, 0, 0, 3],
        [0, 0, 0, 1, 0], [0, 0, 0, 1, 1], [0, 0, 0, 1, 2],
    ],
    "chain": [[0], [0, 0], [0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0, 0]],
    # Small trees for devices where verify cost grows quickly with tree size (CPUs): a main
    # chain with second samples at the shallow levels, where acceptance is decided most often.
    "cpu_6": [[0], [1], [0, 0], [1, 0], [0, 0, 0], [0, 0, 0, 0]],
    "cpu_9": [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 0, 0, 0]],
}
# Read-only: a tree of another shape is a TreeConfig.from_choices value, never a process-wide name.
STATIC_TREES: Mapping[str, list[list[int]]] = MappingProxyType(_NAMED_TREES)


# --------------------------------------------------------------------------------------------
# Names
# --------------------------------------------------------------------------------------------


def chain_choices(n: int) -> list[list[int]]:
    """The chain of ``n`` drafts, ``[[0], [0, 0], ...]``: plain (non-tree) speculative decoding."""
    check(
        isinstance(n, int) and not isinstance(n, bool) and n >= 1,
        f"a chain tree needs n >= 1 drafts, got {n!r}",
    )
    return [[0] * d for d in range(1, n + 1)]


def resolve_tree_choices(name: str) -> list[list[int]]:
    """Choices for ``chain:N`` or a :data:`STATIC_TREES` key (a fresh copy, safe to mutate)."""
    name = name.strip()
    if name.startswith("chain:"):
        try:
            n = int(name.split(":", 1)[1])
        except ValueError:
            raise LanternError(f"tree 'chain:N' needs an integer N, got {name!r}") from None
        check(n >= 1, f"tree 'chain:N' needs N >= 1, got {name!r}")
        return chain_choices(n)
    if name not in STATIC_TREES:
        raise LanternError(
            f"unknown tree {name!r}; known: {', '.join(sorted(STATIC_TREES))}, or 'chain:N'"
        )
    return [list(choice) for choice in STATIC_TREES[name]]


def probe_choices(widths: Sequence[int]) -> list[list[int]]:
    """A "caterpillar" probe tree: the rank-0 chain, and ``widths[d - 1]`` siblings at depth d.

    Every sibling but rank 0 is a leaf, so the tree stays small (``sum(widths)`` drafts) while
    every (depth, rank) pair up to the widths is tested whenever the chain reaches that depth;
    calibration (:mod:`lantern.autotree.choose`) estimates per-(depth, rank) acceptance from it.
    """
    check(
        isinstance(widths, Sequence) and len(widths) >= 1
        and all(isinstance(w, int) and not isinstance(w, bool) and w >= 1 for w in widths),
        f"probe widths must be a non-empty list of integers >= 1, got {widths!r}",
    )
    return [[0] * d + [r] for d, width in enumerate(widths) for r in range(width)]


def canonical_choices(choices: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
    """Validated choices as sorted tuples (by depth, then lexicographic): one spelling per tree."""
    return tuple(_sorted_choices(choices))


def level_widths(choices: Sequence[Sequence[int]]) -> tuple[list[int], list[int]]:
    """(nodes per depth 1..D, nodes *with children* per depth 0..D-1) of a choices list.

    The second list is what a static drafter expands per level: level 0 is the root (scored by
    the drafter's context pass), level d >= 1 costs one drafter ``feed`` over that many nodes.
    """
    nodes = canonical_choices(choices)
    depth = max(len(c) for c in nodes)
    per_depth = [0] * depth
    parents: set[tuple[int, ...]] = set()
    for c in nodes:
        per_depth[len(c) - 1] += 1
        parents.add(c[:-1])
    expanded = [0] * depth
    for p in parents:
        expanded[len(p)] += 1
    return per_depth, expanded


def tree_hash(choices: Sequence[Sequence[int]]) -> str:
    """8 hex digits identifying a tree shape (independent of how the choices are ordered)."""
    import hashlib

    text = ";".join(",".join(map(str, c)) for c in canonical_choices(choices))
    return hashlib.sha1(text.encode()).hexdigest()[:8]


# --------------------------------------------------------------------------------------------
# Tree buffers from a parent array
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class TreeBuffers:
    """Index buffers of one tree, or of a batch of trees with the same node count T.

    Node 0 is the root. ``depth`` is the rotary offset of each node (its position is prefix
    length + depth), ``mask`` is the tree-attention block, ``children`` drives level-by-level
    verification (siblings are tested in ascending node order), and ``retrieve`` lists the
    root-to-leaf paths that the accepted path is read from. ``eq=False``: tensors have no
    single truth value, so a generated ``__eq__`` would only raise.
    """

    parents: Tensor  # [B, T] int64, parent node index, -1 for the root
    depth: Tensor  # [B, T] int64, root depth 0
    mask: Tensor  # [B, T, T] bool, mask[b, i, j] = j is an ancestor of i or i itself
    children: Tensor  # [B, T, C] int64, children in ascending node order, -1 padded; C >= 1
    retrieve: Tensor  # [B, P, Dmax+1] int64, root->leaf paths, -1 padded (rows too), sorted
    # The most nodes at one depth, over the batch (a bound for a tree kind built with bounds): a
    # static size, like the shapes above. It bounds, with the depth levels, the nodes one forward can
    # hold at depths that share a residue (Lumina-mGPT's row ends: ChameleonTarget.verify).
    widest: int

    @property
    def batch_size(self) -> int:
        return self.parents.shape[0]

    @property
    def num_nodes(self) -> int:
        return self.parents.shape[1]

    @property
    def max_depth(self) -> int:
        """Deepest node over the batch (read from the shape, so no device sync)."""
        return self.retrieve.shape[-1] - 1

    def to(self, device: torch.device | str) -> TreeBuffers:
        return TreeBuffers(
            parents=self.parents.to(device),
            depth=self.depth.to(device),
            mask=self.mask.to(device),
            children=self.children.to(device),
            retrieve=self.retrieve.to(device),
            widest=self.widest,
        )


def tree_from_parents(parents: Tensor, bounds: tuple[int, ...] | None = None) -> TreeBuffers:
    """Build :class:`TreeBuffers` from parent arrays ``[T]`` or ``[B, T]`` (rows may differ).

    Requires ``parents[..., 0] == -1`` and ``0 <= parents[..., i] < i`` for ``i >= 1`` (parents
    precede children), which every builder here produces and which makes the ancestor closure a
    fixed number of squarings. Without ``bounds`` it costs two host syncs: one to validate, one to
    learn the output sizes (C, P and Dmax depend on the trees). ``bounds`` = (max depth, max
    children, max leaves) that every tree of this kind respects (e.g. a dynamic tree's by its
    top-k and depth), and optionally the most nodes at one depth (default: max leaves, which bounds
    it: each node of a level has its own leaf below it): then the sizes are those bounds, nothing
    is read back and nothing is validated, so a compiled round can build its trees inside the graph.
    """
    if bounds is None:
        parents = _checked_parents(parents)  # [B, T]
    mask = _ancestor_mask(parents)  # [B, T, T]
    depth = mask.sum(dim=-1) - 1  # [B, T]
    is_child = _child_matrix(parents)  # [B, T, T], [b, p, c] = c is a child of p
    num_children = is_child.sum(dim=-1)  # [B, T]
    is_leaf = num_children == 0  # [B, T]
    if bounds is None:
        per_level = torch.zeros_like(depth).scatter_add_(1, depth, torch.ones_like(depth))  # [B, T]
        max_depth, max_children, max_leaves, widest = torch.stack(
            [depth.max(), num_children.max(), is_leaf.sum(dim=-1).max(), per_level.max()]
        ).tolist()
    else:
        max_depth, max_children, max_leaves = bounds[:3]
        widest = bounds[3] if len(bounds) > 3 else max_leaves
    return TreeBuffers(
        parents=parents,
        depth=depth,
        mask=mask,
        children=_children(is_child, max(max_children, 1)),
        retrieve=_retrieve(mask, depth, is_leaf, max_depth, max_leaves),
        widest=widest,
    )


def _checked_parents(parents: Tensor) -> Tensor:
    """Validate a parent array and return it as ``[B, T]`` int64."""
    check(isinstance(parents, Tensor), f"parents must be a torch.Tensor, got {type(parents)}")
    check(
        not parents.is_floating_point() and not parents.is_complex()
        and parents.dtype != torch.bool,
        f"parents must be an integer tensor, got dtype {parents.dtype}",
    )
    shape = tuple(parents.shape)
    check(parents.dim() in (1, 2), f"parents must be [T] or [B, T], got shape {shape}")
    parents = parents.long()
    if parents.dim() == 1:
        parents = parents[None]
    batch, num_nodes = parents.shape
    check(batch >= 1 and num_nodes >= 1, f"parents must be non-empty, got shape {shape}")
    node = torch.arange(num_nodes, device=parents.device)  # [T]
    ok = torch.where(node == 0, parents == -1, (parents >= 0) & (parents < node))  # [B, T]
    if not bool(ok.all()):
        row, i = (int(x) for x in (~ok).nonzero()[0])
        raise LanternError(
            f"bad tree parents: row {row}, node {i} has parent {int(parents[row, i])}; need "
            "parents[0] == -1 and 0 <= parents[i] < i (parents precede children)"
        )
    return parents


def _ancestor_mask(parents: Tensor) -> Tensor:
    """Reflexive-transitive closure of the parent relation by repeated squaring.

    ``m`` starts as "self or parent" (paths of length <= 1); each squaring doubles the path
    length covered, so ceil(log2(T - 1)) squarings reach the deepest possible node. Float
    matmul is exact here (entries are counts <= T) and runs on any device.
    """
    batch, num_nodes = parents.shape  # [B, T]
    adjacent = torch.nn.functional.one_hot(parents.clamp(min=0), num_nodes).bool()  # [B, T, T]
    adjacent[:, 0] = False  # the root has no parent
    eye = torch.eye(num_nodes, dtype=torch.bool, device=parents.device)  # [T, T]
    m = (adjacent | eye).float()  # [B, T, T]
    for _ in range(max(num_nodes - 2, 0).bit_length()):
        m = (torch.bmm(m, m) > 0).float()
    return m.bool()


def _child_matrix(parents: Tensor) -> Tensor:
    """``[b, p, c]`` = node c is a child of node p (the root's -1 matches nothing)."""
    node = torch.arange(parents.shape[1], device=parents.device)  # [T]
    return parents[:, None, :] == node[None, :, None]  # [B, T, T]


def _children(is_child: Tensor, width: int) -> Tensor:
    """Pack each node's children, ascending, into ``[B, T, width]`` with -1 padding.

    A scatter into a spare column (non-children land there), so the shape never depends on the data."""
    batch, num_nodes, _ = is_child.shape
    slot = torch.where(is_child, is_child.long().cumsum(dim=-1) - 1, width).clamp(max=width)  # [B, T, T]
    node = torch.arange(num_nodes, device=is_child.device).expand(batch, num_nodes, -1)  # [B, T, T] = c
    children = torch.full((batch, num_nodes, width + 1), -1, dtype=torch.long, device=is_child.device)
    return children.scatter_(2, slot, torch.where(is_child, node, -1))[:, :, :width]


def _retrieve(
    mask: Tensor, depth: Tensor, is_leaf: Tensor, max_depth: int, max_leaves: int
) -> Tensor:
    """Root-to-leaf paths, one row per leaf, sorted lexicographically with -1 as +inf.

    Sorting by node index is sorting by sibling rank (siblings are numbered in rank order),
    which is the official order for static trees and for sampled dynamic trees ([EAGLE code], [LANTERN code]).
    """
    batch, num_nodes = depth.shape  # [B, T]
    # paths[b, i, depth[b, j]] = j for every ancestor j of node i: a scatter, non-ancestors into a spare column
    col = torch.where(mask, depth[:, None, :], max_depth + 1).clamp(max=max_depth + 1)  # [B, T, T]
    node = torch.arange(num_nodes, device=depth.device).expand(batch, num_nodes, -1)
    paths = torch.full((batch, num_nodes, max_depth + 2), -1, dtype=torch.long, device=depth.device)
    paths = paths.scatter_(2, col, torch.where(mask, node, -1))[:, :, : max_depth + 1]  # [B, T, Dmax+1]
    key = paths.masked_fill(paths < 0, num_nodes).masked_fill(~is_leaf[..., None], num_nodes)
    order = _lexsort_rows(key)[:, :max_leaves]  # [B, P], non-leaf rows sort last
    rows = paths.gather(1, order[..., None].expand(-1, -1, max_depth + 1))  # [B, P, Dmax+1]
    return rows.masked_fill(~is_leaf.gather(1, order)[..., None], -1)


def _lexsort_rows(key: Tensor) -> Tensor:
    """Row order that sorts ``key [B, R, L]`` lexicographically: stable sorts, last column first."""
    batch, num_rows, length = key.shape
    order = torch.arange(num_rows, device=key.device).expand(batch, num_rows)  # [B, R]
    for col in reversed(range(length)):
        column = key[..., col].gather(1, order)  # [B, R]
        order = order.gather(1, torch.argsort(column, dim=1, stable=True))
    return order


# --------------------------------------------------------------------------------------------
# Static trees (EAGLE-1 / LANTERN++)
# --------------------------------------------------------------------------------------------


def keys_past_first_gap(mask: Tensor) -> int:
    """The most keys a node of the trees ``mask`` [B, T, T] (ancestors and self, in node order)
    attends past its run from the root, i.e. after the first slot that holds another branch's
    node (a chain: none). Batch-invariant attention's tail must take them all, so that the keys
    the kernel sums lie side by side as in an AR step (``lantern.models.attention.side_by_side``)."""
    slots = torch.arange(mask.shape[-1], device=mask.device)
    run = (mask.long().cumsum(-1) == slots + 1).sum(-1)  # j counted while keys 0 .. j are all attended
    return int((mask.sum(-1) - run).max())


@dataclass(frozen=True, eq=False)
class StaticTree:
    """A named tree with target-side buffers and the drafter's sampling schedule.

    Nodes are sorted by (depth, lexicographic choice), node 0 = root. At level d the drafter
    expands the nodes ``expand_levels[d]`` (depth d, with children) and draws
    ``num_samples[d]`` children from each without replacement; node n (depth >= 1) is then the
    sample in row ``sample_row[n]`` and column ``rank[n]`` of level ``depth[n] - 1``. Parents are
    indexed explicitly, so no prefix property of the tree is assumed (utils_c.py of the [LANTERN code] assumes one).
    """

    choices: list[tuple[int, ...]]  # sorted by (len, lexicographic), root excluded
    parents: Tensor  # [T] int64, -1 for the root
    rank: Tensor  # [T] int64, sibling rank = last element of the choice (root 0)
    depth: Tensor  # [T] int64
    buffers: TreeBuffers  # B = 1
    expand_levels: list[Tensor]  # per level d < max_depth: [n_d], nodes at depth d with children
    num_samples: list[int]  # per level d: 1 + max rank among the children at depth d + 1
    sample_row: Tensor  # [T] int64, row of the parent within expand_levels[depth - 1]; root -1

    @property
    def num_nodes(self) -> int:
        return self.parents.shape[0]

    @property
    def max_depth(self) -> int:
        return self.buffers.max_depth

    def to(self, device: torch.device | str) -> StaticTree:
        return StaticTree(
            choices=self.choices,
            parents=self.parents.to(device),
            rank=self.rank.to(device),
            depth=self.depth.to(device),
            buffers=self.buffers.to(device),
            expand_levels=[level.to(device) for level in self.expand_levels],
            num_samples=list(self.num_samples),
            sample_row=self.sample_row.to(device),
        )


def static_tree(choices: Sequence[Sequence[int]] | str) -> StaticTree:
    """Build a :class:`StaticTree` from choices or a name (see :func:`resolve_tree_choices`)."""
    if isinstance(choices, str):
        choices = resolve_tree_choices(choices)
    nodes = _sorted_choices(choices)
    index = {choice: n for n, choice in enumerate([(), *nodes])}
    parents = torch.tensor([-1] + [index[c[:-1]] for c in nodes], dtype=torch.long)  # [T]
    rank = torch.tensor([0] + [c[-1] for c in nodes], dtype=torch.long)  # [T]
    buffers = tree_from_parents(parents)
    depth = buffers.depth[0]  # [T]
    has_children = buffers.children[0, :, 0] >= 0  # [T]
    expand_levels = [
        torch.nonzero(has_children & (depth == d)).flatten() for d in range(buffers.max_depth)
    ]
    row_in_level = torch.full_like(parents, -1)  # [T]
    for level in expand_levels:
        row_in_level[level] = torch.arange(len(level))
    sample_row = torch.where(parents >= 0, row_in_level[parents.clamp(min=0)], -1)  # [T]
    num_samples = [int(rank[depth == d + 1].max()) + 1 for d in range(buffers.max_depth)]
    return StaticTree(
        choices=nodes,
        parents=parents,
        rank=rank,
        depth=depth,
        buffers=buffers,
        expand_levels=expand_levels,
        num_samples=num_samples,
        sample_row=sample_row,
    )


def _sorted_choices(choices: Sequence[Sequence[int]]) -> list[tuple[int, ...]]:
    """Validate choices and sort them by (depth, lexicographic).

    Sibling ranks must be contiguous 0..m-1 under every parent: siblings are drawn without
    replacement in rank order, so rank r exists only if ranks 0..r-1 were drawn before it.
    """
    check(
        isinstance(choices, Sequence) and not isinstance(choices, str) and len(choices) > 0,
        f"tree choices must be a non-empty list of lists, got {choices!r}",
    )
    nodes: list[tuple[int, ...]] = []
    for choice in choices:
        check(
            isinstance(choice, Sequence) and not isinstance(choice, str) and len(choice) > 0
            and all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in choice),
            f"each tree choice must be a non-empty list of ranks >= 0, got {choice!r}",
        )
        nodes.append(tuple(choice))
    seen: set[tuple[int, ...]] = set()
    for node in nodes:
        check(node not in seen, f"tree choice {list(node)} appears twice")
        seen.add(node)
    for node in nodes:
        check(
            len(node) == 1 or node[:-1] in seen,
            f"tree choice {list(node)} has no parent: its prefix {list(node[:-1])} is not a choice",
        )
    ranks: dict[tuple[int, ...], list[int]] = {}
    for node in nodes:
        ranks.setdefault(node[:-1], []).append(node[-1])
    for parent, sibling_ranks in ranks.items():
        check(
            sorted(sibling_ranks) == list(range(len(sibling_ranks))),
            f"children of tree node {list(parent)} have ranks {sorted(sibling_ranks)}; sibling "
            "ranks must be contiguous 0..m-1 (siblings are drawn in rank order)",
        )
    return sorted(nodes, key=lambda c: (len(c), c))


# --------------------------------------------------------------------------------------------
# Official EAGLE-1 index buffers (kept for comparison with the released code)
# --------------------------------------------------------------------------------------------


def official_tree_indices(choices: Sequence[Sequence[int]] | str, topk: int = 10) -> Tensor:
    """[LANTERN code] ``tree_indices`` [T]: ``1 + topk * row(parent) + rank`` (root 0).

    Indexes the official flat candidate vector ``[root, S_0(topk), S_1(topk), ...]``, where row r
    is the r-th node with children in sorted order (root = row 0), counted across depths.
    """
    tree = static_tree(choices)
    check(
        int(tree.rank.max()) < topk,
        f"tree has sibling rank {int(tree.rank.max())}, which needs topk > that; got topk={topk}",
    )
    has_children = tree.buffers.children[0, :, 0] >= 0  # [T]
    row = has_children.long().cumsum(0) - 1  # [T], valid where has_children
    indices = 1 + topk * row[tree.parents.clamp(min=0)] + tree.rank  # [T]
    indices[0] = 0
    return indices


def official_p_indices(choices: Sequence[Sequence[int]] | str) -> Tensor:
    """[LANTERN code] ``p_indices`` [T] (before re-indexing by retrieve): equal to ``sample_row``."""
    return static_tree(choices).sample_row.clone()


def official_b_indices(choices: Sequence[Sequence[int]] | str) -> list[list[int]]:
    """[LANTERN code] ``b_indices`` (before re-indexing by retrieve): each node's earlier siblings."""
    tree = static_tree(choices)
    siblings = tree.buffers.children[0, tree.parents.clamp(min=0)]  # [T, C]
    earlier = (siblings >= 0) & (siblings < torch.arange(tree.num_nodes)[:, None])  # [T, C]
    earlier[0] = False
    return [row[keep].tolist() for row, keep in zip(siblings, earlier, strict=True)]


# --------------------------------------------------------------------------------------------
# EAGLE-2 dynamic tree: selection
# --------------------------------------------------------------------------------------------


def dynamic_tree_select(
    scores: Tensor, parent_flat: Tensor, total_tokens: int
) -> tuple[Tensor, Tensor]:
    """Keep the ``total_tokens`` best drafted candidates and return them as a tree ([EAGLE-2]).

    ``scores [B, F]`` are cumulative drafter log-probs in the EAGLE flat order and
    ``parent_flat [B, F]`` is 1 + the flat index of each candidate's parent (0 = root), with
    parents earlier in flat order than their children. Returns ``sel [B, K]``, the kept flat
    indices ascending, and ``parents [B, K + 1]``, the tree parent of node ``i + 1 = sel[i]``
    (node 0 = root, parent -1), ready for :func:`tree_from_parents`.

    The official code takes a plain top-k and relies on scores never increasing along a path; an
    exact tie (a child with log q = 0) can then keep a child and drop its parent. Here each
    score is first capped by its ancestors' (a prefix minimum: a no-op for real log-probs, since
    adding log q <= 0 never rounds up) and ties are broken by flat index. A parent then never
    scores below its child and comes earlier in flat order, so it always ranks ahead and the
    kept set is always a tree. NaN scores count as -inf.
    """
    check(
        scores.dim() == 2 and parent_flat.shape == scores.shape,
        f"scores and parent_flat must both be [B, F], got {tuple(scores.shape)} and "
        f"{tuple(parent_flat.shape)}",
    )
    batch, num_flat = scores.shape
    check(
        isinstance(total_tokens, int) and 1 <= total_tokens <= num_flat,
        f"total_tokens must be in [1, {num_flat}] (the candidate count), got {total_tokens!r}",
    )
    parent_flat = parent_flat.long()
    flat = torch.arange(num_flat, device=scores.device)  # [F]
    if not torch.compiler.is_compiling():  # a value check (a host sync): the drafter's trees are valid by construction
        check(
            bool(((parent_flat >= 0) & (parent_flat - 1 < flat)).all()),
            "parent_flat must be 0 (root) or 1 + the flat index of an earlier candidate",
        )
    capped = _ancestor_min(scores.nan_to_num(nan=-torch.inf), parent_flat)  # [B, F]
    ranked = torch.argsort(capped, dim=1, descending=True, stable=True)  # [B, F], best first
    sel = ranked[:, :total_tokens].sort(dim=1).values  # [B, K]
    parent_of_sel = parent_flat.gather(1, sel)  # [B, K], 1 + parent flat, 0 = root
    node = torch.searchsorted(sel, (parent_of_sel - 1).clamp(min=0)) + 1  # [B, K]
    tree_parents = torch.where(parent_of_sel > 0, node, 0)  # [B, K]
    root = torch.full((batch, 1), -1, dtype=torch.long, device=scores.device)
    return sel, torch.cat([root, tree_parents], dim=1)


def _ancestor_min(scores: Tensor, parent_flat: Tensor) -> Tensor:
    """Per candidate, the min score over itself and all its ancestors.

    Pointer jumping: after k rounds each candidate points 2^k steps up, so ceil(log2(F + 1))
    rounds reach the root from anywhere in a fixed, sync-free loop. A sentinel column F stands
    for the root (score +inf, points to itself).
    """
    batch, num_flat = scores.shape  # [B, F]
    sentinel = torch.full((batch, 1), num_flat, dtype=torch.long, device=scores.device)
    up = torch.cat([torch.where(parent_flat > 0, parent_flat - 1, num_flat), sentinel], 1)
    capped = torch.cat([scores, torch.full_like(scores[:, :1], torch.inf)], 1)  # [B, F+1]
    for _ in range(num_flat.bit_length()):
        capped = torch.minimum(capped, capped.gather(1, up))
        up = up.gather(1, up)
    return capped[:, :num_flat]
