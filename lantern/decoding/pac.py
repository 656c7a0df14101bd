"""SJD-PAC (Kang et al., CVPR 2026, arXiv 2603.18599) as a drafter of the one loop: speculative
Jacobi decoding with Proactive Drafting (PD) and Adaptive Continuation (AC). Method ``sjd-pac``.

What the paper specifies. Read: the abstract, Algorithm 1 (SJD-PAC's round), the README of the
released code (github.com/KangJialiang/SJD-PAC) and that code (``scheduler/sjd_pac_iteration_lumina_mgpt.py``,
Lumina-mGPT only). The method section's prose beyond Algorithm 1 and the supplementary proofs were
not available to us.

* AC (Algorithm 1, lines 5-16). The verification does not stop at the first rejection: every window
  position i is tested, r ~ U[0, 1], r < min(1, p_i(x_i) / q_i(x_i)); an accepted guess is kept, a
  rejected one is replaced by a draw from norm(max(p_i - q_i, 0)). The guesses before the first
  rejection and the draw there are emitted; the rest is the next window, each guess "tested"
  against the cached (stale) p_i, and the code makes that p_i the guess's q for the next round.
* PD (Algorithm 1, lines 17-19; README). After a rejection the next round verifies a shallow, wide
  tree rooted at the resampled token: K candidates at each of the D - 1 positions after it, every
  node of a level having the same K candidates as children (a full K-ary tree), and the first
  candidates' path continued by a single chain to the window's end. Built from the cached
  distributions: no extra forward. README: K = 4, D = 3 and a window of L = 64 "are the default
  sweet spot (the paper's Tab. 3)" (the code's own defaults: K = 3, D = 3); L counts every node,
  the tree included.
* Lossless ("strictly preserving the target distribution", proofs in the supplementary).

Left open (how the code does it, where we read it): which tokens are the K candidates (the code:
the kept guess first when AC kept it, then draws without replacement from norm(max(p - q, 0)); K
such draws when it did not; K uniform tokens at positions no forward predicted); how siblings are
tested (the code: sibling k against the residual left by siblings < k, with q minus their tokens,
renormalised: recursive rejection sampling without replacement); which row of a tree is kept (the
code: the root-to-leaf row with the longest accepted prefix); which node's p is carried at tree
positions (the code: the kept row's, deeper positions the first chain's).

How it maps onto lantern, and what we chose:

* AC is the redraw lantern's coupled SJD already does (SCD, ``JacobiConfig.coupling = "maximal"``,
  :func:`lantern.decoding.acceptance.maximal_coupling`): keep the old guess x ~ q with probability
  min(1, p(x)/q(x)), else draw from norm(max(p - q, 0)), one uniform per position. Past the first
  rejection nothing is emitted, so Algorithm 1's "test" there *is* this redraw; its output follows
  p given the earlier positions, so its q is p (as the reference code sets it). ``sjd-pac`` is
  therefore ``sjd-coupled`` (maximal) plus PD. ``--sjd-coupling independent|gumbel`` are allowed
  for ablations (PD without AC; exact too).
* PD is this module: :class:`PACDrafter` verifies the chain of ``window`` guesses (SJD's) plus the
  full ``width``-ary subtree of ``depth`` - 1 levels under the root (``width`` = K, ``depth`` = D).
  Level d's candidate 0 is the chain's guess at that position; candidates 1..K-1 are drawn
  **without replacement from the same q** (the guess's own law: the stale p for a carried guess);
  every node of level d - 1 has q_draft = that q. The loop's ``verify_tree_sampled`` then walks the
  tree, testing siblings in order with the residual update (recursive rejection sampling,
  [EAGLE]), and stops at the first accepted sibling.
* Carried predictions at tree positions are the last accepted node's first-child descent (the
  reference's kept row), deeper ones the chain's (:meth:`PACDrafter._predictions`).

Deviations from the reference code, each needed for exactness (our reading of that code):

1. Siblings' law. The code draws siblings from the residual norm(max(p - q_old, 0)) but tests them
   as draws without replacement from p; that is not their law (a kept guess's siblings follow the
   residual, not p minus the guess), and the sequential test is exact only when sibling k follows
   norm(q without siblings 0..k-1) given them. Ours do, by construction.
2. Path choice. The code evaluates every root-to-leaf row at once and keeps the longest accepted
   prefix, so a later sibling's row can win although an earlier sibling was accepted (a bias
   towards longer paths). The loop's walk takes the first accepted sibling.
3. A fully accepted window: the code's extra token is drawn from its uniform padding (its p stops
   at the last draft); ours is the bonus from p at the last node, as everywhere in the loop.
4. Positions no forward predicted yet (the first round; after a nearly fully accepted window): the
   code draws K uniform candidates. Lantern's fills are one-hot-q guesses (``random`` or
   ``repeat_horizon``); a point mass has nothing left to draw siblings from, so there the siblings
   repeat the guess and the verifier skips repeated siblings (those levels verify as a chain).

Also chosen (not specified, or specified for a 64-node Lumina window):

* ``window`` is the chain's guesses, as ``--sjd-window`` everywhere (default 16, SJD's); the
  subtree adds ``K + ... + K^(D-1) - (D - 1)`` nodes on top (18 for K = 4, D = 3), so a round
  verifies window + 1 + 18 nodes. The reference keeps L = 64 nodes in all, the tree inside.
* K = 4, D = 3 (the README's "sweet spot"); guesses ``repeat_horizon`` (SJD's LlamaGen default, and
  lantern's for ``sjd-coupled``: the most tokens per forward on ``photos``).
* Greedy: a carried guess is its prediction's argmax and its siblings are the next K - 1 tokens by
  logit; greedy verification keeps only the target's argmax, so greedy SJD-PAC is greedy AR.

Why it is exact (the chain argument of ``lantern.decoding.jacobi``, extended to the tree). Let F_e
hold everything about image positions < e (their guesses and candidates of every round, the
uniforms of their tests and redraws, the forwards' outputs at nodes before e). (i) The forward's
p at a node depends only on the tokens of its path, all at earlier positions. (ii) Position e is
tested in exactly one round (the walk visits one node per level; a level's K candidates are the
same under every parent), then it is decided. (iii) Until then its candidates are fresh each
round: candidate 0 is redrawn from a p that is F_e-measurable (which node's p depends on the
accepted path, decided at earlier positions) and from the old candidate 0, which follows its q
given F_e (nothing at earlier positions ever saw it: causal attention); candidates k >= 1 are
drawn without replacement from the same q with uniforms no test uses. So when tested, the
candidates follow exactly the law the sequential sibling test assumes, given F_e, and by the
standard argument ([Leviathan23], [Chen23], [EAGLE]) the token emitted at e follows the target's p
given the emitted prefix. ``tests/test_sjd_pac.py`` checks it (chi-square of the joint law of the
first tokens, with a power check on a deliberately wrong sibling law).

Measured (``photos``, 16 images, batch 8, tokens per forward; docs/DESIGN.md): sjd 2.09,
sjd-coupled 2.97, sjd-pac 3.36 (35 nodes per forward); at equal width sjd-coupled with window 34
reaches 3.85, so on that model a longer chain uses the nodes better than the subtree.

Randomness per row and round: SJD's draws, the verification's T + 1 uniforms, plus
(D - 1)(K - 1) for the siblings, whatever the batch (so a row's codes do not depend on its batch).
Every round has one shape (the tree is fixed; levels whose siblings repeat are skipped by masks).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from torch import Tensor

# The tree's settings live in the torch-free lantern.decoding.config; re-exported here, where they were defined first.
from lantern.decoding.config import DEFAULT_PAC_DEPTH as DEFAULT_PAC_DEPTH
from lantern.decoding.config import DEFAULT_PAC_WIDTH as DEFAULT_PAC_WIDTH
from lantern.decoding.config import JacobiConfig, PACConfig, SamplingConfig
from lantern.decoding.config import pac_tree_nodes as pac_tree_nodes
from lantern.decoding.jacobi import JacobiDrafter
from lantern.decoding.loop import DraftTree
from lantern.decoding.phases import phase
from lantern.decoding.rng import RowRandom
from lantern.decoding.sampling import sample_from_probs
from lantern.decoding.trees import TreeBuffers, tree_from_parents
from lantern.errors import check


@dataclass(frozen=True)
class _Layout:
    """The tree's nodes: the root, the chain (node d at depth d, d = 1..L), then the subtree's
    other nodes by (depth, sibling ranks), so every node's children are in sibling-rank order."""

    parents: Tensor  # [T]
    depth: Tensor  # [T]
    extra_source: Tensor  # [T - L - 1] column of candidates.flatten(1) ([B, (D-1) * K]) each non-chain node holds
    descent: Tensor  # [T, L] node at depth j + 1 below node v along first children, else chain node j + 1
    by_ranks: Tensor  # [D, K^(D-1)] node at depth d with ranks k_1..k_d (index sum k_i K^(d-i)); -1 unused


