"""The one decoding loop: prefill -> propose -> verify -> accept -> commit (STYLE lesson 7).

Every method is a configuration of this loop:

* AR: no drafter; the "tree" is the pending root alone, so each target forward yields one token.
* Speculative decoding (SD): an EAGLE drafter proposes a chain, static or dynamic tree; the
  target verifies it in one forward; an acceptance rule keeps a root->node path plus one more
  token (recovered after a rejection, or bonus after a full path).
* LANTERN / LANTERN++: the same, with a relaxed acceptance rule (``RelaxationConfig``).
* SJD (``lantern.decoding.jacobi``): the target drafts for itself; the tree is a chain of Jacobi guesses
  and the drafter also observes each verify forward's logits (``VerifyObserver``).
* PJD (``lantern.decoding.pjd``): a ``GridDrafter`` lays out one Jacobi chain per open image row; the
  round verifies them in one forward with a row-causal mask (``Target.verify_grid``), accepts each
  chain with the same chain rule and commits tokens out of raster order (``Target.commit_grid``).

Rows of a batch progress independently: each has its own committed length, its own tree depth cap
near the end of the image, and its own random stream (``lantern.decoding.rng.RowRandom``: a counter
hash of the row's seed, seeded from the row's ``torch.Generator``) — a row draws the same random
numbers whether it runs alone or in a batch, so batching never changes a row's codes.

Under ``compile`` a whole round (propose, verify, accept, commit, bookkeeping) is one compiled
region (``lantern.decoding.compiling.round_fn``): the loop's Python runs once per round around it, and
its one host sync is the termination test.

State at the top of each iteration, per row: ``n`` image tokens are known, the first ``n - 1`` are
in the target's KV cache and the last one (the *root*) is pending; the root is node 0 of the tree.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol, Self, runtime_checkable

import torch
from torch import Tensor
from tqdm.auto import tqdm

from lantern.decoding.acceptance import credited, verify_chain_sampled, verify_tree_sampled
from lantern.decoding.cache import CachePool
from lantern.decoding.compiling import resolve_compile, round_fn
from lantern.decoding.config import RelaxationConfig, SamplingConfig, SubsequenceConfig
from lantern.decoding.greedy import verify_chain_greedy_subsequence, verify_tree_greedy
from lantern.decoding.phases import NO_PHASE, phase
from lantern.decoding.pjd import GridBlock
from lantern.decoding.resident import keep_resident
from lantern.decoding.rng import RowRandom
from lantern.decoding.rows import copy_rows, movable
from lantern.decoding.sampling import probs_from_logits, sample_from_probs
from lantern.decoding.trees import TreeBuffers, tree_from_parents
from lantern.errors import check


class CodeHead(Protocol):
    """A target's code head, which its drafter shares: hidden states [..., D] -> code logits [..., V].

    An ``nn.Linear`` (LlamaGen, Chameleon, Emu3) or an ``nn.Module`` standing in for one (Janus's
    ``GenerationHead``, an MLP): what the loop, the drafters and their training read of it is the
    call, ``weight`` (inputs are cast to its dtype), ``to`` a dtype and its ``modules``."""

    @property
    def weight(self) -> Tensor: ...

    def __call__(self, hidden: Tensor) -> Tensor: ...

    def to(self, dtype: torch.dtype) -> Self: ...

    def modules(self) -> Iterator[torch.nn.Module]: ...


class Target(Protocol):
    """What the loop needs from a target adapter (``LlamaGenTarget``, ``lantern.targets.chameleon.ChameleonTarget``).

    The loop works in *code* space: ``vocab_size`` is the number of VQ codes, ``lm_head`` maps a
    hidden state to code logits (the drafter shares it), ``num_tokens`` is the image's code count.
    """

    sampling: SamplingConfig
    streams: int  # 2 with classifier-free guidance ([cond; uncond] rows), else 1

    @property
    def forwards(self) -> int | Tensor:
        """Model forwards so far (a device counter where a compiled round counts them). Read-only here:
        the loop only reads it, so an adapter may keep an ``int`` or a ``Tensor``."""
        ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def lm_head(self) -> CodeHead: ...

    def start(self, cond: Tensor, cond_mask: Tensor | None = None,
              guidance: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
        """Prefill ``cond``; ``guidance``: CFG's unconditional rows (ids, mask) written per row by the
        caller (a negative prompt each), else the target's own."""

    def verify(self, tokens: Tensor, tree_mask: Tensor, depth: Tensor, tree: TreeBuffers | None = None
               ) -> tuple[Tensor, Tensor]: ...

    def commit(self, path: Tensor, num_keep: Tensor, in_order: bool = False) -> None:
        """Keep tree nodes ``path[:, :num_keep]`` (root first) in the cache. ``in_order``: every path is
        nodes 0, 1, 2 ... (a chain, or AR's lone root), which already sit where the cache keeps them."""


