"""Acceptance rules for speculative decoding: exact, LANTERN (δ) and LANTERN++ (λ). Pure functions.

No model, no cache, no hidden state and no global random numbers: every function takes
probabilities, tokens, tree structure and pre-drawn uniforms, and returns tensors.

Glossary (the names follow the papers; docs/REFERENCES.md):

* ``p_target``: the target model's next-token distribution at a tree node, after CFG and the
  logits processor ([LlamaGen code] generate.py). It is "p" in Leviathan et al. 2023 (Algorithm 1), Chen et al.
  2023 and LANTERN (Jang et al., ICLR 2025).
* ``q_draft``: the drafter's distribution at a node, from which that node's children were drawn
  ("q" in the same papers). ``None`` means deterministic drafts (EAGLE-2 top-k), for which q is a
  point mass: NOTE: as in EAGLE and LANTERN (``qx = 1.0``), such drafts are tested with q(x) = 1.
* residual ``r``: the distribution a candidate is tested against. It starts as ``p_target`` at
  the node and is updated after every rejected sibling ([EAGLE code] evaluate_posterior).
* accepted: a drafted token that passed its test ``u < min(1, p̃(x) / q(x))``.
* relaxed-accepted: an accepted token that the exact rule would have rejected with the same
  uniform (``u >= min(1, r(x) / q(x))``). This is LANTERN's gain.
* recovered: the token sampled from the residual after every child of the last accepted node
  was rejected.
* bonus: the token sampled from fresh ``p_target`` at the last accepted node when it has no
  valid children (a leaf, or the depth cap). It is one extra token per target forward.
* aggregated set ``A(x) = {x} ∪ {N_0 .. N_{m_len-1}}``: x plus the longest proximity-ordered
  prefix of its k nearest latent neighbours ``N = neighbours[x, :k]`` whose cumulative residual
  mass stays within the bound: δ (``mode="absolute"``, LANTERN) or (λ-1)·r(x)
  (``mode="relative"``, LANTERN++). [LANTERN], [LANTERN++].
* drawn / undrawn: a draft is *drawn* when a model proposed it from a distribution (a drafter's
  sample or top-k, a Jacobi redraw from the target's own prediction); an *undrawn* guess is a
  model-free fill (SJD / PJD initialisation: uniform noise, or a copy of a neighbouring token).
  Only drawn drafts get the relaxed credit; an undrawn guess x is tested exactly, so it is
  accepted with exactly p(x) (its q is a point mass) and random codes cannot enter the image at up
  to δ above their probability. ``relaxable`` [B, T] marks the drawn nodes (None: all of them).
* clean (clean-context credit, ``RelaxationConfig.credit = "clean"``): a drawn draft whose
  context, when it is tested, is what its test conditions on, but for the one guess rejected in
  the round the draft was drawn, which a model must have drawn too. A tree drafter's draft is
  conditioned on its ancestors, which are what its test sees: always clean. A Jacobi redraw was
  conditioned on the old window, whose first open guesses are tested before it: it is clean while
  every redraw before it kept the guess it replaced (:func:`clean_context`). Under this rule only
  clean drafts get the relaxed credit (:func:`credited`); a redraw conditioned on a guess the
  test will not see is tested exactly.
* run (SJD-SV, ``lantern.decoding.subsequence``): a stretch of a chain's drafts along which p(x)
  does not decrease, accepted as a unit on one uniform tested against its high-confidence tail's
  joint ratio (relaxed: the run's head is never tested on its own).
* relaxed mass ``p̃(x) = r(A(x)) = r(x) + Σ_{t < m_len} r(N_t)``. The relaxed target ``p̃_x``
  moves the mass of A(x)∖{x} onto x, so ``TV(r, p̃_x) = p̃(x) - r(x) <= bound`` ([LANTERN]; docs/relaxation_budget.md).

NOTE: the relaxation is applied to the *current residual* r, not to the node's original
p_target. This is what the [LANTERN code] does, and it keeps the per-test TV bound
relative to the distribution actually being sampled.

Uniforms: verification takes ``uniforms [B, U]`` with ``U >= T + 1`` (see :func:`num_uniforms`).
Column ``n`` (1 <= n < T) is used only for the test of tree node n, and the last column only for
the final (recovered or bonus) token. A row's consumption therefore never depends on its
batch-mates, so one ``torch.Generator`` per row gives batch-invariant results (STYLE lesson 10).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from lantern.decoding.budget import TokenBudget, uses_token_budget
from lantern.decoding.config import RelaxationConfig, SubsequenceConfig
from lantern.decoding.sampling import sample_from_probs
from lantern.decoding.subsequence import subsequence_accepted
from lantern.errors import check


@dataclass(frozen=True)
class VerifyResult:
    """Outcome of verifying one draft tree per row (output = accepted drafts + next_token)."""

    path: Tensor  # [B, Dmax+1] accepted node indices, root 0 first, -1 padded
    num_accepted: Tensor  # [B] accepted drafts, root excluded
    next_token: Tensor  # [B] the recovered or bonus token that follows the accepted drafts
    # [B] accepted drafts that the exact rule would have rejected with the same uniforms (greedy:
    # whose target argmax differs); 0 without relaxation.
    num_relaxed: Tensor
    is_bonus: Tensor  # [B] bool: next_token is a bonus token (no rejection at the last level)


def num_uniforms(num_nodes: int) -> int:
    """Uniforms per row that :func:`verify_tree_sampled` needs for a tree of ``num_nodes`` nodes."""
    return num_nodes + 1


# ---- building blocks ------------------------------------------------------------------------


def check_k(k: int, k_max: int) -> None:
    """LanternError unless the proximity table has at least ``k`` neighbours per token."""
    check(k <= k_max, f"lantern_k ({k}) exceeds the proximity table's K_max ({k_max})", field="lantern_k")


def _neighbour_rows(neighbours: Tensor, x: Tensor, width: int) -> Tensor:
    """neighbours [V, K] (int32 or int64), x [B] -> [B, width] int64 nearest neighbours of x."""
    return neighbours[x, :width].long()


GSD_PROB_GAP = 0.15  # GSD's released code: group members' probability lies within this of p(x)


def group_mask(r: Tensor, x: Tensor, width: int) -> Tensor:
    """GSD's dynamic group G(x) as a [B, V] bool mask: x, plus the tokens ranked within ``width``
    places of x in r (so of similar probability) that r can produce and whose probability differs
    from r(x) by less than ``GSD_PROB_GAP`` (the released code's filter). A token r cannot produce
    (outside top-k / top-p) has the group {x}: it is never accepted.

    NOTE: the released code also drops members whose input embedding lies far from x's; we keep
    the table-free rule (the paper's point is that static, embedding-based groups do not help).
    """
    v = r.shape[-1]
    order = r.argsort(dim=-1, descending=True)  # [B, V]
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(v, device=r.device).expand_as(order))
    rank_x, r_x = rank.gather(-1, x[:, None]), r.gather(-1, x[:, None])  # [B, 1] each
    member = ((rank - rank_x).abs() <= width) & (r > 0) & ((r - r_x).abs() < GSD_PROB_GAP) & (r_x > 0)
    return member.scatter(-1, x[:, None], True)


def draft_mass(q_j: Tensor | None, r: Tensor, x: Tensor, cfg: RelaxationConfig | None) -> Tensor:
    """[B] what a candidate's test divides by: q_j(x), or q_j(G(x)) for the group rule (GSD
    compares group masses); 1 for deterministic drafts (``q_j`` None: a point mass at x)."""
    if q_j is None:
        return torch.ones_like(x, dtype=r.dtype)
    if cfg is not None and not cfg.is_exact and cfg.mode == "group":
        return (q_j * group_mask(r, x, cfg.k)).sum(-1)
    return q_j.gather(-1, x[:, None]).squeeze(-1)


def relaxed_mass(
    r: Tensor,  # [B, V] distribution the candidate is tested against
    x: Tensor,  # [B] candidate tokens
    neighbours: Tensor | None,  # [V, K] proximity table, nearest first, self excluded
    cfg: RelaxationConfig | None,
    bound: Tensor | None = None,  # [B] neighbour-mass bound replacing cfg's (the token budget's cap)
) -> tuple[Tensor, Tensor]:
    """LANTERN's aggregation ([LANTERN]): ``(p̃(x) [B], m_len [B])`` (GSD's: see below).

    ``m_len`` is the length of the longest prefix of ``neighbours[x, :k]`` whose cumulative mass
    ``c_t`` stays <= the bound (0..k), and ``p̃(x) = r(x) + c_{m_len-1}`` (``r(x)`` if m_len = 0).
    Neighbours with zero mass still occupy prefix slots. ``cfg`` None or exact: no relaxation.
    The group rule (``cfg.mode == "group"``) credits x with r(G(x)) (:func:`group_mask`).
    """
    r_x = r.gather(-1, x[:, None]).squeeze(-1)  # [B]
    no_prefix = torch.zeros_like(x)
    if cfg is None or cfg.is_exact:
        return r_x, no_prefix
    if cfg.mode == "group":  # GSD: the group's mass; m_len counts the members besides x
        member = group_mask(r, x, cfg.k)
        return (r * member).sum(-1), member.sum(-1) - 1
    check(neighbours is not None, "relaxed acceptance needs a proximity table (neighbours)")
    assert neighbours is not None
    check_k(cfg.k, neighbours.shape[1])
    c = r.gather(-1, _neighbour_rows(neighbours, x, cfg.k)).cumsum(-1)  # [B, k]
    if bound is None:
        bound = torch.full_like(r_x, cfg.delta) if cfg.mode == "absolute" else (cfg.lam - 1.0) * r_x
    within = (c <= bound[:, None]).long().cumprod(-1)  # [B, k] 1 on the admissible prefix
    m_len = within.sum(-1)  # [B]
    c_m = c.gather(-1, (m_len - 1).clamp(min=0)[:, None]).squeeze(-1)  # [B]
    return r_x + torch.where(m_len > 0, c_m, torch.zeros_like(c_m)), m_len


def drawn_credit(
    p_tilde: Tensor,  # [B] relaxed mass
    m_len: Tensor,  # [B] aggregated prefix length
    r_x: Tensor,  # [B] exact mass r(x)
    relaxable: Tensor | None,  # [B] bool: x was drawn from a model distribution (None: all were)
    cfg: RelaxationConfig | None,
) -> tuple[Tensor, Tensor]:
    """``(p̃(x), m_len)`` with the relaxed credit kept for drawn drafts only: an undrawn guess gets
    ``(r(x), 0)``, i.e. the exact test and (through m_len = 0) the exact residual. GSD's group rule
    is left as its paper has it (every draft is credited with its group)."""
    if relaxable is None or cfg is None or cfg.is_exact or cfg.mode == "group":
        return p_tilde, m_len
    return torch.where(relaxable, p_tilde, r_x), torch.where(relaxable, m_len, torch.zeros_like(m_len))


def credited(
    relaxable: Tensor | None,  # [B, T] bool: drawn from a model distribution (None: every node)
    clean: Tensor | None,  # [B, T] bool: drawn, with a clean context (None: wherever drawn)
    cfg: RelaxationConfig | None,
) -> Tensor | None:
    """[B, T] the nodes the relaxed rule ``cfg`` may credit (None: all of them): the drawn ones,
    or under clean-context credit the clean ones (a drafter that marks no ``clean`` nodes, a tree
    drafter, conditions every draft on what its test sees)."""
    if cfg is None or cfg.credit == "drawn" or clean is None:
        return relaxable
    return clean if relaxable is None else clean & relaxable


def clean_context(
    same: Tensor,  # [B, L] bool: prediction i's redraw equals the guess it replaced
    first_open: Tensor,  # [B] the first prediction whose position is still open (after the rejected guess)
    rejected_drawn: Tensor,  # [B] bool: the guess rejected this round was drawn from a model
) -> Tensor:
    """[B, L] bool: the redraw at prediction i of a Jacobi window has a clean context.

    Prediction i was conditioned on the old window before its position: the guesses accepted this
    round, the rejected one (at ``first_open - 1``) and the old guesses at predictions
    ``first_open .. i-1``. The redraws at those open positions are tested before the one at i, so
    i's context is what its test sees exactly when each of them equals the guess it replaced. The
    rejected guess always differs from the token that replaced it; it is allowed when a model drew
    it (asking more would leave no Jacobi draft ever credited: every carried guess saw one).
    """
    i = torch.arange(same.shape[1], device=same.device)[None, :]
    ok = same | (i < first_open[:, None])
    before = torch.cat([torch.ones_like(ok[:, :1]), ok[:, :-1]], dim=1).long().cumprod(1).bool()  # all ok[:, :i]
    return rejected_drawn[:, None] & (i >= first_open[:, None]) & before


def aggregated_mask(x: Tensor, m_len: Tensor, neighbours: Tensor, vocab_size: int) -> Tensor:
    """Membership of A(x)∖{x} as a [B, V] bool mask: the first ``m_len`` neighbours of each x.

    x: [B]; m_len: [B] (from :func:`relaxed_mass`); neighbours: [V, K].
    """
    nbr = neighbours[x].long()  # [B, K]
    inside = torch.arange(nbr.shape[1], device=x.device)[None, :] < m_len[:, None]  # [B, K]
    mask = torch.zeros(x.shape[0], vocab_size, dtype=torch.bool, device=x.device)  # [B, V]
    return mask.scatter_(1, nbr, inside)


def _normalise(v: Tensor, fallback: Tensor) -> Tensor:
    """v [B, V] >= 0 divided by its row sum; rows that sum to 0 take ``fallback`` [B, V]."""
    total = v.sum(-1, keepdim=True)  # [B, 1]
    return torch.where(total > 0, v / total.clamp(min=torch.finfo(v.dtype).tiny), fallback)


def _paper_residual(
    r: Tensor,  # [B, V]
    x: Tensor,  # [B]
    p_tilde: Tensor,  # [B]
    agg: Tensor | None,  # [B, V] A(x)∖{x}, None for the exact rule
    q_j: Tensor | None,  # [B, V] conditional draft distribution, None for deterministic drafts
) -> Tensor:
    """``norm(max(p̃_x - q_j, 0))`` (the residual of [LANTERN]'s relaxed target); exact when ``agg`` is None.

    Deterministic drafts (q a point mass at x) reduce it to ``norm(r with A(x) zeroed)``.
    NOTE: a rejection implies positive residual mass, so an all-zero residual only arises from
    round-off. We then keep the previous r, which never leaves the target's support (the official
    code's uniform-over-vocabulary fallback can emit tokens outside top-k).
    """
    relaxed = r  # [B, V] p̃_x: A(x)∖{x} zeroed, its mass moved onto x
    if agg is not None:
        relaxed = r.masked_fill(agg, 0.0).scatter(1, x[:, None], p_tilde[:, None])
    if q_j is None:
        unnormalised = relaxed.scatter(1, x[:, None], 0.0)
    else:
        unnormalised = (relaxed - q_j).clamp(min=0.0)
    return _normalise(unnormalised, r)


def _official_residual(
    r: Tensor,  # [B, V]
    x: Tensor,  # [B]
    m_len: Tensor,  # [B]
    q_j: Tensor | None,  # [B, V]
    neighbours: Tensor,  # [V, K]
    cfg: RelaxationConfig,
) -> Tensor:
    """The released code's residual ([LANTERN code] ea_model_*.py), for comparison runs only.

    Where an aggregation happened (m_len >= 1) it removes ``neighbours[x, :k+1]``: from r
    (LlamaGen dynamic, Lumina static) or from q_j (LlamaGen static). Otherwise it is the exact
    update. An all-zero residual falls back to uniform over the whole vocabulary, as that code.
    """
    width = cfg.k + 1
    nbr = _neighbour_rows(neighbours, x, width)  # [B, k+1]
    drop = torch.zeros_like(r, dtype=torch.bool).scatter_(
        1, nbr, (m_len > 0)[:, None].expand(-1, width)
    )  # [B, V]
    if q_j is None:  # q is a point mass at x: both code bases zero x and the k+1 neighbours
        unnormalised = r.masked_fill(drop, 0.0).scatter(1, x[:, None], 0.0)
    elif cfg.residual == "official-lumina":
        unnormalised = (r.masked_fill(drop, 0.0) - q_j).clamp(min=0.0)
    else:
        unnormalised = (r - q_j.masked_fill(drop, 0.0)).clamp(min=0.0)
    return _normalise(unnormalised, torch.full_like(r, 1.0 / r.shape[-1]))


def rejection_residual(
    r: Tensor,  # [B, V] residual the rejected candidate was tested against
    x: Tensor,  # [B] rejected candidate
    p_tilde: Tensor,  # [B] its relaxed mass (from relaxed_mass)
    m_len: Tensor,  # [B] its aggregated prefix length (from relaxed_mass)
    q_j: Tensor | None,  # [B, V] conditional draft distribution; None for deterministic drafts
    neighbours: Tensor | None,  # [V, K]
    cfg: RelaxationConfig | None,
) -> Tensor:
    """The residual after rejecting x ([EAGLE] exact; ``cfg.residual`` modes). [B, V].

    Exact rule (``cfg`` None or exact): ``norm(r with x zeroed)`` for deterministic drafts,
    ``norm(max(r - q_j, 0))`` for sampled ones.
    """
    if cfg is None or cfg.is_exact or cfg.mode == "group":  # GSD continues exactly, as its released code
        return _paper_residual(r, x, p_tilde, None, q_j)
    assert neighbours is not None  # relaxed_mass already required it
    if cfg.residual == "paper":
        agg = aggregated_mask(x, m_len, neighbours, r.shape[-1])
        return _paper_residual(r, x, p_tilde, agg, q_j)
    return _official_residual(r, x, m_len, q_j, neighbours, cfg)


def maximal_coupling(
    p: Tensor,  # [M, V] distribution to sample from
    q: Tensor,  # [M, V] distribution x was drawn from (all zero: no x to keep)
    x: Tensor,  # [M] the earlier sample
    u: Tensor,  # [M] one uniform in [0, 1) per row
) -> Tensor:
    """y ~ p coupled with x ~ q so that y = x as often as possible: Pr[y = x] = 1 - TV(p, q).

    The modified rejection step turned into a sampler (SCD's maximal coupling): keep x with
    probability a = min(1, p(x)/q(x)), else draw from ``norm(max(p - q, 0))``, which is exactly
    :func:`rejection_residual`'s exact update. One uniform decides both: u < a keeps x, and given
    u >= a, (u - a) / (1 - a) is again uniform and samples the residual, so a row draws the same
    number of random numbers whatever happens. Marginally y ~ p whenever x ~ q given the past.
    """
    p_x = p.gather(-1, x[:, None]).squeeze(-1)  # [M]
    q_x = q.gather(-1, x[:, None]).squeeze(-1)
    a = torch.where(q_x > 0, p_x / q_x.clamp(min=torch.finfo(q.dtype).tiny), 0.0).clamp(max=1.0)  # [M]
    residual = rejection_residual(p, x, p_x, torch.zeros_like(x), q, None, None)  # [M, V]
    u = u.to(a.dtype)
    rest = ((u - a) / (1.0 - a).clamp(min=torch.finfo(a.dtype).eps)).clamp(0.0, 1.0 - torch.finfo(a.dtype).eps)
    return torch.where(u < a, x, sample_from_probs(residual, rest))


# ---- sampled verification ([EAGLE], [EAGLE-2], [LANTERN]) -----------------------------------


def _active_relaxation(
    relaxation: RelaxationConfig | None, neighbours: Tensor | None, vocab_size: int
) -> RelaxationConfig | None:
    """The relaxation to apply (None when it moves no mass), validated against the table."""
    if relaxation is None or relaxation.is_exact:
        return None
    if not relaxation.uses_table:
        return relaxation
    check(neighbours is not None, "relaxed acceptance needs a proximity table (neighbours)")
    assert neighbours is not None
    check(
        neighbours.dim() == 2 and neighbours.shape[0] == vocab_size,
        f"proximity table must be [V={vocab_size}, K], got {tuple(neighbours.shape)}",
    )
    check_k(relaxation.k, neighbours.shape[1])
    if relaxation.residual != "paper":
        check(
            relaxation.k + 1 <= neighbours.shape[1],
            f"residual={relaxation.residual!r} removes k+1 = {relaxation.k + 1} neighbours, "
            f"but the proximity table's K_max is {neighbours.shape[1]}",
        )
    return relaxation


def _check_sampled_inputs(
    p_target: Tensor,
    tokens: Tensor,
    children: Tensor,
    depth: Tensor,
    max_depth: Tensor,
    uniforms: Tensor,
    q_draft: Tensor | None,
) -> None:
    check(p_target.dim() == 3, f"p_target must be [B, T, V], got {tuple(p_target.shape)}")
    b, t, _ = p_target.shape
    for name, tensor in (("tokens", tokens), ("depth", depth)):
        check(tuple(tensor.shape) == (b, t), f"{name} must be [B={b}, T={t}], got {tuple(tensor.shape)}")
    check(
        children.dim() == 3 and tuple(children.shape[:2]) == (b, t),
        f"children must be [B={b}, T={t}, C], got {tuple(children.shape)}",
    )
    check(tuple(max_depth.shape) == (b,), f"max_depth must be [B={b}], got {tuple(max_depth.shape)}")
    check(
        uniforms.dim() == 2 and uniforms.shape[0] == b and uniforms.shape[1] >= num_uniforms(t),
        f"uniforms must be [B={b}, U >= {num_uniforms(t)}], got {tuple(uniforms.shape)}",
    )
    if q_draft is not None:
        check(
            q_draft.shape == p_target.shape,
            f"q_draft must have p_target's shape {tuple(p_target.shape)}, got {tuple(q_draft.shape)}",
        )


def _valid_children(
    kids: Tensor,  # [B, C] child node indices of the current node, -1 padded
    tokens: Tensor,  # [B, T]
    depth: Tensor,  # [B, T]
    max_depth: Tensor,  # [B]
) -> tuple[Tensor, Tensor]:
    """(child tokens [B, C], valid [B, C]): real, within the depth cap, not an earlier duplicate."""
    safe = kids.clamp(min=0)  # [B, C]
    kid_tokens = tokens.gather(1, safe)  # [B, C]
    valid = (kids >= 0) & (depth.gather(1, safe) <= max_depth[:, None])  # [B, C]
    if kids.shape[1] == 1:  # a single child (chains) cannot repeat a sibling
        return kid_tokens, valid
    same = kid_tokens[:, :, None] == kid_tokens[:, None, :]  # [B, C, C]
    slot = torch.arange(kids.shape[1], device=kids.device)  # [C]
    earlier = slot[None, :] < slot[:, None]  # [C, C] [j, i]: slot i comes before slot j
    duplicate = (same & earlier & valid[:, None, :]).any(-1)  # [B, C]
    return kid_tokens, valid & ~duplicate


def _conditional_draft(q_rest: Tensor, x: Tensor) -> tuple[Tensor, Tensor]:
    """q_j = norm(q with earlier-drawn siblings zeroed) [B, V] and q_j(x) [B] ([EAGLE code])."""
    total = q_rest.sum(-1, keepdim=True)  # [B, 1]
    q_j = torch.where(total > 0, q_rest / total.clamp(min=torch.finfo(q_rest.dtype).tiny), 0.0)
    return q_j, q_j.gather(-1, x[:, None]).squeeze(-1)


@dataclass(frozen=True)
class _Test:
    accepted: Tensor  # [B] bool
    rejected: Tensor  # [B] bool
    relaxed_only: Tensor  # [B] bool: accepted, but not by the exact rule
    residual: Tensor  # [B, V] r after this slot
    budget: TokenBudget | None = None  # the level's token budget after this slot


def _test_candidate(
    r: Tensor,  # [B, V]
    q_rest: Tensor | None,  # [B, V] q with earlier siblings zeroed
    x: Tensor,  # [B]
    testing: Tensor,  # [B] bool rows that test this slot
    u: Tensor,  # [B]
    neighbours: Tensor | None,
    relax: RelaxationConfig | None,
    budget: TokenBudget | None = None,  # the level's token budget (relax.budget == "token")
    relaxable: Tensor | None = None,  # [B] bool: x was drawn from a model distribution (None: yes)
) -> _Test:
    """One candidate test: accept with min(1, p̃(x)/q_j(x)), else update the residual.

    Under the token budget p̃(x) is capped by what the level has left (:mod:`lantern.decoding.budget`);
    a rejected sampled draft takes the exact residual, so the walk stays coupled to the lossless
    one (deterministic drafts keep the paper's residual: the moved mass comes from A(x)).
    """
    r_x = r.gather(-1, x[:, None]).squeeze(-1)  # [B]
    q_j, q_x = None, torch.ones_like(r_x)
    q_test = q_x  # what p_tilde is divided by: q_j(x), or q_j(G(x)) for the group rule
    if q_rest is not None:
        q_j, q_x = _conditional_draft(q_rest, x)
        testing = testing & (q_x > 0)  # never drawable: skipped without a residual update
        q_test = torch.where(q_x > 0, draft_mass(q_j, r, x, relax), 1.0)
        q_x = torch.where(q_x > 0, q_x, torch.ones_like(q_x))
    if budget is None or relax is None:
        p_tilde, m_len = relaxed_mass(r, x, neighbours, relax)  # [B], [B]
    else:
        p_tilde, m_len = _budgeted_mass(r, x, neighbours, relax, budget.cap(relax, x, q_x), q_rest is not None)
    p_tilde, m_len = drawn_credit(p_tilde, m_len, r_x, relaxable, relax)
    u = u.to(p_tilde.dtype)
    accepted = testing & (u < (p_tilde / q_test).clamp(max=1.0))
    rejected = testing & ~accepted
    relaxed_only = accepted & ~(u < (r_x / q_x).clamp(max=1.0))
    if budget is not None:
        budget = budget.after_test(r_x, p_tilde, q_x, testing)
        relax = relax if q_rest is None else None
    if not _any(rejected):  # most tests accept: the residual update would be thrown away
        return _Test(accepted, rejected, relaxed_only, r, budget)
    new_r = rejection_residual(r, x, p_tilde, m_len, q_j, neighbours, relax)  # [B, V]
    return _Test(accepted, rejected, relaxed_only, torch.where(rejected[:, None], new_r, r), budget)


def _budgeted_mass(
    r: Tensor,  # [B, V]
    x: Tensor,  # [B]
    neighbours: Tensor | None,
    relax: RelaxationConfig,
    cap: Tensor,  # [B] the token budget's neighbour-mass cap
    sampled: bool,
) -> tuple[Tensor, Tensor]:
    """``(p̃(x), m_len)`` under the token budget (docs/relaxation_budget.md).

    Deterministic drafts: the longest neighbour prefix within the cap, whose mass the paper's
    residual then takes from A(x). Sampled drafts are followed by the exact residual, so the credit
    need not be whole tokens: x gets ``min(cap, mass of its k nearest neighbours)`` (m_len 0).
    Whole tokens would waste most of a cap of δ·q(x), which is often below one neighbour's mass.
    """
    if not sampled:
        return relaxed_mass(r, x, neighbours, relax, cap)
    everything, _ = relaxed_mass(r, x, neighbours, relax, torch.full_like(cap, math.inf))
    r_x = r.gather(-1, x[:, None]).squeeze(-1)
    return r_x + torch.minimum(cap, everything - r_x), torch.zeros_like(x)


def _any(mask: Tensor) -> bool:
    """``mask.any()`` where reading it is free (eager CPU); True on accelerators, where the host
    sync would cost more than the kernels it saves, and inside a compiled region, where a
    data-dependent branch would break the graph: the caller then simply does the work."""
    return mask.device.type != "cpu" or torch.compiler.is_compiling() or bool(mask.any())


@dataclass(frozen=True)
class _Level:
    child: Tensor  # [B] accepted child node, -1 if none
    residual: Tensor  # [B, V] r at the end of the level
    rejected: Tensor  # [B] bool: some sibling was rejected
    relaxed_only: Tensor  # [B] bool: the accepted child was relaxed-accepted


def _verify_level(
    r: Tensor,  # [B, V] p_target at the current node
    q_node: Tensor | None,  # [B, V] q_draft at the current node
    kids: Tensor,  # [B, C] child nodes, -1 padded, sibling (draw) order
    kid_tokens: Tensor,  # [B, C]
    valid: Tensor,  # [B, C]
    u: Tensor,  # [B, C] each child's own uniform
    active: Tensor,  # [B] rows still walking down the tree
    neighbours: Tensor | None,
    relax: RelaxationConfig | None,
    kid_relaxable: Tensor | None = None,  # [B, C] bool: each child was drawn from a model distribution
) -> _Level:
    """Test the children of each row's current node in sibling order; stop at the first accept."""
    child = torch.full_like(kids[:, 0], -1)  # [B]
    rejected = torch.zeros_like(active)
    relaxed_only = torch.zeros_like(active)
    budget = TokenBudget.start(r) if uses_token_budget(relax) else None
    num_slots = kids.shape[1]
    for j in range(num_slots):
        x = kid_tokens[:, j].clamp(min=0)  # [B]
        testing = active & valid[:, j] & (child < 0)
        if _any(testing):  # else every row accepted an earlier sibling or has no usable one here
            drawn = None if kid_relaxable is None else kid_relaxable[:, j]
            test = _test_candidate(r, q_node, x, testing, u[:, j], neighbours, relax, budget, drawn)
            r, rejected, budget = test.residual, rejected | test.rejected, test.budget
            relaxed_only = relaxed_only | test.relaxed_only
            child = torch.where(test.accepted, kids[:, j], child)
        if q_node is not None and j + 1 < num_slots:  # the drafter drew this sibling: later draws exclude it
            q_node = torch.where((kids[:, j] >= 0)[:, None], q_node.scatter(1, x[:, None], 0.0), q_node)
    return _Level(child, r, rejected, relaxed_only)


def _probability_dtype(p: Tensor) -> torch.dtype:
    return torch.promote_types(p.dtype, torch.float32)


def verify_tree_sampled(
    p_target: Tensor,  # [B, T, V] target distribution at every tree node (after CFG + processor)
    tokens: Tensor,  # [B, T] node tokens; node 0 is the already-accepted root
    children: Tensor,  # [B, T, C] child node indices in sibling (draw) order, -1 padded
    depth: Tensor,  # [B, T] node depth, root 0
    max_depth: Tensor,  # [B] deepest usable node depth per row
    uniforms: Tensor,  # [B, U >= T+1] in [0, 1): column n tests node n, the last one samples
    q_draft: Tensor | None = None,  # [B, T, V] drafter distribution each node's children came from
    neighbours: Tensor | None = None,  # [V, K] proximity table (int32 or int64)
    relaxation: RelaxationConfig | None = None,
    levels: int | None = None,  # the trees' depth if known (TreeBuffers.max_depth): saves a host sync
    relaxable: Tensor | None = None,  # [B, T] bool: node n was drawn from a model distribution (None: all)
) -> VerifyResult:
    """Verify a draft tree per row by (relaxed) speculative sampling ([EAGLE], [EAGLE-2], [LANTERN]).

    Walk down from the root level by level. At each node, r := p_target there; its children are
    tested in sibling order, deterministic drafts (``q_draft`` None) with probability
    ``min(1, p̃(x))`` and drafts sampled without replacement with ``min(1, p̃(x)/q_j(x))``. A
    rejection updates r (:func:`rejection_residual`); the first acceptance moves to that child.
    If every child is rejected the recovered token is drawn from r; at a node without valid
    children the bonus token is drawn from fresh p_target. Without relaxation the output is
    exactly distributed as p_target (lossless), and so is every undrawn guess's position
    (``relaxable`` False: tested exactly).
    """
    _check_sampled_inputs(p_target, tokens, children, depth, max_depth, uniforms, q_draft)
    b, _, v = p_target.shape
    relax = _active_relaxation(relaxation, neighbours, v)
    dtype = _probability_dtype(p_target)
    p_target = p_target.to(dtype)
    q_draft = None if q_draft is None else q_draft.to(dtype)
    tokens, children, depth = tokens.long(), children.long(), depth.long()
    rows = torch.arange(b, device=p_target.device)
    d_max = int(depth.max()) if levels is None else levels
    cur = torch.zeros(b, dtype=torch.long, device=p_target.device)  # [B] current node
    path = torch.full((b, d_max + 1), -1, dtype=torch.long, device=p_target.device)
    path[:, 0] = 0
    num_relaxed = torch.zeros_like(cur)
    final_r = p_target[:, 0]  # [B, V] distribution of next_token, set when a row stops
    is_bonus = torch.ones(b, dtype=torch.bool, device=p_target.device)
    active = torch.ones_like(is_bonus)
    for level in range(d_max):
        if not _any(active):  # every row stopped (free to check on a CPU only)
            break
        kids = children[rows, cur]  # [B, C]
        kid_tokens, valid = _valid_children(kids, tokens, depth, max_depth)
        u = uniforms.gather(1, kids.clamp(min=0))  # [B, C]
        q_node = None if q_draft is None else q_draft[rows, cur]
        kid_relaxable = None if relaxable is None else relaxable.gather(1, kids.clamp(min=0))
        out = _verify_level(p_target[rows, cur], q_node, kids, kid_tokens, valid, u, active, neighbours, relax,
                            kid_relaxable)
        moved = active & (out.child >= 0)
        stopped = active & ~moved
        final_r = torch.where(stopped[:, None], out.residual, final_r)
        is_bonus = torch.where(stopped, ~out.rejected, is_bonus)
        path[:, level + 1] = torch.where(moved, out.child, -1)
        num_relaxed += (moved & out.relaxed_only).long()
        cur, active = torch.where(moved, out.child, cur), moved
    # Rows still walking reached a node at the maximum depth: bonus from fresh p_target there.
    final_r = torch.where(active[:, None], p_target[rows, cur], final_r)
    next_token = sample_from_probs(final_r, uniforms[:, -1])
    num_accepted = (path[:, 1:] >= 0).sum(-1)
    return VerifyResult(path, num_accepted, next_token, num_relaxed, is_bonus)


def verify_chain_sampled(
    p_target: Tensor,  # [B, T, V] target distribution at every chain node (after CFG + processor)
    tokens: Tensor,  # [B, T] node tokens; node d is at depth d (node 0 = the accepted root)
    max_depth: Tensor,  # [B] deepest usable node depth per row
    uniforms: Tensor,  # [B, U >= T+1]: column d tests node d, the last one samples
    q_draft: Tensor | None = None,  # [B, T, V]: node d's child was drawn from q_draft[:, d]
    neighbours: Tensor | None = None,
    relaxation: RelaxationConfig | None = None,
    relaxable: Tensor | None = None,  # [B, T] bool: node d was drawn from a model distribution (None: all)
    subsequence: SubsequenceConfig | None = None,  # SJD-SV: runs of drafts tested together (relaxed)
) -> VerifyResult:
    """:func:`verify_tree_sampled` for a chain (one child per node), with every depth at once.

    In a chain no node has a rejected sibling before its test, so the test of node d uses the
    untouched ``p_target`` and ``q_draft`` of its parent and does not depend on the other tests:
    all of them can be evaluated in one batched pass, and the walk's outcome is the first failed
    test. Only that node's residual is then needed. With the same uniforms the result equals
    :func:`verify_tree_sampled`'s exactly (tested); it exists because on a CPU each level of the
    general walk costs ~50 small ops, which is a tenth of a round for a 5-token chain.

    ``subsequence`` replaces the draft-by-draft walk with SJD-SV's run test
    (:func:`lantern.decoding.subsequence.subsequence_accepted`) over the same per-draft ratios; the
    recovered token at the first failed draft is that draft's residual, as without it.
    """
    b, t, v = p_target.shape
    check(t >= 2, f"a chain needs at least one draft, got {t} node(s)")
    check(tuple(tokens.shape) == (b, t), f"tokens must be [B={b}, T={t}], got {tuple(tokens.shape)}")
    check(
        uniforms.dim() == 2 and uniforms.shape[0] == b and uniforms.shape[1] >= num_uniforms(t),
        f"uniforms must be [B={b}, U >= {num_uniforms(t)}], got {tuple(uniforms.shape)}",
    )
    relax = _active_relaxation(relaxation, neighbours, v)
    dtype = _probability_dtype(p_target)
    d = t - 1  # drafts
    r = p_target[:, :-1].to(dtype).reshape(b * d, v)  # [B*D, V] distribution each draft is tested against
    x = tokens[:, 1:].long().reshape(b * d)  # [B*D]
    r_x = r.gather(-1, x[:, None]).squeeze(-1)
    q_j, q_x = None, torch.ones_like(r_x)
    if q_draft is not None:
        q_j, q_x = _conditional_draft(q_draft[:, :-1].to(dtype).reshape(b * d, v), x)
    depth = torch.arange(1, t, device=p_target.device)  # [D]
    usable = (depth[None, :] <= max_depth[:, None]).reshape(b * d) & (q_x > 0)  # tested at all
    q_test = torch.where(q_x > 0, draft_mass(q_j, r, x, relax), 1.0)  # q_j(x), or q_j(G(x)) (group rule)
    q_x = torch.where(q_x > 0, q_x, torch.ones_like(q_x))
    rule = relax  # the credit rule (below, ``relax`` becomes the residual's rule)
    # Each chain node has one child, so a token budget is a fresh one per test (docs/relaxation_budget.md).
    if relax is not None and uses_token_budget(relax):
        cap = TokenBudget.start(r).cap(relax, x, q_x)
        p_tilde, m_len = _budgeted_mass(r, x, neighbours, relax, cap, q_draft is not None)  # [B*D]
        relax = relax if q_draft is None else None  # rejected sampled drafts take the exact residual
    else:
        p_tilde, m_len = relaxed_mass(r, x, neighbours, relax)  # [B*D]
    drawn = None if relaxable is None else relaxable[:, 1:].reshape(b * d)
    p_tilde, m_len = drawn_credit(p_tilde, m_len, r_x, drawn, rule)
    u = uniforms[:, 1:t].to(dtype).reshape(b * d)
    exact = u < (r_x / q_x).clamp(max=1.0)
    if subsequence is None:
        accepted = usable & (u < (p_tilde / q_test).clamp(max=1.0))
        prefix = accepted.view(b, d).long().cumprod(-1)  # [B, D] 1 while every test so far passed
    else:
        member = None if drawn is None else drawn.view(b, d)
        prefix = subsequence_accepted(r_x.view(b, d), (p_tilde / q_test).view(b, d), member, usable.view(b, d),
                                      u.view(b, d), subsequence.alpha).long()
    num_accepted = prefix.sum(-1)  # [B]
    rows = torch.arange(b, device=p_target.device)
    path = torch.where(prefix.bool(), depth[None, :], -1)
    path = torch.cat([torch.zeros(b, 1, dtype=torch.long, device=p_target.device), path], dim=1)
    num_relaxed = (prefix.bool() & ~exact.view(b, d)).sum(-1)
    # The walk stops at node a = num_accepted. Its child was rejected if it was tested; else
    # (depth cap, or a draft q could never produce) the next token is a bonus from p there.
    stop = num_accepted.clamp(max=d - 1)  # index of the failed test, when there is one
    flat = rows * d + stop
    rejected = (num_accepted < d) & usable[flat]
    final_r = p_target[rows, num_accepted].to(dtype)  # [B, V] bonus distribution
    if _any(rejected):
        residual = rejection_residual(
            r[flat], x[flat], p_tilde[flat], m_len[flat], None if q_j is None else q_j[flat], neighbours, relax
        )
        final_r = torch.where(rejected[:, None], residual, final_r)
    next_token = sample_from_probs(final_r, uniforms[:, -1])
    return VerifyResult(path, num_accepted, next_token, num_relaxed, ~rejected)
