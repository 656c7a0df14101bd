"""Drafting with LANTERN's released Anole / Lumina-mGPT drafters, on the sequence they were run on.

The released drafters (:mod:`lantern.models.chameleon_drafter`) do not read lantern's code-space
drafter sequence (image prefix + codes). Per ``models/drafters/cnets_{anole,lumina_mgpt}.py``
``topK_genrate`` and ``models/ea_model_{anole,lumina_mgpt}.py`` (``jadohu/LANTERN`` @3a56e45), their
sequence is the target's whole token sequence, one entry per target token:

* entry p pairs the target's feature ``f_p`` (after its final norm) with the *next* token's BPE id
  ``x_{p+1}`` (``input_ids[:, 1:]``), from the first prompt token on: ``[BOS] prompt ... image
  prefix``, then every image code and, for Lumina-mGPT, every new-line token ``<reserved08799>``
  after a row's last code (its own feature pairs with the next row's first code);
* entry p sits at the target position of ``f_p``'s token (transformers' rotate-half RoPE over
  absolute positions; left padding and the unconditional stream's shorter context count from
  their first real token, as the target's own positions do);
* with guidance, the unconditional stream is a second row of the same layout over the guidance
  context (``[BOS] <racm3:break>`` for Anole, the image prefix for Lumina-mGPT), and drafter
  logits are guided like the target's;
* the drafter's cache holds exactly the committed entries; tree drafts are never committed.

:class:`ReleasedDrafterBackend` keeps that sequence in step with lantern's loop. Its cache slots
are the target's model slots (one entry per model token), so positions are ``slot - left
padding``. The loop's trees hold codes only; where a drafted code ends an image row (Lumina-mGPT),
the backend runs the drafter once more on ``(that node's output, new-line)`` one position on, and
that output predicts the node's children: the step the official code spends drafting the forced
new-line token. At commit, a kept row-end node contributes two entries: ``(f(code), new-line)``
and ``(f(new-line), next code)``; the target adapter hands out both features
(:attr:`lantern.targets.chameleon.ChameleonTarget.node_hidden`).

**Static shapes** where the target has them (``--compile``, or deterministic mode): the prompt's
entries are absorbed at ``start`` (outside the rounds), every round's context pass has the width
of a commit (``2 W``: a path of W codes and their new-lines), attention spans the whole cache
(masked) and a row-end step runs at every depth whether or not a row ends there (rows that do
not keep their outputs). Then no shape follows the batch or the round and nothing reads the
device, so a round with this backend traces as one graph, and a row's floats are those it gets
alone (the eager default sizes the masks to the batch and skips row-end steps no row needs).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from lantern.decoding.cache import KVCache
from lantern.decoding.config import SamplingConfig
from lantern.decoding.loop import CodeHead
from lantern.decoding.sampling import apply_cfg
from lantern.drafters.checks import TRAINED_FOR, check_chameleon_drafter, trained_layout
from lantern.errors import check
from lantern.models.chameleon import ChameleonLM, ImageLayout
from lantern.models.chameleon_drafter import ReleasedChameleonDrafter, is_released_drafter_folder, load_released_drafter
from lantern.models.drafter import EagleDrafterModel
from lantern.models.invariant import follow_batch_invariance

if TYPE_CHECKING:  # the adapter whose node_hidden this backend reads; drafters sit below targets
    from lantern.targets.chameleon import ChameleonTarget

LAYOUT_NAMES = {"anole": "Anole", "lumina-mgpt": "Lumina-mGPT"}


def load_chameleon_drafter(path: str | os.PathLike[str], model: ChameleonLM,
                           layout: ImageLayout) -> EagleDrafterModel | ReleasedChameleonDrafter:
    """A drafter folder for a Chameleon target: a released LANTERN drafter (Chameleon
    ``config.json``) or a lantern-trained one; either is checked against the target."""
    if is_released_drafter_folder(path):
        released = load_released_drafter(path, layout.name)
        check_released_drafter(released, model, layout, path)
        return released
    trained = trained_layout(Path(path))  # the shape checks below would only name a RoPE offset
    check(trained in (None, layout.name),
          f"--drafter {path} was trained for {TRAINED_FOR.get(str(trained), repr(trained))}, not for the "
          f"{layout.name} layout of this run: use a drafter trained on this model (`lantern train-chameleon-drafter`)"
          f"{f', or pass --layout {trained} if this model is laid out so' if trained in LAYOUT_NAMES else ''}")
    drafter = EagleDrafterModel.from_pretrained(path)
    check_chameleon_drafter(drafter.config, model, layout, path)
    return drafter


def check_released_drafter(drafter: ReleasedChameleonDrafter, model: ChameleonLM, layout: ImageLayout,
                           path: object) -> None:
    cfg, target = drafter.config, model.config
    problems = [
        f"{name} {mine} (target has {theirs})"
        for name, mine, theirs in (("vocab_size", cfg.vocab_size, target.vocab_size),
                                   ("hidden_size", cfg.hidden_size, target.hidden_size))
        if mine != theirs
    ]
    if cfg.layout != layout.name:
        problems.append(f"it is the {LAYOUT_NAMES[cfg.layout]} release's drafter (q_norm rows), the run's layout "
                        f"is {layout.name}")
    check(not problems, f"drafter {path} does not fit this Chameleon target and layout: {'; '.join(problems)}")


class ReleasedDrafterBackend:
    """A :class:`lantern.decoding.drafting.DraftBackend` over a released drafter (see the module docstring)."""

    def __init__(self, model: ReleasedChameleonDrafter, lm_head: CodeHead, sampling: SamplingConfig,
                 target: ChameleonTarget, draft_entries: int) -> None:
        self.model, self.lm_head, self.sampling, self.target = model.eval(), lm_head, sampling, target
        follow_batch_invariance(self.model, lm_head)
        self.streams = target.streams
        self.eol, self.width = target.layout.eol, target.layout.width
        self.draft_entries = draft_entries  # cache slots one round's drafts may use
        # static shapes (see the module docstring) wherever the target has them
        self.static = target.static
        # a device counter, so that a compiled round counts in place instead of baking in a Python int
        self.forwards = torch.zeros((), dtype=torch.long, device=model.device)
        self.cache: KVCache | None = None
        self.col_real: Tensor | None = None  # [N, S_max] False on the prompts' left padding
        self.pos_offset: Tensor | None = None  # [N] left padding of each stream row
        self.codes_done: Tensor | None = None  # [B] code index of the pending root
        self._pending: tuple[Tensor, Tensor, Tensor] | None = None  # feats [N, A, D], bpe ids [N, A], counts [N]
        self._base: Tensor | None = None  # [N] committed length
        self._round_reset()

    def _round_reset(self) -> None:
        """The round's drafts (node 0 = the root, then fed nodes in feed order): made by ``begin`` and
        ``feed``, read within the round. Reset at ``start``, so that every decode's first round
        finds the same state (a compiled round is traced per state, see compiling.round_fn)."""
        self._cover = torch.zeros(0, 1, 0, dtype=torch.bool)  # [N, nodes, entries] drafted entries on each path
        self._out = torch.zeros(0)  # [N, nodes, D] the feature that predicts each node's children
        self._last_pos = torch.zeros(0, dtype=torch.long)  # [N, nodes] position of that feature's entry

    # -- DraftBackend -----------------------------------------------------------------------------

    def start(self, hidden: Tensor, root: Tensor, path_width: int | None = None) -> None:
        """``hidden`` (the image prefix) is not used: the released drafters read the whole prompt.
        The prompt's entries but the last are absorbed here; the last, ``(f(prefix end), root)``,
        is left pending, padded to a commit's width (``2 * path_width``): every round's context
        pass then has one shape, the first's included."""
        assert self.target.prefill is not None and self.target.key_mask is not None
        ids, full = self.target.prefill
        n, length = ids.shape
        layout, cfg, device = self.target.layout, self.model.config, ids.device
        image = layout.num_tokens + (layout.height if layout.eol is not None else 0)
        max_len = length + image + self.draft_entries
        # the pipeline's pool: the same buffers image after image (its decode state stays put, see
        # lantern.decoding.resident, without a copy of this cache per decode)
        self.cache = self.target.cache_pool.get("released_drafter", cfg.num_hidden_layers, n, cfg.num_key_value_heads,
                                                max_len, cfg.head_dim, self.model.dtype, self.model.device,
                                                static=self.target.compile is not None)
        self.col_real = torch.ones(n, max_len, dtype=torch.bool, device=device)
        self.col_real[:, :length] = self.target.key_mask
        assert self.target.pos_offset is not None
        self.pos_offset = self.target.pos_offset.clone()
        self.codes_done = torch.zeros_like(root)
        self._base = torch.zeros(n, dtype=torch.long, device=device)
        self._round_reset()
        if length > 1:
            prompt = (full[:, :-1], ids[:, 1:], torch.full((n,), length - 1, dtype=torch.long, device=device))
            self._absorb_pending(prompt)
        width = 2 * max(path_width or 1, 1)
        feats = full.new_zeros(n, width, full.shape[-1])
        feats[:, 0] = full[:, -1]
        tokens = torch.zeros(n, width, dtype=torch.long, device=device)
        tokens[:, 0] = self._bpe(root).repeat(self.streams)
        self._pending = (feats, tokens, torch.ones(n, dtype=torch.long, device=device))

    def commit(self, hidden: Tensor, next_tokens: Tensor, num_new: Tensor) -> None:
        """New entries along each row's accepted path; a row-end node brings its new-line entry."""
        assert self.codes_done is not None and self.target.last_path is not None
        assert self.target.node_hidden is not None
        s, (b, w), d = self.streams, next_tokens.shape, hidden.shape[-1]
        path = self.target.last_path.clamp(min=0).repeat(s, 1)
        node_feat = self.target.node_hidden.gather(1, path[:, :, None].expand(-1, -1, d))  # f at each code
        j = torch.arange(w, device=next_tokens.device)[None, :]
        valid = j < num_new[:, None]
        row_end = valid & self._ends_row(self.codes_done[:, None] + j)
        before = row_end.long().cumsum(1) - row_end.long()  # new-line entries before node j
        dump = 2 * w  # invalid entries land in a column that is dropped
        main_at = torch.where(valid, j + before + row_end.long(), dump)
        eol_at = torch.where(row_end, j + before, dump)
        feats = hidden.new_zeros(s * b, 2 * w + 1, d)
        feats.scatter_(1, main_at.repeat(s, 1)[:, :, None].expand(-1, -1, d), hidden)
        feats.scatter_(1, eol_at.repeat(s, 1)[:, :, None].expand(-1, -1, d), node_feat)
        tokens = torch.zeros(b, 2 * w + 1, dtype=torch.long, device=next_tokens.device)
        tokens.scatter_(1, main_at, self._bpe(next_tokens))
        tokens.scatter_(1, eol_at, torch.full_like(eol_at, self.eol or 0))
        counts = num_new + row_end.sum(1)
        self.codes_done.add_(num_new)  # in place: round state keeps its address (CUDA graphs replay on it)
        new = (feats[:, :dump], tokens[:, :dump].repeat(s, 1), counts.repeat(s))
        pending = self._pending
        if pending is not None and all(p.shape == x.shape for p, x in zip(pending, new, strict=True)):
            for buf, x in zip(pending, new, strict=True):
                buf.copy_(x)
        else:
            self._pending = new

    def row_tensors(self) -> list[tuple[Tensor | None, int, int]]:
        """Per-row state (``lantern.decoding.rows``): the drafter's cache, its real columns and
        positions' offsets, the code count, the pending entries of the last commit (one shape in
        every round, so rows move between batches) and the committed lengths."""
        assert self.cache is not None and self._pending is not None
        s = self.streams
        feats, tokens, counts = self._pending
        return [*self.cache.row_tensors(s), (self.col_real, s, 0), (self.pos_offset, s, 0), (self.codes_done, 1, 0),
                (feats, s, 0), (tokens, s, 0), (counts, s, 0), (self._base, s, 0)]

    @torch.no_grad()
    def begin(self) -> Tensor:
        """Absorb the new entries; returns the guided logits at the root [B, V]."""
        assert self.cache is not None and self._pending is not None and self.codes_done is not None
        assert self._base is not None
        out, positions = self._absorb_pending(self._pending)
        counts, n = self._pending[2], out.shape[0]
        rows, last = torch.arange(n, device=out.device), (counts - 1).clamp(min=0)
        self._base.copy_(self.cache.lengths)
        self._cover = torch.zeros(n, 1, 0, dtype=torch.bool, device=out.device)
        self._out = out[rows, last][:, None]
        self._last_pos = positions[rows, last][:, None]
        root_ends = self._ends_row(self.codes_done).repeat(self.streams)
        if self._needs_shadows(root_ends):  # the root's new-line comes before its children
            self._shadows(0, 1, root_ends)
        return self._guided(self._out[:, 0])

    @torch.no_grad()
    def feed(self, parent: Tensor, tokens: Tensor, depth: int, ancestors: Tensor) -> Tensor:
        """Draft nodes at ``depth`` below their parents (``ancestors`` is implied by ``parent``)."""
        assert self.codes_done is not None and self._base is not None
        s, e, d = self.streams, tokens.shape[1], self._out.shape[-1]
        p = parent.repeat(s, 1) + 1  # node index: 0 = the root
        feats = self._out.gather(1, p[:, :, None].expand(-1, -1, d))
        positions = self._last_pos.gather(1, p) + 1
        cover = self._cover.gather(1, p[:, :, None].expand(-1, -1, self._cover.shape[2]))
        first = self._cover.shape[2]
        cover = torch.cat([cover, self._eye(e)], dim=2)
        self._cover = torch.cat([self._widen(self._cover, e), cover], dim=1)
        out = self._draft(feats, self._bpe(tokens).repeat(s, 1), positions, cover, first)
        k0 = self._out.shape[1]
        self._out = torch.cat([self._out, out], dim=1)
        self._last_pos = torch.cat([self._last_pos, positions], dim=1)
        ends = self._ends_row(self.codes_done + depth).repeat(s)
        if self._needs_shadows(ends):
            self._shadows(k0, e, ends)
        return self._guided(self._out[:, k0:])

    # -- helpers ----------------------------------------------------------------------------------

    def _absorb_pending(self, pending: tuple[Tensor, Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        """Write entries ``(feats [N, A, D], tokens [N, A], counts [N])`` after each row's committed
        ones and advance the cache; returns their outputs [N, A, D] and positions [N, A]."""
        assert self.cache is not None
        feats, tokens, counts = pending
        a = tokens.shape[1]
        lengths = self.cache.lengths.clone()
        slots = lengths[:, None] + torch.arange(a, device=tokens.device)
        positions = self._positions(slots)
        out = self._absorb(feats.to(self.model.dtype), tokens, positions, self._context_mask(lengths, a), slots)
        self.cache.lengths += counts
        return out, positions

    def _absorb(self, feats: Tensor, tokens: Tensor, positions: Tensor, mask: Tensor, slots: Tensor) -> Tensor:
        """The context pass over committed entries (a seam tests observe the drafter's sequence at)."""
        self.forwards += 1
        return self.model(feats, tokens, positions, mask, self.cache, slots)

    def _needs_shadows(self, ends: Tensor) -> bool:
        """Whether a row-end step runs: with static shapes at every depth of a layout with new-lines
        (no host read), else only where some row ends a row."""
        if self.eol is None:
            return False
        return self.static or bool(ends.any())

    def _shadows(self, k0: int, e: int, valid: Tensor) -> None:
        """Run ``(output, new-line)`` after nodes ``k0 .. k0+e`` of the rows in ``valid`` [N]; their
        output then predicts those nodes' children. Other rows' entries are inert placeholders."""
        n = valid.shape[0]
        first = self._cover.shape[2]
        keep = valid[:, None, None]
        node_cover = self._cover[:, k0 : k0 + e]
        cover = torch.cat([node_cover & keep, self._eye(e)], dim=2)
        self._cover = self._widen(self._cover, e)
        positions = self._last_pos[:, k0 : k0 + e] + 1
        eol = torch.full((n, e), self.eol or 0, dtype=torch.long, device=valid.device)
        out = self._draft(self._out[:, k0 : k0 + e], eol, positions, cover, first)
        self._out[:, k0 : k0 + e] = torch.where(keep, out, self._out[:, k0 : k0 + e])
        self._last_pos[:, k0 : k0 + e] = torch.where(valid[:, None], positions, self._last_pos[:, k0 : k0 + e])
        self._cover[:, k0 : k0 + e, first:] |= self._eye(e) & keep  # a row-end node's path holds its new-line

    def _draft(self, feats: Tensor, tokens: Tensor, positions: Tensor, cover: Tensor, first: int) -> Tensor:
        """A drafter forward over new draft entries ``first ..`` that see the committed context and
        the drafted entries in ``cover`` [N, E, entries]."""
        assert self._base is not None
        e = tokens.shape[1]
        slots = self._base[:, None] + first + torch.arange(e, device=tokens.device)
        self.forwards += 1
        return self.model(feats.to(self.model.dtype), tokens, positions, self._draft_mask(cover), self.cache, slots)

    def _context_mask(self, lengths: Tensor, a: int) -> Tensor:
        """[N, A, kv_len]: real committed entries, then causal among the new ones (each entry always
        sees itself, so the prompts' padding rows stay finite)."""
        assert self.col_real is not None and self.cache is not None
        j = torch.arange(a, device=lengths.device)
        kv_len = self.cache.max_len if self.static else int(lengths.max()) + a
        rel = torch.arange(kv_len, device=lengths.device)[None, None, :] - lengths[:, None, None]
        return ((rel <= j[None, :, None]) & self.col_real[:, None, :kv_len]) | (rel == j[None, :, None])

    def _draft_mask(self, cover: Tensor) -> Tensor:
        assert self._base is not None and self.col_real is not None and self.cache is not None
        q, f = cover.shape[1], cover.shape[2]
        kv_len = self.cache.max_len if self.static else int(self._base.max()) + f
        rel = torch.arange(kv_len, device=cover.device)[None, :] - self._base[:, None]  # [N, S]
        committed = (rel < 0) & self.col_real[:, :kv_len]
        idx = rel.clamp(0, f - 1)[:, None, :].expand(-1, q, -1)
        drafted = cover.gather(2, idx) & ((rel >= 0) & (rel < f))[:, None, :]
        return committed[:, None, :] | drafted

    def _eye(self, e: int) -> Tensor:
        n = self._cover.shape[0]
        return torch.eye(e, dtype=torch.bool, device=self._cover.device).expand(n, -1, -1)

    @staticmethod
    def _widen(cover: Tensor, e: int) -> Tensor:
        return torch.cat([cover, cover.new_zeros(cover.shape[0], cover.shape[1], e)], dim=2)

    def _positions(self, slots: Tensor) -> Tensor:
        assert self.pos_offset is not None
        return (slots - self.pos_offset[:, None]).clamp(min=0)

    def _ends_row(self, code_index: Tensor) -> Tensor:
        """True where the code at ``code_index`` is followed by a new-line token."""
        if self.eol is None:
            return torch.zeros_like(code_index, dtype=torch.bool)
        return (code_index + 1) % self.width == 0

    def _bpe(self, codes: Tensor) -> Tensor:
        return self.target.model.code_to_bpe(codes)

    def _guided(self, hidden: Tensor) -> Tensor:
        logits = self.lm_head(hidden.to(self.lm_head.weight.dtype)).float()
        return apply_cfg(logits, self.sampling.cfg_scale, self.streams)