def _layout(window: int, pac: PACConfig) -> _Layout:
    width, levels = pac.width, pac.levels
    chain = [(0,) * d for d in range(window + 1)]
    extra = [c for c in pac.choices(window) if any(c)]
    nodes = chain + extra
    index = {c: i for i, c in enumerate(nodes)}
    descent = []
    for c in nodes:
        row = []
        for d in range(1, window + 1):
            u: tuple[int, ...] | None = c
            while u is not None and len(u) < d:
                u = u + (0,) if u + (0,) in index else None
            row.append(index[u] if u is not None and len(u) == d else d)
        descent.append(row)
    by_ranks = torch.full((levels + 1, width ** levels), -1, dtype=torch.long)
    for d in range(levels + 1):
        for ranks in itertools.product(range(width), repeat=d):
            by_ranks[d, sum(k * width ** (d - 1 - i) for i, k in enumerate(ranks))] = index[ranks]
    return _Layout(
        parents=torch.tensor([-1] + [index[c[:-1]] for c in nodes[1:]], dtype=torch.long),
        depth=torch.tensor([len(c) for c in nodes], dtype=torch.long),
        extra_source=torch.tensor([(len(c) - 1) * width + c[-1] for c in extra], dtype=torch.long),
        descent=torch.tensor(descent, dtype=torch.long),
        by_ranks=by_ranks,
    )