class GridTarget(Target, Protocol):
    """A target that can verify PJD's grid blocks (``lantern.decoding.pjd``): tokens at explicit image
    cells, visibility from the row-causal mask, commits out of raster order."""

    def verify_grid(self, tokens: Tensor, cells: Tensor, rows: Tensor, chains: int | None = None) -> Tensor: ...

    def commit_grid(self, keep: Tensor, num_keep: Tensor) -> None: ...


@dataclass(frozen=True)
class DraftTree:
    """A proposal for every row: tree nodes, their structure and the drafter's distributions."""

    tokens: Tensor  # [B, T] node tokens; node 0 is the pending root
    buffers: TreeBuffers  # parents / depth / mask / children / retrieve, batched [B, ...]
    # [B, T, V] drafter distribution at each node from which its children were drawn (in sibling
    # order, without replacement); None for deterministic (top-k) drafts, where q is a point mass.
    q_draft: Tensor | None = None
    # [B, T] bool: node n's token was drawn from a model distribution, so a relaxed rule may credit
    # it; False for model-free guesses (Jacobi initialisation), which are tested exactly. None: all.
    relaxable: Tensor | None = None
    # [B, T] bool: drawn, and conditioned on what its test will see (clean-context credit,
    # ``RelaxationConfig.credit``; Jacobi redraws). None: every drawn node (a tree drafter's).
    clean: Tensor | None = None


class Drafter(Protocol):
    """What the loop needs from a drafter (EAGLE-style: it reads the target's hidden states)."""

    @property
    def forwards(self) -> int | Tensor: ...  # read-only to the loop: an int or a device counter

    def start(self, hidden: Tensor, root: Tensor) -> None:
        """hidden [S*B, L, D]: target features of the prefilled condition; root [B]: token 0."""

    def propose(self, rng: RowRandom | None, active: Tensor, max_depth: Tensor) -> DraftTree:
        """Draft a tree per row rooted at the pending token. active [B] bool; max_depth [B];
        rng: the rows' random streams (None: greedy)."""

    def commit(self, hidden: Tensor, next_tokens: Tensor, num_new: Tensor) -> None:
        """hidden [S*B, A, D]: target features along each row's accepted path (root first);
        next_tokens [B, A]: the token that follows each of those positions; num_new [B]."""


@runtime_checkable
class VerifyObserver(Protocol):
    """Optional drafter hook: a drafter that has ``observe_verify`` is shown the guided logits of
    every verify forward, before ``commit``. SJD (``lantern.decoding.jacobi``) drafts from them (Jacobi
    carry-over); EAGLE drafters read hidden states in ``commit`` and do not need it."""

    def observe_verify(self, logits: Tensor, probs: Tensor | None = None) -> None:
        """logits [B, T, V]: the target's guided logits at every node of the verified tree; probs
        [B, T, V]: their probabilities under the run's sampling, when the acceptance made them
        (sampled decoding of a tree), else None."""


