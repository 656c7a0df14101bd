"""Tests for lantern.decoding.trees: a hand-derived buffer vector, slow Python references, EAGLE-2 selection."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from lantern.decoding.trees import (
    STATIC_TREES,
    chain_choices,
    dynamic_tree_select,
    official_b_indices,
    official_p_indices,
    official_tree_indices,
    resolve_tree_choices,
    static_tree,
    tree_from_parents,
)
from lantern.errors import LanternError

HAND_CHOICES = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]

# --------------------------------------------------------------------------------------------
# Slow references
# --------------------------------------------------------------------------------------------


def ref_tree(parents: list[int]) -> dict[str, list]:
    """Python-loop tree buffers: one walk to the root per node."""
    num_nodes = len(parents)
    paths = []
    for i in range(num_nodes):
        path = [i]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        paths.append(path[::-1])  # root .. i
    children = [[c for c in range(num_nodes) if parents[c] == p] for p in range(num_nodes)]
    rank = [0] * num_nodes
    for kids in children:
        for r, c in enumerate(kids):
            rank[c] = r
    leaves = [i for i in range(num_nodes) if not children[i]]
    # Official order: lexicographic by sibling rank along the path, -1 (missing) = +inf.
    leaves.sort(key=lambda leaf: [rank[n] for n in paths[leaf][1:]] + [math.inf])
    return {
        "depth": [len(p) - 1 for p in paths],
        "mask": [[j in paths[i] for j in range(num_nodes)] for i in range(num_nodes)],
        "children": children,
        "leaf_paths": [paths[leaf] for leaf in leaves],
    }


def assert_matches_reference(parents_rows: list[list[int]]) -> None:
    buffers = tree_from_parents(torch.tensor(parents_rows))
    refs = [ref_tree(row) for row in parents_rows]
    max_depth = max(max(ref["depth"]) for ref in refs)
    max_leaves = max(len(ref["leaf_paths"]) for ref in refs)
    max_children = max(1, max(len(k) for ref in refs for k in ref["children"]))
    assert buffers.max_depth == max_depth
    assert buffers.retrieve.shape == (len(parents_rows), max_leaves, max_depth + 1)
    assert buffers.children.shape[-1] == max_children
    for b, ref in enumerate(refs):
        assert buffers.parents[b].tolist() == parents_rows[b]
        assert buffers.depth[b].tolist() == ref["depth"]
        assert buffers.mask[b].tolist() == ref["mask"]
        for node, kids in enumerate(ref["children"]):
            assert buffers.children[b, node].tolist() == kids + [-1] * (max_children - len(kids))
        rows = buffers.retrieve[b].tolist()
        expected = [p + [-1] * (max_depth + 1 - len(p)) for p in ref["leaf_paths"]]
        expected += [[-1] * (max_depth + 1)] * (max_leaves - len(expected))
        assert rows == expected
        leaves_seen = [max(x for x in row) for row in rows if row[0] >= 0]
        assert sorted(leaves_seen) == sorted(p[-1] for p in ref["leaf_paths"])  # once each


def random_parents(rng: random.Random, num_nodes: int, reach: int) -> list[int]:
    """Parents precede children; small ``reach`` makes deep, chain-like trees."""
    return [-1] + [rng.randrange(max(0, i - reach), i) for i in range(1, num_nodes)]


def ref_official_tree_indices(choices: list[list[int]], topk: int = 10) -> list[int]:
    """Port of the official loop ([LANTERN code]): a parent-change counter accumulated over depths."""
    nodes = sorted(choices, key=lambda c: (len(c), c))
    depth_counts = [sum(len(c) == d for c in nodes) for d in range(1, len(nodes[-1]) + 1)]
    out = [0] * (len(nodes) + 1)
    start = bias = 0
    for i, count in enumerate(depth_counts):
        parent = None
        for j in range(count):
            choice = nodes[start + j]
            if j != 0 and choice[:-1] != parent:
                bias += 1
            parent = choice[:-1]
            out[start + j + 1] = choice[-1] + topk * (i + bias) + 1
        start += count
    return out


# --------------------------------------------------------------------------------------------
# Static trees
# --------------------------------------------------------------------------------------------


def test_spec_vector() -> None:
    tree = static_tree(HAND_CHOICES)
    assert official_tree_indices(HAND_CHOICES).tolist() == [0, 1, 2, 11, 12, 21, 31]
    assert tree.depth.tolist() == [0, 1, 1, 2, 2, 2, 3]
    assert tree.buffers.depth[0].tolist() == [0, 1, 1, 2, 2, 2, 3]
    assert tree.buffers.retrieve[0].tolist() == [[0, 1, 3, 6], [0, 1, 4, -1], [0, 2, 5, -1]]
    rows = ["".join(str(int(x)) for x in row) for row in tree.buffers.mask[0]]
    assert rows == ["1000000", "1100000", "1010000", "1101000", "1100100", "1010010", "1101001"]
    assert official_p_indices(HAND_CHOICES).tolist() == [-1, 0, 0, 0, 0, 1, 0]
    assert official_b_indices(HAND_CHOICES) == [[], [], [1], [], [3], [], []]


def test_spec_vector_drafter_schedule() -> None:
    tree = static_tree(HAND_CHOICES)
    assert tree.choices == [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]
    assert tree.parents.tolist() == [-1, 0, 0, 1, 1, 2, 3]
    assert tree.rank.tolist() == [0, 0, 1, 0, 1, 0, 0]
    assert [lvl.tolist() for lvl in tree.expand_levels] == [[0], [1, 2], [3]]
    assert tree.num_samples == [2, 2, 1]
    assert tree.sample_row.tolist() == [-1, 0, 0, 0, 0, 1, 0]
    assert tree.buffers.children[0].tolist() == [
        [1, 2], [3, 4], [5, -1], [6, -1], [-1, -1], [-1, -1], [-1, -1]
    ]


@pytest.mark.parametrize(
    ("name", "per_depth"),
    [
        ("mc_sim_7b_63", [4, 8, 8, 3, 2]),
        ("mc_sim_7b_63_balanced", [3, 8, 9, 3, 2]),
        ("naive_extend_57", [5, 13, 16, 14, 9]),
        ("medusa_2_7b_63", [10, 23, 23, 7]),
        ("reverse_balanced_25", [3, 4, 6, 5, 7]),
        ("chain", [1, 1, 1, 1, 1]),
    ],
)
def test_named_tree_node_counts(name: str, per_depth: list[int]) -> None:
    tree = static_tree(name)
    assert torch.bincount(tree.depth).tolist() == [1, *per_depth]
    assert tree.num_nodes == 1 + sum(per_depth) == 1 + len(STATIC_TREES[name])
    assert tree.max_depth == len(per_depth)


@pytest.mark.parametrize("name", sorted(STATIC_TREES))
def test_named_tree_matches_reference(name: str) -> None:
    tree = static_tree(name)
    assert_matches_reference([tree.parents.tolist()])
    assert official_tree_indices(name).tolist() == ref_official_tree_indices(STATIC_TREES[name])
    # Sorted choices: node n's choice is its parent's choice plus its rank.
    for n in range(1, tree.num_nodes):
        parent = int(tree.parents[n])
        assert tree.choices[n - 1] == (tree.choices[parent - 1] if parent else ()) + (
            int(tree.rank[n]),
        )


@pytest.mark.parametrize("name", sorted(STATIC_TREES))
def test_drafter_schedule_places_every_node_once(name: str) -> None:
    tree = static_tree(name)
    has_children = tree.buffers.children[0, :, 0] >= 0
    for d, level in enumerate(tree.expand_levels):
        expected = [n for n in range(tree.num_nodes) if tree.depth[n] == d and has_children[n]]
        assert level.tolist() == expected
    slots = set()
    for n in range(1, tree.num_nodes):
        level = int(tree.depth[n]) - 1
        row, col = int(tree.sample_row[n]), int(tree.rank[n])
        assert int(tree.expand_levels[level][row]) == int(tree.parents[n])
        assert col < tree.num_samples[level]
        slots.add((level, row, col))
    assert len(slots) == tree.num_nodes - 1
    assert len(tree.expand_levels) == len(tree.num_samples) == tree.max_depth


def test_chain_choices_and_names() -> None:
    assert chain_choices(3) == [[0], [0, 0], [0, 0, 0]]
    assert resolve_tree_choices("chain:5") == STATIC_TREES["chain"]
    copy = resolve_tree_choices("mc_sim_7b_63")
    copy[0].append(7)
    assert STATIC_TREES["mc_sim_7b_63"][0] == [0]
    tree = static_tree("chain:3")
    assert tree.buffers.retrieve[0].tolist() == [[0, 1, 2, 3]]
    assert tree.num_samples == [1, 1, 1]


def test_input_order_does_not_matter() -> None:
    shuffled = list(reversed(STATIC_TREES["naive_extend_57"]))
    a, b = static_tree(shuffled), static_tree("naive_extend_57")
    assert a.choices == b.choices
    assert torch.equal(a.buffers.retrieve, b.buffers.retrieve)


# --------------------------------------------------------------------------------------------
# tree_from_parents against the reference
# --------------------------------------------------------------------------------------------


@pytest.mark.slow
@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 10**6), min_size=0, max_size=24), st.integers(1, 24))
def test_tree_from_parents_matches_reference(draws: list[int], reach: int) -> None:
    parents = [-1] + [max(0, i - reach) + x % min(i, reach) for i, x in enumerate(draws, 1)]
    assert_matches_reference([parents])


@pytest.mark.parametrize("seed", range(8))
def test_batched_trees_differ_per_row(seed: int) -> None:
    rng = random.Random(seed)
    num_nodes = rng.randrange(1, 30)
    rows = [random_parents(rng, num_nodes, reach) for reach in (1, 3, num_nodes)]
    assert_matches_reference(rows)


def test_root_only_and_1d_input() -> None:
    buffers = tree_from_parents(torch.tensor([-1]))
    assert buffers.mask.tolist() == [[[True]]]
    assert buffers.retrieve.tolist() == [[[0]]]
    assert buffers.children.tolist() == [[[-1]]]
    assert buffers.max_depth == 0 and buffers.batch_size == 1 and buffers.num_nodes == 1


@pytest.mark.parametrize(
    "parents",
    [
        [0, 0, 1],  # root is not -1
        [-1, 1, 0],  # node 1 is its own parent
        [-1, 0, 3, 0],  # node 2's parent comes after it
        [-1, -1, 0],  # two roots
    ],
)
def test_tree_from_parents_rejects_bad_order(parents: list[int]) -> None:
    with pytest.raises(LanternError, match="parents precede children"):
        tree_from_parents(torch.tensor(parents))


def test_tree_from_parents_rejects_bad_tensors() -> None:
    with pytest.raises(LanternError, match="integer"):
        tree_from_parents(torch.tensor([-1.0, 0.0]))
    with pytest.raises(LanternError, match=r"\[B, T\]"):
        tree_from_parents(torch.tensor([[[-1, 0]]]))
    with pytest.raises(LanternError, match="row 1"):
        tree_from_parents(torch.tensor([[-1, 0, 1], [-1, 2, 0]]))


# --------------------------------------------------------------------------------------------
# Bad static trees
# --------------------------------------------------------------------------------------------


def test_unknown_tree_lists_known_names() -> None:
    with pytest.raises(LanternError) as err:
        resolve_tree_choices("mc_sim_7b_64")
    for name in STATIC_TREES:
        assert name in str(err.value)
    assert "chain:N" in str(err.value)
    with pytest.raises(LanternError, match="unknown tree"):
        static_tree("nope")


@pytest.mark.parametrize("spec", ["chain:0", "chain:-2", "chain:x"])
def test_bad_chain(spec: str) -> None:
    with pytest.raises(LanternError, match="chain:N"):
        resolve_tree_choices(spec)
    with pytest.raises(LanternError):
        chain_choices(0)


def test_missing_prefix_names_the_choice() -> None:
    with pytest.raises(LanternError, match=r"\[0, 1, 0\] has no parent.*\[0, 1\]"):
        static_tree([[0], [0, 0], [0, 1, 0], [1]])


def test_non_contiguous_ranks() -> None:
    with pytest.raises(LanternError, match=r"ranks \[0, 2\]"):
        static_tree([[0], [2]])
    with pytest.raises(LanternError, match=r"node \[0\] have ranks \[1\]"):
        static_tree([[0], [0, 1]])


@pytest.mark.parametrize(
    ("choices", "match"),
    [
        ([[0], [0]], "twice"),
        ([], "non-empty"),
        ([[0], []], "non-empty list of ranks"),
        ([[0], [-1]], "ranks >= 0"),
    ],
)
def test_other_bad_choices(choices: list[list[int]], match: str) -> None:
    with pytest.raises(LanternError, match=match):
        static_tree(choices)


def test_official_tree_indices_needs_topk_above_ranks() -> None:
    with pytest.raises(LanternError, match="topk"):
        official_tree_indices("naive_extend_57", topk=4)
    assert official_tree_indices("naive_extend_57", topk=5).shape == (58,)


# --------------------------------------------------------------------------------------------
# EAGLE-2 dynamic selection
# --------------------------------------------------------------------------------------------


def eagle_flat_layout(gen: torch.Generator, top_k: int, depth: int) -> tuple[Tensor, Tensor]:
    """Simulate EAGLE-2's flat candidate layout with random drafter log-probs ([EAGLE code]).

    Level 1 occupies flat [0, k); iteration i's children occupy [k + k²·i, k + k²·(i+1)), in
    blocks of k per expanded frontier node; the frontier is the top-k of those k² scores.
    """
    def logq() -> Tensor:
        return torch.rand(top_k, generator=gen).log().sort(descending=True).values  # [k]

    scores = [logq()]
    parent_flat = [torch.zeros(top_k, dtype=torch.long)]
    frontier = torch.arange(top_k)  # flat indices
    frontier_scores = scores[0]
    for i in range(depth):
        base = top_k + top_k * top_k * i
        cu = torch.stack([s + logq() for s in frontier_scores]).flatten()  # [k*k]
        scores.append(cu)
        parent_flat.append((frontier + 1).repeat_interleave(top_k))
        best = cu.topk(top_k).indices
        frontier, frontier_scores = base + best, cu[best]
    return torch.cat(scores), torch.cat(parent_flat)


def brute_force_select(scores: list[float], parent_flat: list[int], k: int) -> list[int]:
    """Best ancestor-closed subset of size k by total score (every subset tried)."""
    best, best_total = None, -math.inf
    for subset in itertools.combinations(range(len(scores)), k):
        chosen = set(subset)
        if all(parent_flat[f] == 0 or parent_flat[f] - 1 in chosen for f in subset):
            total = sum(scores[f] for f in subset)
            if total > best_total:
                best, best_total = list(subset), total
    assert best is not None
    return best


def tree_parents_reference(sel: list[int], parent_flat: list[int]) -> list[int]:
    return [-1] + [0 if parent_flat[f] == 0 else sel.index(parent_flat[f] - 1) + 1 for f in sel]


def assert_is_tree(sel: Tensor, parents: Tensor, parent_flat: Tensor) -> None:
    tree_from_parents(parents)  # raises unless parents precede children
    for b in range(sel.shape[0]):
        row = sel[b].tolist()
        assert row == sorted(set(row))
        assert parents[b].tolist() == tree_parents_reference(row, parent_flat[b].tolist())


@pytest.mark.parametrize("total_tokens", [1, 3, 5, 7])
def test_dynamic_select_matches_brute_force(total_tokens: int) -> None:
    gen = torch.Generator().manual_seed(total_tokens)
    layouts = [eagle_flat_layout(gen, top_k=2, depth=2) for _ in range(3)]
    scores = torch.stack([s for s, _ in layouts])  # [3, 10]
    parent_flat = torch.stack([p for _, p in layouts])  # [3, 10]
    assert scores.shape == (3, 2 + 4 * 2)
    sel, parents = dynamic_tree_select(scores, parent_flat, total_tokens)
    assert sel.shape == (3, total_tokens) and parents.shape == (3, total_tokens + 1)
    for b in range(3):
        expected = brute_force_select(scores[b].tolist(), parent_flat[b].tolist(), total_tokens)
        assert sel[b].tolist() == expected
        # With real log-probs the official plain top-k gives the same set.
        assert sorted(scores[b].topk(total_tokens).indices.tolist()) == expected
    assert_is_tree(sel, parents, parent_flat)


def test_dynamic_select_hand_example() -> None:
    # k=2, depth=1: level 1 = flat 0, 1; children of flat 0 at 2, 3; children of flat 1 at 4, 5.
    scores = torch.tensor([[-0.1, -1.0, -0.3, -2.0, -1.2, -1.5]])
    parent_flat = torch.tensor([[0, 0, 1, 1, 2, 2]])
    sel, parents = dynamic_tree_select(scores, parent_flat, 4)
    assert sel.tolist() == [[0, 1, 2, 4]]
    assert parents.tolist() == [[-1, 0, 0, 1, 2]]


def test_dynamic_select_exact_tie_keeps_parent() -> None:
    # Child flat 2 has log q = 0, so it ties with its parent flat 0.
    scores = torch.tensor([[-1.0, -2.0, -1.0, -6.0, -2.5, -3.0]])
    parent_flat = torch.tensor([[0, 0, 1, 1, 2, 2]])
    for k, expected in [(1, [0]), (2, [0, 2]), (3, [0, 1, 2])]:
        sel, parents = dynamic_tree_select(scores, parent_flat, k)
        assert sel.tolist() == [expected]
        assert_is_tree(sel, parents, parent_flat)


def test_dynamic_select_non_monotone_scores_stay_a_tree() -> None:
    # A child scoring above its parent (not a real log-prob) must not be kept without it.
    scores = torch.tensor([[-3.0, -5.0, -1.0, -9.0]])
    parent_flat = torch.tensor([[0, 0, 1, 1]])
    sel, parents = dynamic_tree_select(scores, parent_flat, 1)
    assert sel.tolist() == [[0]]
    sel, parents = dynamic_tree_select(scores, parent_flat, 2)
    assert sel.tolist() == [[0, 2]] and parents.tolist() == [[-1, 0, 1]]


@pytest.mark.parametrize("seed", range(6))
def test_dynamic_select_heavy_ties_and_infinities(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    batch, num_flat = 3, 40
    parent_flat = torch.tensor(
        [[0] + [rng.randrange(0, f + 1) for f in range(1, num_flat)] for _ in range(batch)]
    )
    scores = -torch.randint(0, 3, (batch, num_flat), generator=gen).float()  # many ties
    scores[0, ::3] = -torch.inf
    scores[1, 5] = torch.nan
    scores[2] = 0.0
    for k in (1, 7, 20, num_flat):
        sel, parents = dynamic_tree_select(scores, parent_flat, k)
        assert_is_tree(sel, parents, parent_flat)


def test_dynamic_select_bad_input() -> None:
    scores = torch.zeros(1, 4)
    with pytest.raises(LanternError, match="total_tokens"):
        dynamic_tree_select(scores, torch.zeros(1, 4, dtype=torch.long), 5)
    with pytest.raises(LanternError, match="earlier candidate"):
        dynamic_tree_select(scores, torch.tensor([[0, 4, 0, 0]]), 2)
    with pytest.raises(LanternError, match=r"\[B, F\]"):
        dynamic_tree_select(torch.zeros(4), torch.zeros(4, dtype=torch.long), 2)


def test_tree_config_spec_round_trips() -> None:
    from lantern.decoding.config import TreeConfig

    for spec in ("none", "chain:5", "static:naive_extend_57", "static:cpu_6", "dynamic"):
        cfg = TreeConfig.parse(spec)
        assert cfg.spec == spec and TreeConfig.parse(cfg.spec) == cfg
    assert TreeConfig.parse("chain:4").choices_name == "chain:4"
    assert TreeConfig.parse("static:cpu_9").choices_name == "cpu_9"
    with pytest.raises(LanternError, match="no fixed choices"):
        _ = TreeConfig.parse("dynamic").choices_name


@pytest.mark.parametrize("spec", ["none", "chain:1", "chain:5", "static:naive_extend_57", "dynamic"])
def test_tree_config_sizes_match_the_built_trees(spec: str) -> None:
    """``TreeConfig`` counts sizes without building a tree; they must equal what the built tree has."""
    from lantern.decoding.config import TreeConfig
    from lantern.decoding.trees import static_tree

    tree = TreeConfig.parse(spec, depth=3, top_k=4, total_tokens=9)
    if tree.kind == "none":
        assert (tree.num_nodes, tree.max_depth, tree.fed_per_round) == (1, 0, 0)
    elif tree.kind == "dynamic":  # level 1 from the root, then ``depth`` expansions of ``top_k`` each
        assert (tree.num_nodes, tree.max_depth, tree.fed_per_round) == (10, 4, 12)
    else:
        built = static_tree(tree.choices_name)
        assert (tree.num_nodes, tree.max_depth) == (built.num_nodes, built.max_depth)
        assert tree.fed_per_round == built.num_nodes
    assert tree.drafter_slots == tree.max_depth + 1 + tree.fed_per_round + 1