def draw_siblings(q: Tensor, first: Tensor, u: Tensor) -> Tensor:
    """Candidates 1..K-1 [..., K-1] after ``first`` [...]: drawn without replacement from ``q``
    [..., V] (``first`` excluded), one uniform each from ``u`` [..., K-1] (inverse CDF: draw, remove,
    draw again). Where q has no mass left the candidate repeats ``first`` (the verifier skips it)."""
    v = q.shape[-1]
    rest = q.scatter(-1, first[..., None], 0.0)
    out = []
    for k in range(u.shape[-1]):
        total = rest.sum(-1)
        x = sample_from_probs(rest.reshape(-1, v), u[..., k].reshape(-1)).view_as(first)
        x = torch.where(total > 0, x, first)
        rest = rest.scatter(-1, x[..., None], 0.0)
        out.append(x)
    return torch.stack(out, dim=-1)


class PACDrafter(JacobiDrafter):
    """:class:`JacobiDrafter` (SJD, with ``config.coupling``'s redraws: AC when maximal) whose
    verify tree adds proactive drafting's K-ary subtree of D - 1 levels under the root.

    Extra state per row: ``_candidates`` [B, D-1, K] (the last proposal's candidates per level),
    ``_last`` [B] (the last accepted node of the last round: whose descendants' p are carried)."""

    def __init__(
        self, config: JacobiConfig, pac: PACConfig, sampling: SamplingConfig, vocab_size: int, num_tokens: int,
        width: int | None = None,
    ) -> None:
        super().__init__(config, sampling, vocab_size, num_tokens, width)
        pac.check_window(config.window)
        check(pac.width <= vocab_size, f"--pac-width ({pac.width}) exceeds the {vocab_size} image tokens")
        self.pac = pac
        self._layout = _layout(config.window, pac)
        self._tree: TreeBuffers | None = None
        self._candidates: Tensor | None = None  # [B, D-1, K]
        self._last: Tensor | None = None  # [B]
        self._node_depth: Tensor | None = None  # the layout's tables on the device (set in start)
        self._extra_source: Tensor | None = None
        self._descent: Tensor | None = None
        self._by_ranks: Tensor | None = None

    @property
    def num_nodes(self) -> int:
        return int(self._layout.parents.shape[0])

    # -- the loop's calls --------------------------------------------------------------------------

    def start(self, hidden: Tensor, root: Tensor) -> None:
        super().start(hidden, root)
        b, device = root.shape[0], root.device
        lay = self._layout
        self._node_depth, self._extra_source = lay.depth.to(device), lay.extra_source.to(device)
        self._descent, self._by_ranks = lay.descent.to(device), lay.by_ranks.to(device)
        self._candidates = torch.zeros(b, self.pac.levels, self.pac.width, dtype=torch.long, device=device)
        self._last = torch.zeros(b, dtype=torch.long, device=device)
        self._buffers_for(b)  # built here: tree buffers cost host syncs

    def row_tensors(self) -> list[tuple[Tensor | None, int, int]]:
        """SJD's per-row state, then the subtree's candidates and last pick."""
        return [*super().row_tensors(), (self._candidates, 1, 0), (self._last, 1, 0)]

    def propose(self, rng: RowRandom | None, active: Tensor, max_depth: Tensor) -> DraftTree:
        """SJD's chain (carry-over, fills, q), then each level's siblings, as one tree."""
        chain = super().propose(rng, active, max_depth)
        assert self._candidates is not None and self._node_depth is not None and self._extra_source is not None
        gens = rng if rng is not None else self._own_rng
        assert gens is not None
        with phase("draft_sampling"):
            candidates = self._draw_candidates(chain.tokens[:, 1 : self.pac.levels + 1], gens)
        self._candidates.copy_(candidates)
        tokens = torch.cat([chain.tokens, candidates.flatten(1)[:, self._extra_source]], dim=1)
        # A node at depth d draws its children from level d + 1's q (the chain's node d does), and
        # its token was drawn from a model iff the chain's guess at its depth was.
        q_draft = None if chain.q_draft is None else chain.q_draft[:, self._node_depth]
        relaxable = None if chain.relaxable is None else chain.relaxable[:, self._node_depth]
        # Clean-context credit: the chain's nodes as SJD marks them; a subtree node's test may see a
        # sibling its draft was not conditioned on, so the subtree is never clean (tested exactly).
        clean = None if chain.clean is None else torch.cat(
            [chain.clean, torch.zeros_like(tokens[:, chain.clean.shape[1]:], dtype=torch.bool)], dim=1)
        return DraftTree(tokens=tokens, buffers=self._buffers_for(tokens.shape[0]), q_draft=q_draft,
                         relaxable=relaxable, clean=clean)

    def commit(self, hidden: Tensor, next_tokens: Tensor, num_new: Tensor) -> None:
        super().commit(hidden, next_tokens, num_new)
        assert self._last is not None
        self._last.copy_(self._last_node(next_tokens, num_new))

    # -- proactive drafting ------------------------------------------------------------------------

    def _draw_candidates(self, guesses: Tensor, gens: RowRandom) -> Tensor:
        """[B, D-1, K]: at level d (window slot d - 1) the chain's guess, then K - 1 siblings drawn
        from its law; at a slot with a fresh (one-hot) guess the siblings repeat it."""
        b, levels = guesses.shape
        width = self.pac.width
        if width == 1 or levels == 0:
            return guesses[..., None]
        assert self._first_new is not None
        carried = torch.arange(levels, device=guesses.device)[None, :] < self._first_new[:, None]  # [B, D-1]
        if self.sampling.greedy:  # the next K - 1 tokens of the prediction whose argmax the guess is
            ranked = self._slot_logits(levels).scatter(-1, guesses[..., None], float("-inf"))
            others = ranked.topk(width - 1, dim=-1).indices
        else:
            assert self.q is not None
            u = gens.uniform(levels * (width - 1)).view(b, levels, width - 1)  # fixed count per row and round
            others = draw_siblings(self.q[:, :levels], guesses, u)
        others = torch.where(carried[..., None], others, guesses[..., None])
        return torch.cat([guesses[..., None], others], dim=-1)

    def _slot_logits(self, levels: int) -> Tensor:
        """[B, levels, V] the logits that predicted window slots 0 .. levels-1 (carried slots)."""
        assert self._num_new is not None
        assert self._logits is not None
        preds = self._predictions(self._logits)
        slot = torch.arange(levels, device=preds.device)[None, :]
        node = (self._num_new[:, None] + slot - 1).clamp(0, self.window - 1)  # as JacobiDrafter._window_q
        return preds.gather(1, node[:, :, None].expand(-1, -1, preds.shape[-1]))

    def _predictions(self, per_node: Tensor) -> Tensor:
        """[B, L, V] of ``per_node`` [B, T, V]: for window depth j + 1, the node at that depth below
        the last accepted node along first children (the accepted path's own context, as far as the
        tree has it), else the chain's node j + 1."""
        assert self._descent is not None and self._last is not None
        node = self._descent[self._last]  # [B, L]
        return per_node.gather(1, node[:, :, None].expand(-1, -1, per_node.shape[-1]))

    def _last_node(self, follow: Tensor, num_new: Tensor) -> Tensor:
        """[B] the last accepted node, found from the accepted tokens (``follow[:, :num_new - 1]``):
        at level d the first candidate holding the token (candidates of a level are distinct but
        for skipped repeats, whose subtrees are identical to the first one's)."""
        assert self._candidates is not None and self._by_ranks is not None
        accepted = (num_new - 1).clamp(min=0)  # [B] drafts accepted (0 for inactive rows)
        levels, width = self.pac.levels, self.pac.width
        index = torch.zeros_like(accepted)
        nodes = [torch.zeros_like(accepted)]  # depth 0: the root
        for d in range(1, levels + 1):
            rank = (self._candidates[:, d - 1] == follow[:, d - 1, None]).long().argmax(-1)  # [B]
            index = index * width + rank
            nodes.append(self._by_ranks[d, index])
        at = torch.stack(nodes, dim=1).gather(1, accepted.clamp(max=levels)[:, None])[:, 0]
        return torch.where(accepted <= levels, at, accepted)  # deeper: the chain's node (only it goes on)

    def _buffers_for(self, b: int) -> TreeBuffers:
        cached = self._tree
        if cached is None or cached.parents.shape[0] != b:
            assert self.canvas is not None
            parents = self._layout.parents.to(self.canvas.device)
            cached = tree_from_parents(parents[None].expand(b, -1).contiguous())
            self._tree = cached
        return cached
