"""Speculative Jacobi Decoding (SJD, Teng et al. 2024, arXiv 2410.01699) as a drafter of the one loop.

SJD needs no trained drafter: the target drafts for itself ([SJD]). Each row keeps a window of
``L`` guesses for the tokens after its pending root. One target forward over ``[root, window]``
(a chain tree) gives the target's distribution p_j at every window position; the window is then
verified left to right by the loop's own ``verify_tree_sampled``, which is exactly SJD's
probabilistic Jacobi acceptance when ``q_draft`` holds the distribution each guess was drawn from:

* accept guess x_j if ``u < min(1, p_j(x_j) / q_j(x_j))``; at the first rejection resample from
  ``norm(max(p_j - q_j, 0))`` and stop; after a full window, a bonus token from fresh p.
* freshly initialised guesses have a one-hot q (acceptance probability p(x), residual p without x).
* Jacobi carry-over: the same forward predicted every later window position too. Guesses after
  the rejection are replaced by samples y_j ~ p_j (conditioned on the old, partly rejected window:
  that is the Jacobi fixed-point iteration), and p_j becomes their q for the next round. New
  positions at the end of the window are initialised (``random`` or ``repeat_horizon``).

Coupled redraws (SCD, So et al. 2025, arXiv 2510.24211; ``JacobiConfig.coupling``): SJD redraws
every open guess independently, so on flat image distributions nearly every guess changes from
one iteration to the next and rarely matches what the target later wants. ``maximal`` couples the
new draw y_j ~ p_j with the guess x_j ~ q_j it replaces (keep x_j with probability
min(1, p_j(x_j)/q_j(x_j)), else draw from norm(max(p_j - q_j, 0))); ``gumbel`` draws
y_j = argmax(log p_j + g_j) with Gumbel noise g_j fixed per position. Either way y_j is still
distributed as p_j given everything decided at earlier positions, so its q stays p_j and decoding
stays lossless (methods ``sjd-coupled``, and with LANTERN's relaxation ``sjd-coupled-lantern`` /
``sjd-coupled-lantern++``). NOTE: the SCD reference code keeps the old q for a guess its coupling
kept; the guess's law is p_j, not q_j, so we test it with q = p_j (with the old q, a random
guess x that the next forward predicts unchanged would be emitted with probability p(x)^2).
SJD-PAC's adaptive continuation is the maximal coupling; its proactive drafting is a subclass
(``lantern.decoding.pac``, method ``sjd-pac``).

Why this is exact (without relaxation): a guess is tested once, at the round its position is
decided; until then it is only redrawn. When tested, x_j follows its q_j given everything decided
at earlier positions (carried samples are functions of p_j, which depends only on earlier
positions, and of randomness no earlier test used; initial guesses are uniform, or a
deterministic copy of an earlier guess, for which a one-hot q *is* the conditional law). That is
all the standard chain argument ([Leviathan23], [Chen23]) needs, so the output follows the target's
distribution. LANTERN's relaxation applies unchanged through the loop's ``Acceptance`` (methods
``sjd-lantern`` / ``sjd-lantern++``).

Greedy (temperature 0): guesses are argmax tokens and the loop's greedy verification keeps only
guesses equal to the target's argmax, so SJD reproduces greedy AR token for token.

Randomness: every row draws a fixed number of uniforms per round from its own stream
(``lantern.decoding.rng``: L for the carried samples, or L * V for ``gumbel`` noise; L for ``random``
initialisation), whatever its batch-mates do, so a row's codes do not depend on the batch (as in
``lantern.decoding.drafting``).
Greedy decoding without generators uses private streams with a fixed seed: the output is
greedy AR whatever the guesses, only the speed depends on them.

Every round has the same shape (a compiled round is one graph, traced once): the first round
carries over from all-zero logits with ``num_new`` 0, which keeps nothing and initialises the
whole window.

Deliberately left out: the reference code's ``jacobi_loop_interval`` (plain decoding near the start
and end of the image) and its ``*sample*`` initialisations.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from lantern.decoding.acceptance import clean_context, maximal_coupling

# The window's settings live in the torch-free lantern.decoding.config; re-exported here, where they were defined first.
from lantern.decoding.config import COUPLINGS as COUPLINGS
from lantern.decoding.config import DEFAULT_WINDOW as DEFAULT_WINDOW
from lantern.decoding.config import JACOBI_INITS as JACOBI_INITS
from lantern.decoding.config import JacobiConfig, SamplingConfig, check_window_fits
from lantern.decoding.loop import DraftTree
from lantern.decoding.phases import phase
from lantern.decoding.rng import RowRandom
from lantern.decoding.sampling import one_hot, probs_from_logits, sample_from_probs
from lantern.decoding.trees import TreeBuffers, tree_from_parents
from lantern.errors import check

GREEDY_INIT_SEED = 0  # seed of the private streams for random guesses when decoding greedily


class JacobiDrafter:
    """The loop's ``Drafter`` for SJD, plus ``observe_verify`` to see each verify forward's logits.

    State per row: ``canvas`` holds the known tokens (positions < n) followed by the window's
    guesses (positions n .. n+L-1); ``q`` [B, L, V] the distribution each guess was drawn from.
    """

    forwards = 0  # no drafter model: every prediction comes from the target's verify forward

    def __init__(self, config: JacobiConfig, sampling: SamplingConfig, vocab_size: int, num_tokens: int,
                 width: int | None = None) -> None:
        """``width``: codes per image row, which ``repeat_horizon`` copies across (None: a square
        grid, as LlamaGen's)."""
        check_window_fits(config, num_tokens)
        grid = math.isqrt(num_tokens) if width is None else width
        check(grid >= 1 and num_tokens % grid == 0 and (width is not None or grid * grid == num_tokens),
              f"SJD needs whole image rows, got {num_tokens} image tokens in rows of {grid}")
        self.config, self.sampling = config, sampling
        self.vocab_size, self.num_tokens, self.grid = vocab_size, num_tokens, grid  # grid: codes per image row
        self.canvas: Tensor | None = None  # [B, N + L] known tokens, then guesses; -1 = none yet
        self.n: Tensor | None = None  # [B] known tokens per row
        self.q: Tensor | None = None  # [B, L, V] (sampled decoding only)
        # What the last verify forward predicted at each node, [B, L+1, V]: its guided logits when
        # decoding greedily (argmax redraws), its probabilities when sampling (one or the other is kept)
        self._logits: Tensor | None = None
        self._probs: Tensor | None = None
        self._num_new: Tensor | None = None  # [B] tokens the last round added (0: none yet / inactive)
        self._own_rng: RowRandom | None = None
        self._buffers: TreeBuffers | None = None
        self._first_new: Tensor | None = None  # [B] first freshly initialised slot of the current window
        # gumbel coupling: Exp(1) noise per open position, in a ring of L + 1 slots (position mod L+1)
        self._noise: Tensor | None = None  # [B, L+1, V]
        self._noise_pos: Tensor | None = None  # [B, L+1] position each slot's noise belongs to (-1: none)
        # Draft stability (device counters, no sync): carried guesses redrawn, and how many came out
        # the same token as before (what coupling raises).
        self.redrawn = torch.zeros((), dtype=torch.long)
        self.kept = torch.zeros((), dtype=torch.long)

    @property
    def window(self) -> int:
        return self.config.window

    @property
    def num_nodes(self) -> int:
        """Tree size including the root (what the target cache must hold per round)."""
        return self.window + 1

    # -- the loop's calls --------------------------------------------------------------------------

    def start(self, hidden: Tensor, root: Tensor) -> None:
        """hidden is unused (the target drafts for itself); root [B] is image token 0."""
        b, device = root.shape[0], root.device
        self.canvas = torch.full((b, self.num_tokens + self.window), -1, dtype=torch.long, device=device)
        self.canvas[:, 0] = root
        self.n = torch.ones(b, dtype=torch.long, device=device)
        # The first round is shaped like every other (one compiled graph): it "carries over" from
        # all-zero logits with num_new = L + 1, which keeps no guess and makes slot 0 the first new one.
        zeros = torch.zeros(b, self.num_nodes, self.vocab_size, device=device)
        self._logits = zeros if self.sampling.greedy else None
        self._probs = None if self.sampling.greedy else probs_from_logits(zeros, self.sampling)
        self._num_new = torch.full((b,), self.window + 1, dtype=torch.long, device=device)
        self.q = None if self.sampling.greedy else torch.zeros(b, self.window, self.vocab_size, device=device)
        self._own_rng = RowRandom.from_seeds([GREEDY_INIT_SEED] * b, device)
        self._first_new = torch.zeros(b, dtype=torch.long, device=device)
        self._chain(b)  # built here: tree buffers cost host syncs
        self.redrawn = torch.zeros((), dtype=torch.long, device=device)
        self.kept = torch.zeros((), dtype=torch.long, device=device)
        if self.config.coupling == "gumbel" and not self.sampling.greedy:
            self._noise = torch.zeros(b, self.window + 1, self.vocab_size, device=device)
            self._noise_pos = torch.full((b, self.window + 1), -1, dtype=torch.long, device=device)

    def row_tensors(self) -> list[tuple[Tensor | None, int, int]]:
        """Per-row state (``lantern.decoding.rows``): canvas, counts, the last logits and q, the noise ring."""
        assert self._own_rng is not None
        rows = (self.canvas, self.n, self._logits, self._probs, self._num_new, self.q, self._first_new,
                self._noise, self._noise_pos)
        return [*((t, 1, 0) for t in rows), *self._own_rng.row_tensors()]

    def observe_verify(self, logits: Tensor, probs: Tensor | None = None) -> None:
        """Guided logits [B, L+1, V] of the verify forward: the predictions carried over; ``probs``
        their probabilities if the round's acceptance made them (else made here): the next round
        redraws from them, so the loop does not compute p twice."""
        # in place: a compiled round's state keeps its addresses
        if self._probs is not None:
            self._probs.copy_(probs if probs is not None else probs_from_logits(logits, self.sampling))
        else:
            assert self._logits is not None
            self._logits.copy_(logits)

    def commit(self, hidden: Tensor, next_tokens: Tensor, num_new: Tensor) -> None:
        """next_tokens[:, :num_new] are each row's new known tokens (accepted guesses, then the
        recovered or bonus token); inactive rows have num_new = 0."""
        assert self.canvas is not None and self.n is not None and self._num_new is not None  # (start made them)
        j = torch.arange(next_tokens.shape[1], device=next_tokens.device)[None, :]
        keep = j < num_new[:, None]
        pos = (self.n[:, None] + j).clamp(max=self.canvas.shape[1] - 1)
        self.canvas.scatter_(1, pos, torch.where(keep, next_tokens, self.canvas.gather(1, pos)))
        self.n.add_(num_new)
        self._num_new.copy_(num_new)

    def propose(self, rng: RowRandom | None, active: Tensor, max_depth: Tensor) -> DraftTree:
        """The chain [root, window] per row; depth beyond ``max_depth`` is cut by the acceptance."""
        assert self.canvas is not None and self.n is not None and self._num_new is not None
        gens = rng if rng is not None else self._own_rng
        assert gens is not None
        with phase("draft_sampling"):
            first_new = (self.window + 1 - self._num_new).clamp(0, self.window)  # [B] first slot needing a new guess
            carried, clean = self._carry_over(gens)
            self._initialise(first_new, gens)
        assert self._first_new is not None
        self._first_new.copy_(first_new)
        slots = self.n[:, None] + torch.arange(self.window, device=self.n.device)  # [B, L] positions
        guesses = self.canvas.gather(1, slots)
        root = self.canvas.gather(1, (self.n - 1)[:, None])
        q_draft = None
        if not self.sampling.greedy:
            assert self.q is not None
            self.q.copy_(self._window_q(guesses, first_new, carried))
            pad = torch.zeros_like(self.q[:, :1])  # node L has no child
            q_draft = torch.cat([self.q, pad], dim=1)  # node j's child (guess j) was drawn from q[:, j]
        # Carried guesses were drawn from the target's predictions; new ones are model-free fills,
        # which a relaxed rule must test exactly (lantern.decoding.acceptance: drawn / undrawn); of the
        # carried ones, clean-context credit takes those whose context the test will see (clean).
        drawn = torch.arange(self.window + 1, device=self.n.device)[None, :] <= first_new[:, None]
        clean = torch.cat([drawn[:, :1], clean], dim=1) & drawn
        return DraftTree(tokens=torch.cat([root, guesses], dim=1), buffers=self._chain(root.shape[0]), q_draft=q_draft,
                         relaxable=drawn, clean=clean)

    # -- Jacobi carry-over and initialisation ------------------------------------------------------

    def _carry_over(self, gens: RowRandom) -> tuple[Tensor | None, Tensor]:
        """Redraw y_j ~ p_j at every window node and write them over the guesses after each row's
        new tokens (per ``config.coupling``). Returns p at nodes 1..L [B, L, V] (the carried
        guesses' new q: each y_j is distributed as p_j whatever the coupling), None if greedy, and
        [B, L] which new window slots hold a redraw with a clean context (:func:`clean_context`).

        Node j of the last round (j = 1..L: the guess at position n_old + j - 1) predicted position n_old + j.
        """
        assert self.canvas is not None and self.n is not None
        assert self._num_new is not None
        length = self.window
        n_old = self.n - self._num_new
        pos = n_old[:, None] + torch.arange(1, length + 1, device=self.n.device)  # [B, L]
        # Positions below n are now known (accepted or recovered); only later guesses move.
        keep = (pos >= self.n[:, None]) & (self._num_new > 0)[:, None]
        pos = pos.clamp(0, self.canvas.shape[1] - 1)  # the first round's positions lie before 0: kept by none
        old = self.canvas.gather(1, pos)  # [B, L] the guesses being replaced (-1: none yet)
        if self._probs is None:  # greedy
            assert self._logits is not None
            p, y = None, self._predictions(self._logits).argmax(dim=-1)
        else:
            p = self._predictions(self._probs)  # [B, L, V] the target's p for positions n_old+1 .. n_old+L
            y = self._redraw(p, old, pos, gens)
        self._count_stability(old, y, keep)
        self.canvas.scatter_(1, pos, torch.where(keep, y, old))
        return p, self._clean_slots(old, y)

    def _clean_slots(self, old: Tensor, y: Tensor) -> Tensor:
        """[B, L] new window slot s holds a redraw with a clean context: the guess rejected last
        round (old slot num_new - 1) was drawn, and every redraw before slot s kept its old guess.
        Prediction i (node i + 1) is new slot i - num_new + 1."""
        assert self._num_new is not None and self._first_new is not None
        first_open = self._num_new - 1  # [B] the prediction of the first open position
        rejected_drawn = (first_open < self._first_new) & (self._num_new > 0)  # last round's window: carried slots
        clean = clean_context(y == old, first_open, rejected_drawn)  # [B, L] by prediction
        slot = torch.arange(self.window, device=y.device)[None, :]
        pred = first_open[:, None] + slot
        return clean.gather(1, pred.clamp(0, self.window - 1)) & (pred < self.window)

    def _predictions(self, per_node: Tensor) -> Tensor:
        """[B, L, V] of the last verify forward's ``per_node`` [B, T, V] (logits or probabilities),
        those that predicted positions n_old+1 .. n_old+L: nodes 1..L of the chain
        (``lantern.decoding.pac`` picks them in its tree)."""
        return per_node[:, 1:]

    def _redraw(self, p: Tensor, old: Tensor, pos: Tensor, gens: RowRandom) -> Tensor:
        """New guesses [B, L] for positions ``pos`` [B, L] from p [B, L, V], replacing ``old``."""
        b, length, v = p.shape
        if self.config.coupling == "gumbel":
            return (p / self._shared_noise(pos, gens)).argmax(dim=-1)  # Gumbel-max as an exponential race
        # A fixed L uniforms per row and round (finished rows too: their codes are complete), so
        # batch-mates never shift a row's stream and no sync finds the active rows.
        u = gens.uniform(length)
        if self.config.coupling == "independent":
            return sample_from_probs(p.reshape(b * length, v), u.reshape(-1)).view(b, length)
        assert self.q is not None
        # Node i predicts the position of the old window's slot i + 1 (drawn from self.q[:, i + 1]);
        # the last node's position had no guess yet: q = 0 there, so it is drawn from p alone.
        q_old = torch.cat([self.q[:, 1:], torch.zeros_like(self.q[:, :1])], dim=1).to(p.dtype)
        y = maximal_coupling(p.reshape(b * length, v), q_old.reshape(b * length, v), old.clamp(min=0).reshape(-1),
                             u.reshape(-1))
        return y.view(b, length)

    def _shared_noise(self, pos: Tensor, gens: RowRandom) -> Tensor:
        """Exp(1) noise [B, L, V] for positions ``pos``: the same at a position in every round until
        it is decided, so ``argmax p / noise`` (Gumbel-max) only moves where p moved.

        A row's open positions always lie within L + 1 consecutive ones, so a ring of L + 1 slots
        (position mod L + 1) holds the noise. Every round draws L * V fresh uniforms per row (a
        fixed count, used or not) and a slot takes them when its position changed.
        """
        assert self._noise is not None and self._noise_pos is not None
        b, length = pos.shape
        v = self._noise.shape[-1]
        fresh = gens.exponential(length * v).view(b, length, v)
        slot = pos % (length + 1)  # [B, L], distinct within a row
        stale = self._noise_pos.gather(1, slot) != pos  # [B, L]
        index = slot[:, :, None].expand(-1, -1, v)
        noise = torch.where(stale[:, :, None], fresh, self._noise.gather(1, index))
        self._noise.scatter_(1, index, noise)
        self._noise_pos.scatter_(1, slot, pos)
        return noise

    def _count_stability(self, old: Tensor, y: Tensor, keep: Tensor) -> None:
        """Count the carried guesses (drawn from a forward, not initialised) redrawn this round and
        those that came out unchanged."""
        if self._first_new is None:
            return
        node = torch.arange(1, old.shape[1] + 1, device=old.device)[None, :]  # old window slot of each node
        carried = keep & (node < self._first_new[:, None])
        self.redrawn.add_(carried.sum())
        self.kept.add_((carried & (y == old)).sum())

    def _initialise(self, first_new: Tensor, gens: RowRandom) -> None:
        """New guesses in window slots >= first_new [B] (positions not predicted by any forward)."""
        assert self.canvas is not None and self.n is not None
        if self.config.init == "random":
            self._initialise_random(first_new, gens)
        else:
            self._initialise_repeat_horizon(first_new)

    def _initialise_random(self, first_new: Tensor, gens: RowRandom) -> None:
        assert self.canvas is not None and self.n is not None
        length, device = self.window, self.n.device
        u = gens.uniform(length)  # L per row and round, used or not (batch independence)
        tokens = (u * self.vocab_size).long().clamp(max=self.vocab_size - 1)  # uniform over the vocabulary
        slot = torch.arange(length, device=device)[None, :]
        pos = self.n[:, None] + slot
        new = slot >= first_new[:, None]
        self.canvas.scatter_(1, pos, torch.where(new, tokens, self.canvas.gather(1, pos)))

    def _initialise_repeat_horizon(self, first_new: Tensor) -> None:
        """Copy the token one cell to the left (one row up at a row start), slot by slot, so a new
        guess may copy a new guess just made to its left.

        Done at once, not slot by slot (L gathers and scatters a round, the largest share of the
        draft sampling's kernels): following the copies left through a run of new slots ends at the
        cell before the run's start, unless an image row starts inside the run; then it ends one row
        above that row's start, itself a new slot when the window is longer than an image row (each
        pass below moves such a source up a row). tests/test_sjd.py holds the slot-by-slot reference."""
        assert self.canvas is not None and self.n is not None
        slot = torch.arange(self.window, device=self.n.device)[None, :]
        pos = self.n[:, None] + slot  # [B, L]
        start = (self.n + first_new)[:, None]  # each row's first new position
        src = pos
        for _ in range((self.window - 1) // self.grid + 1):  # a pass per image row the window spans
            row_start = src - src % self.grid
            up = torch.where(row_start >= start, row_start - self.grid, start - 1)
            src = torch.where(src >= start, up, src)
        value = self.canvas.gather(1, src)
        self.canvas.scatter_(1, pos, torch.where(slot >= first_new[:, None], value, self.canvas.gather(1, pos)))

    def _window_q(self, guesses: Tensor, first_new: Tensor, carried: Tensor | None) -> Tensor:
        """[B, L, V] q of each guess: the carried p for slots < first_new, one-hot for new guesses.

        Slot i (position n + i) was predicted by last round's node num_new + i, i.e. carried[:, num_new + i - 1].
        """
        assert self._num_new is not None
        point = one_hot(guesses, self.vocab_size)  # q of a fresh guess: a point mass
        if carried is None:
            return point
        slot = torch.arange(self.window, device=guesses.device)[None, :]
        node = (self._num_new[:, None] + slot - 1).clamp(0, self.window - 1)  # [B, L]
        q_carried = carried.gather(1, node[:, :, None].expand(-1, -1, carried.shape[-1]))
        return torch.where((slot < first_new[:, None])[:, :, None], q_carried.to(point.dtype), point)

    def _chain(self, b: int) -> TreeBuffers:
        cached = self._buffers
        if cached is None or cached.parents.shape[0] != b:
            assert self.canvas is not None
            parents = torch.arange(-1, self.window, device=self.canvas.device)
            cached = tree_from_parents(parents[None].expand(b, -1).contiguous())
            self._buffers = cached
        return cached

