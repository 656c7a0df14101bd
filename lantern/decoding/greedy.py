"""Greedy (temperature 0) verification of a draft tree, path by path ([EAGLE code], [LANTERN code]);
and of a chain by SJD-SV's runs (:func:`verify_chain_greedy_subsequence`).

No randomness: a drafted token is accepted when it is its parent's argmax (relaxed: of LANTERN's
boosted distribution, :func:`lantern.decoding.acceptance.relaxed_mass`); the sampled rules and the
glossary are in :mod:`lantern.decoding.acceptance`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lantern.decoding.acceptance import VerifyResult, _active_relaxation, _probability_dtype, relaxed_mass
from lantern.decoding.config import RelaxationConfig, SubsequenceConfig
from lantern.decoding.subsequence import subsequence_accepted
from lantern.errors import check


def _check_greedy_inputs(logits: Tensor, tokens: Tensor, retrieve: Tensor, max_depth: Tensor) -> None:
    check(logits.dim() == 3, f"logits must be [B, T, V], got {tuple(logits.shape)}")
    b, t, _ = logits.shape
    check(tuple(tokens.shape) == (b, t), f"tokens must be [B={b}, T={t}], got {tuple(tokens.shape)}")
    check(
        retrieve.dim() == 3 and retrieve.shape[0] == b and retrieve.shape[2] >= 1,
        f"retrieve must be [B={b}, P, D+1], got {tuple(retrieve.shape)}",
    )
    check(tuple(max_depth.shape) == (b,), f"max_depth must be [B={b}], got {tuple(max_depth.shape)}")
    if not torch.compiler.is_compiling():  # a value check (a host sync): the loop's trees are valid by construction
        check(int(retrieve.max()) < t, f"retrieve indexes node {int(retrieve.max())} of a {t}-node tree")
def _parents_from_paths(retrieve: Tensor, num_nodes: int) -> Tensor:
    """parent [B, T] of every node on a retrieve path (-1 for the root and unused nodes)."""
    b = retrieve.shape[0]
    child, parent = retrieve[:, :, 1:], retrieve[:, :, :-1]  # [B, P, D] each
    slot = torch.where(child >= 0, child, num_nodes).flatten(1)  # [B, P*D], padding -> spare slot
    out = torch.full((b, num_nodes + 1), -1, dtype=torch.long, device=retrieve.device)
    # Every path through a node names the same parent, so duplicate writes agree.
    return out.scatter_(1, slot, parent.flatten(1))[:, :num_nodes]
def _greedy_node_ok(
    logits: Tensor,  # [B, T, V]
    tokens: Tensor,  # [B, T]
    parent: Tensor,  # [B, T]
    neighbours: Tensor | None,
    relax: RelaxationConfig | None,
    relaxable: Tensor | None = None,  # [B, T] bool: drawn from a model distribution (None: all)
) -> tuple[Tensor, Tensor]:
    """(ok [B, T], exact_ok [B, T]): is each node's token its parent's (relaxed) argmax? An undrawn
    guess (``relaxable`` False) must be the exact argmax.

    Relaxed ([LANTERN code]): ``p = softmax(logits)`` with no temperature or top-k, and the token wins
    when it is the first-index argmax of ``p'`` with ``p'(x) := p(x) + c_m``. The exact verdict
    on the raw logits is OR-ed in, so softmax round-off can never make relaxation stricter.
    """
    b, t, v = logits.shape
    safe_parent = parent.clamp(min=0)  # [B, T]
    exact_ok = logits.argmax(-1).gather(1, safe_parent) == tokens  # [B, T]
    if relax is None:
        return exact_ok, exact_ok
    p = torch.softmax(logits.to(_probability_dtype(logits)), dim=-1)  # [B, T, V]
    p_parent = p.gather(1, safe_parent[:, :, None].expand(-1, -1, v)).reshape(b * t, v)
    x = tokens.reshape(b * t)
    p_tilde, _ = relaxed_mass(p_parent, x, neighbours, relax)  # [B*T]
    boosted = p_parent.scatter(1, x[:, None], p_tilde[:, None])  # [B*T, V] p' (neighbours keep mass)
    relaxed_ok = (boosted.argmax(-1) == x).reshape(b, t)
    if relaxable is not None and relax.mode != "group":
        relaxed_ok = relaxed_ok & relaxable
    return exact_ok | relaxed_ok, exact_ok
def verify_tree_greedy(
    logits: Tensor,  # [B, T, V] guided raw logits at every tree node
    tokens: Tensor,  # [B, T] node tokens; node 0 is the root
    retrieve: Tensor,  # [B, P, D+1] root->leaf node paths, -1 padded
    max_depth: Tensor,  # [B] deepest usable node depth per row
    neighbours: Tensor | None = None,  # [V, K] proximity table
    relaxation: RelaxationConfig | None = None,
    relaxable: Tensor | None = None,  # [B, T] bool: node n was drawn from a model distribution (None: all)
) -> VerifyResult:
    """Greedy (temperature 0) verification, path by path ([EAGLE code], [LANTERN code]). No randomness.

    A drafted token is accepted when it is its parent's argmax (relaxed: of ``p'``); each path's
    accepted length is its all-accepted prefix; the best path is the first longest one, and
    ``next_token`` is the argmax of the logits at its last accepted node.
    """
    _check_greedy_inputs(logits, tokens, retrieve, max_depth)
    b, t, v = logits.shape
    relax = _active_relaxation(relaxation, neighbours, v)
    tokens, retrieve = tokens.long(), retrieve.long()
    ok, exact_ok = _greedy_node_ok(logits, tokens, _parents_from_paths(retrieve, t), neighbours, relax, relaxable)
    child = retrieve[:, :, 1:]  # [B, P, D]
    safe = child.clamp(min=0).flatten(1)  # [B, P*D]
    d = torch.arange(1, child.shape[2] + 1, device=logits.device)  # [D] depth of each position
    usable = (child >= 0) & (d[None, None, :] <= max_depth[:, None, None])  # [B, P, D]
    on_path_ok = usable & ok.gather(1, safe).view_as(child)  # [B, P, D]
    lengths = on_path_ok.long().cumprod(-1).sum(-1)  # [B, P]
    best = lengths.argmax(-1)  # [B] first longest path
    rows = torch.arange(b, device=logits.device)
    num_accepted = lengths[rows, best]  # [B]
    positions = torch.arange(child.shape[2] + 1, device=logits.device)[None, :]  # [1, D+1]
    path = torch.where(positions <= num_accepted[:, None], retrieve[rows, best], -1)  # [B, D+1]
    path[:, 0] = 0
    last = path.gather(1, num_accepted[:, None]).squeeze(1)  # [B]
    next_token = logits[rows, last].argmax(-1)
    relaxed_only = ~exact_ok.gather(1, path[:, 1:].clamp(min=0)) & (path[:, 1:] >= 0)  # [B, D]
    is_bonus = num_accepted == usable[rows, best].sum(-1)
    return VerifyResult(path, num_accepted, next_token, relaxed_only.sum(-1), is_bonus)


def verify_chain_greedy_subsequence(
    logits: Tensor,  # [B, T, V] guided raw logits at every chain node
    tokens: Tensor,  # [B, T] node tokens; node d is at depth d (node 0 = the root)
    max_depth: Tensor,  # [B] deepest usable node depth per row
    subsequence: SubsequenceConfig,
    neighbours: Tensor | None = None,  # [V, K] proximity table
    relaxation: RelaxationConfig | None = None,
    relaxable: Tensor | None = None,  # [B, T] bool: node n may share a run (drawn by a model; None: all)
) -> VerifyResult:
    """SJD-SV's run test at temperature 0 (:mod:`lantern.decoding.subsequence`; our reading, the
    paper samples): a draft's ratio is 1 when it is its parent's (relaxed) argmax, else 0, and the
    runs follow ``softmax(logits)`` of each draft, without temperature. No randomness."""
    b, t, v = logits.shape
    check(tuple(tokens.shape) == (b, t), f"tokens must be [B={b}, T={t}], got {tuple(tokens.shape)}")
    relax = _active_relaxation(relaxation, neighbours, v)
    tokens = tokens.long()
    parent = (torch.arange(t, device=logits.device) - 1)[None].expand(b, -1)  # a chain: node d's parent is d - 1
    ok, exact_ok = _greedy_node_ok(logits, tokens, parent, neighbours, relax, relaxable)
    p = torch.softmax(logits[:, :-1].to(_probability_dtype(logits)), dim=-1)  # [B, D, V]
    conf = p.gather(-1, tokens[:, 1:, None]).squeeze(-1)  # [B, D]
    depth = torch.arange(1, t, device=logits.device)
    usable = depth[None, :] <= max_depth[:, None]  # [B, D]
    member = None if relaxable is None else relaxable[:, 1:]
    accepted = subsequence_accepted(conf, ok[:, 1:].to(conf.dtype), member, usable, torch.zeros_like(conf),
                                    subsequence.alpha)
    num_accepted = accepted.sum(-1)  # [B]
    path = torch.cat([torch.zeros_like(num_accepted)[:, None], torch.where(accepted, depth, -1)], dim=1)
    rows = torch.arange(b, device=logits.device)
    next_token = logits[rows, num_accepted].argmax(-1)
    relaxed_only = (accepted & ~exact_ok[:, 1:]).sum(-1)
    return VerifyResult(path, num_accepted, next_token, relaxed_only, num_accepted == usable.sum(-1))