@runtime_checkable
class GridDrafter(Protocol):
    """A drafter that decodes several image rows per round (PJD, ``lantern.decoding.pjd.GridJacobiDrafter``):
    the loop then runs :func:`_grid_round` (``Target.verify_grid`` / ``commit_grid``) instead of
    the raster round; raster-order drafters never pay for the grid."""

    @property
    def forwards(self) -> int | Tensor: ...  # read-only to the loop: an int or a device counter

    def start(self, hidden: Tensor, root: Tensor) -> None: ...

    def propose_grid(self, rng: RowRandom | None) -> GridBlock: ...

    def commit_grid(
        self, block: GridBlock, num_acc: Tensor, next_token: Tensor, logits: Tensor, rng: RowRandom | None,
        probs: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """``probs``: the target's p from ``logits`` [B, T, V] if the acceptance made it (sampled)."""


@dataclass
class SpecStats:
    """Counts per row; ``mean_accepted`` = tokens per target forward (1.0 for AR)."""

    target_forwards: Tensor  # [B] forwards each row took part in, prefill included
    tokens_per_step: list[Tensor] = field(default_factory=list)  # per step: [B], 0 = inactive
    generated_tokens: int = 0  # per row
    drafter_forwards: int = 0
    relaxed_accepts: int = 0  # drafts accepted only thanks to the relaxation

    @property
    def steps(self) -> int:
        return len(self.tokens_per_step)

    @property
    def mean_accepted_per_row(self) -> Tensor:
        return self.generated_tokens / self.target_forwards.float()

    @property
    def mean_accepted(self) -> float:
        return float(self.mean_accepted_per_row.mean())

    def accept_histogram(self) -> dict[int, int]:
        """How many verify steps yielded 1, 2, ... tokens (over all rows)."""
        if not self.tokens_per_step:
            return {}
        all_steps = torch.stack(self.tokens_per_step).flatten()
        values, counts = torch.unique(all_steps[all_steps > 0], return_counts=True)
        return {int(v): int(c) for v, c in zip(values, counts, strict=True)}

    def to_dict(self) -> dict[str, object]:
        return {
            "generated_tokens": self.generated_tokens,
            "target_forwards": [int(x) for x in self.target_forwards],
            "mean_accepted": self.mean_accepted,
            "mean_accepted_per_image": [float(x) for x in self.mean_accepted_per_row],
            "drafter_forwards": self.drafter_forwards,
            "relaxed_accepts": self.relaxed_accepts,
            "accept_histogram": self.accept_histogram(),
        }


@dataclass
class GenerationOutput:
    codes: Tensor  # [B, N] image tokens in raster order
    stats: SpecStats


@dataclass(frozen=True)
class Acceptance:
    """How drafted tokens are accepted: exact (``relaxation`` None) or LANTERN-relaxed, one draft at
    a time or (``subsequence``, SJD-SV: chains only) by runs of drafts."""

    relaxation: RelaxationConfig | None = None
    neighbours: Tensor | None = None  # [V, K_max] latent proximity table
    subsequence: SubsequenceConfig | None = None  # lantern.decoding.subsequence (relaxed whatever the rule)
    # Benchmarks only, never decoding: accept exactly this many drafts per round (along the tree's
    # first path, capped by the image's end), whatever the rule says, so that a round's cost can be
    # timed at a chosen acceptance on random weights (benchmarks/round_cost.py). The rule still runs.
    fixed_accept: int | None = None

    def __post_init__(self) -> None:
        if self.relaxation is not None and not self.relaxation.is_exact and self.relaxation.uses_table:
            check(self.neighbours is not None, "relaxed acceptance needs a proximity table")


def _root_only_tree(batch: int, device: torch.device) -> TreeBuffers:
    return tree_from_parents(torch.full((batch, 1), -1, dtype=torch.long, device=device))


def generate(
    target: Target,
    cond: Tensor,
    *,
    generators: list[torch.Generator] | None = None,
    drafter: Drafter | GridDrafter | None = None,
    acceptance: Acceptance | None = None,
    cond_mask: Tensor | None = None,
    progress: bool = False,
    compile: str | None = None,
    caches: CachePool | None = None,
    guidance: tuple[Tensor, Tensor] | None = None,
) -> GenerationOutput:
    """Generate ``target.num_tokens`` image tokens for each condition row.

    cond: labels [B] (c2i) or captions [B, cls, C] (t2i); generators: one per row (required unless
    sampling is greedy): each seeds its row's counter-based stream (``lantern.decoding.rng``) with one
    draw. compile: run each round as one compiled region (``lantern.decoding.compiling.round_fn``).
    caches: the pool that keeps the decode's state at fixed addresses from one call to the next
    (``lantern.decoding.resident``; what CUDA graphs replay on), normally the one the target's caches
    come from; None: the state is allocated per call. guidance: each row's own unconditional rows
    (ids, mask: ``Target.start``'s), None: the target's.
    """
    # inference_mode rather than no_grad: no version counters or view tracking on the many small
    # ops of a decode step (~7% of a CPU verify forward at batch 1). The codes are cloned outside
    # it, so callers get ordinary tensors they may use in autograd (e.g. as training data).
    with torch.inference_mode():
        mode = resolve_compile(compile, target.device)
        out = _generate(target, cond, generators, drafter, acceptance, cond_mask, progress, mode, caches, guidance)
    return GenerationOutput(codes=out.codes.clone(), stats=out.stats)


def _generate(
    target: Target,
    cond: Tensor,
    generators: list[torch.Generator] | None,
    drafter: Drafter | GridDrafter | None,
    acceptance: Acceptance | None,
    cond_mask: Tensor | None,
    progress: bool,
    compile: str | None,
    caches: CachePool | None,
    guidance: tuple[Tensor, Tensor] | None = None,
) -> GenerationOutput:
    sampling = target.sampling
    b, n_total, device = cond.shape[0], target.num_tokens, target.device
    check(
        sampling.greedy or (generators is not None and len(generators) == b),
        f"sampling needs one torch.Generator per row ({b}), got {0 if generators is None else len(generators)}",
    )
    rng = None if generators is None else RowRandom.from_generators(generators, device)
    # 1. Prefill.
    decode = start_decode(target, cond, rng, drafter, acceptance, cond_mask, compile, caches, guidance)
    # Per-round counters stay on the device; one host copy at the end, not one sync per round.
    forwards = torch.ones(b, dtype=torch.long, device=device)
    per_step: list[Tensor] = []
    relaxed_total = torch.zeros((), dtype=torch.long, device=device)
    bar = tqdm(total=b * n_total, disable=not progress, desc="tokens", unit="tok", leave=False)
    bar.update(b)
    # 2-5. Rounds. The one host sync of a round: whether any row still needs tokens.
    while bool((active := decode.n < n_total).any()):
        new, relaxed = decode.round(active)
        forwards += active
        per_step.append(new)
        relaxed_total += relaxed
        if progress:
            bar.update(int(new.sum()))
    bar.close()
    stats = SpecStats(target_forwards=forwards.cpu(), generated_tokens=n_total, relaxed_accepts=int(relaxed_total))
    if per_step:
        stats.tokens_per_step = list(torch.stack(per_step).cpu().unbind(0))
    if drafter is not None:
        stats.drafter_forwards = int(drafter.forwards)
    return GenerationOutput(codes=decode.codes[:, :n_total], stats=stats)


@dataclass
class Decode:
    """A decode in progress (what :func:`start_decode` returns): the loop's state between rounds,
    and the round itself (one compiled region under ``compile``). ``lantern.generate`` drives it to
    the end of the image; ``benchmarks/round_cost.py`` times single rounds of it."""

    target: Target
    drafter: Drafter | GridDrafter | None
    acceptance: Acceptance
    rng: RowRandom | None
    codes: Tensor  # [B, 2N]: codes in raster order, then a padding tail (see _write_codes)
    n: Tensor  # [B] known tokens per row
    root: Tensor  # [B] the pending token
    compiled: bool
    grid: bool  # PJD: the drafter lays out image rows (checked once: a Protocol isinstance is slow)
    _step: Callable[..., tuple[Tensor, ...]]
    _ar_tree: TreeBuffers

    def step_args(self, active: Tensor) -> tuple[object, ...]:
        """The arguments of one call of the round function (:func:`_raster_round` / :func:`_grid_round`)."""
        sampling = self.target.sampling
        if self.grid:
            return self.target, self.drafter, self.codes, self.rng, sampling, self.acceptance, active
        return (self.target, self.drafter, self.codes, self.n, self.root, self.rng, sampling, self.acceptance, active,
                self._ar_tree)

    @property
    def batch(self) -> int:
        return int(self.codes.shape[0])

    def row_tensors(self) -> list[tuple[Tensor | None, int, int]]:
        """Every per-row tensor of the decode (``lantern.decoding.rows``): the loop's codes, counts and
        pending roots, the random streams, the target's and the drafter's state."""
        own: list[tuple[Tensor | None, int, int]] = [(self.codes, 1, 0), (self.n, 1, 0), (self.root, 1, 0)]
        rng = [] if self.rng is None else self.rng.row_tensors()
        drafter = [] if self.drafter is None else self.drafter.row_tensors()  # type: ignore[union-attr]
        return [*own, *rng, *self.target.row_tensors(), *drafter]  # type: ignore[attr-defined]

    def take_rows(self, other: Decode, rows: Tensor, from_rows: Tensor | None = None) -> None:
        """Rows ``from_rows`` (default: all) of ``other``, a decode of the same method, settings and
        model, become rows ``rows`` of this one, in place (continuous batching: ``lantern.decoding.rows``)."""
        check(movable(self.target, self.drafter), "this method's decode state cannot move rows between batches")
        src = torch.arange(other.batch, device=rows.device) if from_rows is None else from_rows
        check(src.shape == rows.shape, f"{src.shape[0]} rows to take into {rows.shape[0]}")
        copy_rows(self.row_tensors(), other.row_tensors(), rows, src, self.batch, other.batch)

    def finish_rows(self, rows: Tensor) -> None:
        """Mark ``rows`` done (a row that is free, or whose request went away): later rounds skip them."""
        self.n.index_fill_(0, rows, self.target.num_tokens)

    def state(self) -> list[object]:
        """What the round reads besides its per-round arguments (named by ``STATE_NAMES``): what
        ``round_fn`` fingerprints and, under CUDA graphs, marks as fixed addresses."""
        return _round_state(self.target, self.drafter, self.rng, self.codes, self.acceptance, self._ar_tree)

    def round(self, active: Tensor) -> tuple[Tensor, Tensor]:
        """One round for the rows that are ``active`` [B]: (new tokens [B], relaxed-only accepts [])."""
        with phase("round") if self.compiled else NO_PHASE:  # a compiled round's phases are inside it
            out = self._step(*self.step_args(active))
        if self.grid:  # PJD: several image rows per round, committed out of raster order
            new, relaxed = out
            self.n = self.n + new
        else:
            new, self.root, self.n, relaxed = out
        return new, relaxed


def start_decode(
    target: Target,
    cond: Tensor,
    rng: RowRandom | None,
    drafter: Drafter | GridDrafter | None = None,
    acceptance: Acceptance | None = None,
    cond_mask: Tensor | None = None,
    compile: str | None = None,
    caches: CachePool | None = None,
    guidance: tuple[Tensor, Tensor] | None = None,
) -> Decode:
    """Prefill the condition (token 0 comes from its last position) and set up the rounds;
    ``compile``: a resolved mode of ``lantern.decoding.compiling`` (None: eager); ``caches``: the
    pool that keeps the round's state at the previous decode's addresses (see :func:`generate`);
    ``guidance``: the rows' own unconditional rows (``Target.start``'s)."""
    b, n_total, device = cond.shape[0], target.num_tokens, target.device
    with phase("prefill"):
        logits0, hidden0 = target.start(cond, cond_mask, guidance)
        root = _sample(logits0, target.sampling, rng)
    # Codes are written at n + j for every path slot j, active row or not, so the buffer has a
    # padding tail (see _write_codes): static shapes, no boolean-mask indexing; sliced off at the end.
    codes = torch.full((b, 2 * n_total), -1, dtype=torch.long, device=device)
    codes[:, 0] = root
    if drafter is not None:
        drafter.start(hidden0, root)
    grid = isinstance(drafter, GridDrafter)  # checked once: raster methods keep their round as it was
    acceptance = acceptance or Acceptance()
    check(not grid or acceptance.subsequence is None, "subsequence verification (SJD-SV) is not implemented for "
                                                      "PJD's grid of chains")
    ar_tree = _root_only_tree(b, device)
    state = _round_state(target, drafter, rng, codes, acceptance, ar_tree)
    if caches is not None:  # eager too: the CPU tests check what a GPU's CUDA graphs replay on
        keep_resident(state, caches.residents)
        rng, codes, ar_tree = state[2], state[3], state[6]  # type: ignore[assignment]
    step = round_fn(_grid_round if grid else _raster_round, compile, device, state=tuple(state))
    n = torch.ones(b, dtype=torch.long, device=device)
    return Decode(target, drafter, acceptance, rng, codes, n, root.clone(), compile is not None, grid, step, ar_tree)


# What a round reads besides its per-round arguments, in this order (``round_fn``'s state).
STATE_NAMES = ("target", "drafter", "rng", "codes", "acceptance", "sampling", "ar_tree")


def _round_state(target: Target, drafter: Drafter | GridDrafter | None, rng: RowRandom | None, codes: Tensor,
                 acceptance: Acceptance, ar_tree: TreeBuffers) -> list[object]:
    return [target, drafter, rng, codes, acceptance, target.sampling, ar_tree]


def _raster_round(
    target: Target,
    drafter: Drafter | None,
    codes: Tensor,
    n: Tensor,
    root: Tensor,
    rng: RowRandom | None,
    sampling: SamplingConfig,
    acceptance: Acceptance,
    active: Tensor,
    ar_tree: TreeBuffers,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One round in raster order (AR, SD, LANTERN, SJD): propose, verify, accept, commit.
    Returns (new tokens [B], new root [B], n [B], relaxed-only accepts []).

    Static shapes and no host sync, so that the whole round traces as one graph: accepted lengths
    are index tensors over the tree's fixed width, finished rows compute and write nothing."""
    n_total = target.num_tokens
    # Drafts deeper than the image's remaining tokens could never be used ([LANTERN code] drafts them anyway).
    max_depth = (n_total - n - 1).clamp(min=0)
    # 2. Propose.
    with phase("propose"):
        if drafter is None:
            tree = DraftTree(tokens=root[:, None], buffers=ar_tree)
        else:
            tree = drafter.propose(rng, active, max_depth)
    # 3. Verify: one target forward over every row's tree.
    with phase("verify"):
        # the tree's static sizes bound the row-end tokens a target inserts (Lumina-mGPT's new-lines)
        logits, hidden = target.verify(tree.tokens, tree.buffers.mask, tree.buffers.depth, tree=tree.buffers)
    # 4. Accept.
    with phase("accept"):
        accepted = _accept(logits, tree, max_depth, active, sampling, rng, acceptance)
        path, next_token = accepted.path, accepted.next_token
        num_acc = torch.where(active, accepted.num_accepted, 0)
    # 5. Commit: root + accepted drafts enter the cache; next_token is the new pending root.
    with phase("commit"):
        new = torch.where(active, num_acc + 1, 0)
        # A chain's accepted nodes are its first ones (a node's index is its depth): nothing moves.
        target.commit(path, new, in_order=tree.buffers.children.shape[-1] == 1)
        # follow[b, j]: the token after path node j (accepted draft j+1, then next_token).
        follow, path_hidden, root, n = _advance(
            codes, n, root, tree.tokens, path, num_acc, next_token, active, hidden, target.streams
        )
        if drafter is not None:
            if isinstance(drafter, VerifyObserver):
                drafter.observe_verify(logits, accepted.p_target)
            drafter.commit(path_hidden, follow, new)
    return new, root, n, accepted.relaxed


def _grid_round(
    target: GridTarget,
    drafter: GridDrafter,
    codes: Tensor,
    rng: RowRandom | None,
    sampling: SamplingConfig,
    acceptance: Acceptance,
    active: Tensor,
) -> tuple[Tensor, Tensor]:
    """One PJD round (``lantern.decoding.pjd``): the same steps over R chains per row, verified in one
    forward with the row-causal mask; each chain is accepted by the loop's chain rule on its own
    (the chains reshaped to rows). Returns (new tokens [B], relaxed-only accepts [])."""
    with phase("propose"):
        block = drafter.propose_grid(rng)
    with phase("verify"):
        logits = target.verify_grid(block.tokens, block.cells, block.rows, chains=block.max_depth.shape[1])
    with phase("accept"):
        b, r = block.max_depth.shape
        t = block.tokens.shape[1] // r
        u = p_target = None
        if not sampling.greedy:  # a fixed count per row and round, from the row's own stream
            with phase("sampling"):
                u = _uniforms(rng, r * (t + 1)).view(b * r, t + 1)
            p_target = probs_from_logits(logits, sampling)  # the acceptance's, and the carry-over's
        flat_p = None if p_target is None else p_target.view(b * r, t, -1)
        chains = DraftTree(tokens=block.tokens.view(b * r, t), buffers=block.buffers, q_draft=block.q_draft,
                           relaxable=block.relaxable.view(b * r, t), clean=block.clean.view(b * r, t))
        _, num_acc, next_token, num_relaxed = _accept_core(
            logits.view(b * r, t, -1), chains, block.max_depth.view(-1), u, acceptance, sampling, flat_p
        )
        relaxed = torch.where(block.decodes.view(-1), num_relaxed, 0).sum()
    with phase("commit"):
        keep, num_keep, cells, vals, new = drafter.commit_grid(block, num_acc.view(b, r), next_token.view(b, r),
                                                               logits, rng, p_target)
        target.commit_grid(keep, num_keep)
        codes.scatter_(1, cells, vals)
    return new, relaxed


def _sample(logits: Tensor, sampling: SamplingConfig, rng: RowRandom | None) -> Tensor:
    """One token per row from guided logits [B, V]: argmax (greedy) or inverse-CDF sampling."""
    with phase("sampling"):
        if sampling.greedy:
            return logits.argmax(dim=-1)
        u = _uniforms(rng, 1)[:, 0]
        return sample_from_probs(probs_from_logits(logits, sampling), u)


def _uniforms(rng: RowRandom | None, n: int) -> Tensor:
    """[B, n] uniforms, row b from its own stream, so a row's numbers ignore its batch-mates.

    Finished rows draw too: their codes are complete, so what they draw changes nothing, and
    drawing for every row keeps the round free of a host sync to find the active ones.
    """
    assert rng is not None
    return rng.uniform(n)


class Accepted(NamedTuple):
    """What a raster round's acceptance decided (:func:`_accept`)."""

    path: Tensor  # [B, D+1] accepted tree nodes, root first, -1 padded
    num_accepted: Tensor  # [B] drafts accepted
    next_token: Tensor  # [B] the recovered or bonus token
    relaxed: Tensor  # [] accepts of active rows that only the relaxation allowed
    p_target: Tensor | None  # [B, T, V] the target's p at every node (sampled trees; else None)


def _accept(
    logits: Tensor,  # [B, T, V] guided
    tree: DraftTree,
    max_depth: Tensor,  # [B]
    active: Tensor,  # [B]
    sampling: SamplingConfig,
    rng: RowRandom | None,
    acceptance: Acceptance,
) -> Accepted:
    """The random numbers come from the rows' streams; everything else is :func:`_accept_core`."""
    b, t = tree.tokens.shape
    u = p_target = None
    if not sampling.greedy:
        with phase("sampling"):  # AR draws one uniform per row, a tree T + 1 (see num_uniforms)
            u = _uniforms(rng, 1 if t == 1 else t + 1)
        if t > 1:  # made here, not in _accept_core: a Jacobi drafter redraws from the same p next round
            p_target = probs_from_logits(logits, sampling)
    path, num_acc, next_token, num_relaxed = _accept_core(logits, tree, max_depth, u, acceptance, sampling, p_target)
    if acceptance.fixed_accept is not None:
        path, num_acc = _fixed_path(tree.buffers.retrieve, max_depth, acceptance.fixed_accept, path.shape[1])
    relaxed = torch.where(active, num_relaxed, 0).sum()  # a device scalar: no sync
    return Accepted(path, num_acc, next_token, relaxed, p_target)


def _fixed_path(retrieve: Tensor, max_depth: Tensor, accept: int, width: int) -> tuple[Tensor, Tensor]:
    """The first root-to-leaf path cut after ``accept`` drafts (``Acceptance.fixed_accept``)."""
    first = retrieve[:, 0, :width]  # [B, W]
    num_acc = ((first[:, 1:] >= 0).sum(-1)).clamp(max=accept).minimum(max_depth)  # [B]
    j = torch.arange(width, device=first.device)[None, :]
    return torch.where(j <= num_acc[:, None], first, -1), num_acc


def _accept_core(
    logits: Tensor,  # [B, T, V] guided
    tree: DraftTree,  # the verified nodes: tokens [B, T], structure, q_draft, relaxable / clean
    max_depth: Tensor,  # [B]
    u: Tensor | None,  # [B, U] uniforms (None: greedy)
    acceptance: Acceptance,
    sampling: SamplingConfig,
    p_target: Tensor | None = None,  # [B, T, V] probs_from_logits(logits, sampling) if already made
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The acceptance rule of one round, fused: (path, num_accepted, next_token, num_relaxed [B])."""
    b, t, _ = logits.shape
    tokens, children, retrieve = tree.tokens, tree.buffers.children, tree.buffers.retrieve
    neighbours, relaxation, subsequence = acceptance.neighbours, acceptance.relaxation, acceptance.subsequence
    relaxable = credited(tree.relaxable, tree.clean, relaxation)
    chain = children.shape[-1] == 1  # every node has at most one child: all depths at once
    check(subsequence is None or chain or t == 1, "subsequence verification (SJD-SV) needs a chain of drafts")
    if t == 1:  # AR: nothing to verify, the next token comes straight from p at the root
        zero = torch.zeros(b, dtype=torch.long, device=logits.device)
        if u is None:
            return zero[:, None], zero, logits[:, 0].argmax(dim=-1), zero
        return zero[:, None], zero, sample_from_probs(probs_from_logits(logits[:, 0], sampling), u[:, -1]), zero
    if u is None and subsequence is not None:
        res = verify_chain_greedy_subsequence(logits, tokens, max_depth, subsequence, neighbours, relaxation, relaxable)
    elif u is None:
        res = verify_tree_greedy(logits, tokens, retrieve, max_depth, neighbours=neighbours, relaxation=relaxation,
                                 relaxable=relaxable)
    elif chain:
        p_target = probs_from_logits(logits, sampling) if p_target is None else p_target
        res = verify_chain_sampled(p_target, tokens, max_depth, u, tree.q_draft, neighbours, relaxation, relaxable,
                                   subsequence)
    else:
        p_target = probs_from_logits(logits, sampling) if p_target is None else p_target
        res = verify_tree_sampled(p_target, tokens, children, tree.buffers.depth, max_depth, u, q_draft=tree.q_draft,
                                  neighbours=neighbours, relaxation=relaxation, levels=retrieve.shape[-1] - 1,
                                  relaxable=relaxable)
    return res.path, res.num_accepted, res.next_token, res.num_relaxed


def _write_codes(
    codes: Tensor, n: Tensor, tokens: Tensor, path: Tensor, num_acc: Tensor, next_token: Tensor, active: Tensor
) -> Tensor:
    """codes[b, n_b + j] = accepted draft j (j < a_b); codes[b, n_b + a_b] = next_token.

    Every row writes all W slots from n_b on (rejected ones keep their old value), so the write
    is one gather + scatter of fixed shape. Kept slots always lie inside the image (the depth
    cap); slots that run past it land in ``codes``' padding tail, clamped to its last column,
    where every duplicate writes back that column's own value (so the scatter stays deterministic).
    """
    width = path.shape[1]  # root + up to D drafts
    j = torch.arange(width, device=codes.device)[None, :]  # [1, W]
    drafts = tokens.gather(1, path[:, 1:].clamp(min=0))  # [B, W-1]
    vals = torch.cat([drafts, next_token[:, None]], dim=1)  # [B, W]
    vals = vals.scatter(1, num_acc[:, None], next_token[:, None])
    keep = (j <= num_acc[:, None]) & active[:, None]
    pos = (n[:, None] + j).clamp(max=codes.shape[1] - 1)  # [B, W]
    codes.scatter_(1, pos, torch.where(keep, vals, codes.gather(1, pos)))
    return vals


def _advance(
    codes: Tensor,  # [B, 2N] written in place
    n: Tensor,  # [B]
    root: Tensor,  # [B]
    tokens: Tensor,  # [B, T]
    path: Tensor,  # [B, W]
    num_acc: Tensor,  # [B], 0 for inactive rows
    next_token: Tensor,  # [B]
    active: Tensor,  # [B]
    hidden: Tensor,  # [S*B, T, D]
    streams: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The round's bookkeeping (a compiled region): write the codes, gather the accepted path's
    features for the drafter, move the root and the counts. Returns (follow [B, W], path hidden
    [S*B, W, D], root [B], n [B])."""
    follow = _write_codes(codes, n, tokens, path, num_acc, next_token, active)
    path_hidden = _gather_path(hidden, path.clamp(min=0), streams)
    new = torch.where(active, num_acc + 1, 0)
    return follow, path_hidden, torch.where(active, next_token, root), n + new


def _gather_path(hidden: Tensor, path: Tensor, streams: int) -> Tensor:
    """hidden [S*B, T, D], path [B, W] -> [S*B, W, D] features along each row's path."""
    idx = path.repeat(streams, 1)[:, :, None].expand(-1, -1, hidden.shape[-1])
    return hidden.gather(1, idx)
