"""An oracle drafter: the target model itself scores the draft tree (tests and benchmarks only).

Why: the decoding loop's correctness tests need a drafter whose proposals are *good* (a random
EAGLE drafter almost never gets a draft accepted, so the multi-token paths of verification,
cache compaction and acceptance would go untested), and the speed benchmark needs the best case
("what if the drafter were perfect?") to show how much of the ideal speed-up the loop's overhead
leaves. :class:`OracleBackend` implements :class:`lantern.decoding.drafting.DraftBackend` by running the
target's *uncached* full forward (``LlamaGen.forward``) on ``condition + committed codes + the
node's ancestor path``, so its guided logits equal the target's at every node.

* ``logit_scale == 1`` and greedy sampling: the oracle's argmax is the target's, so every draft
  along the argmax path is accepted (maximal acceptance).
* ``logit_scale != 1``: the guided logits are multiplied by it, a temperature-perturbed copy of the
  target (q != p but close, same top-k support), so exact speculative sampling exercises both
  acceptances and residual resampling.

The oracle ignores the hidden states the loop hands to ``start``/``commit``; it keeps its own copy
of each row's known codes. Everything is batched over rows and tree nodes: rows are right-padded
(causal attention makes the padding invisible to the positions that are read) and each row's last
valid position is gathered. It is slow (no KV cache), by design: it is a reference, not a drafter.
"""

from __future__ import annotations

import time

import torch
from torch import Tensor

from lantern.decoding.config import SamplingConfig, TreeConfig
from lantern.decoding.drafting import TreeDrafter
from lantern.decoding.sampling import apply_cfg
from lantern.errors import check
from lantern.models.llamagen import LlamaGen


class OracleBackend:
    """``DraftBackend`` that scores nodes with uncached full forwards of the target model.

    model: the target LlamaGen; cond: the same condition the loop was given (labels [B] or
    captions [B, cls, C]); cond_mask: caption mask [B, cls] (t2i), as given to ``generate``.
    ``forwards`` counts model calls (one per ``begin``/``feed``, CFG halves together);
    ``seconds`` is the wall time spent inside ``begin``/``feed`` (benchmarks subtract it to time
    the loop without the oracle's own, deliberately expensive, drafting).
    """

    def __init__(
        self,
        model: LlamaGen,
        cond: Tensor,
        sampling: SamplingConfig,
        logit_scale: float = 1.0,
        cond_mask: Tensor | None = None,
    ) -> None:
        check(logit_scale > 0, f"oracle logit_scale must be > 0, got {logit_scale}")
        self.model, self.cond, self.sampling = model.eval(), cond, sampling
        self.cond_mask = cond_mask
        self.logit_scale = logit_scale
        self.forwards = 0
        self.seconds = 0.0
        self.codes: Tensor | None = None  # [B, W] known image tokens, right-padded with 0
        self.lengths: Tensor | None = None  # [B] number of known tokens (the root included)
        self._fed_paths: Tensor | None = None  # [B, F, Dmax] token path of every fed node
        self._fed_depth: list[int] = []  # depth of every fed node, in feed order

    # -- the loop's bookkeeping -------------------------------------------------------------------

    def start(self, hidden: Tensor, root: Tensor, path_width: int | None = None) -> None:
        """root [B]: image token 0 (the pending root). ``hidden`` is not needed by the oracle."""
        check(
            root.shape[0] == self.cond.shape[0],
            f"oracle was built for {self.cond.shape[0]} rows, the loop has {root.shape[0]}",
        )
        self.codes = root[:, None].clone()
        self.lengths = torch.ones_like(root)

    def commit(self, hidden: Tensor, next_tokens: Tensor, num_new: Tensor) -> None:
        """Append the first ``num_new[b]`` entries of ``next_tokens[b]`` (next_tokens [B, A])."""
        assert self.codes is not None and self.lengths is not None
        b, a = next_tokens.shape
        width = int((self.lengths + num_new).max())
        if width > self.codes.shape[1]:
            pad = torch.zeros(b, width - self.codes.shape[1], dtype=self.codes.dtype, device=self.codes.device)
            self.codes = torch.cat([self.codes, pad], dim=1)
        j = torch.arange(a, device=next_tokens.device)[None, :]  # [1, A]
        new = j < num_new[:, None]  # [B, A]
        rows = torch.arange(b, device=next_tokens.device)[:, None].expand(-1, a)
        self.codes[rows[new], (self.lengths[:, None] + j)[new]] = next_tokens[new]
        self.lengths = self.lengths + num_new

    # -- scoring ----------------------------------------------------------------------------------

    @torch.no_grad()
    def begin(self) -> Tensor:
        """Guided logits for the token after each row's known codes: [B, V]."""
        assert self.codes is not None and self.lengths is not None
        start = time.perf_counter()
        b = self.codes.shape[0]
        self._fed_paths = torch.zeros(b, 0, 0, dtype=torch.long, device=self.codes.device)
        self._fed_depth = []
        logits = self._score(self.codes[:, None], self.lengths[:, None])[:, 0]
        self._clock(start)
        return logits

    @torch.no_grad()
    def feed(self, parent: Tensor, tokens: Tensor, depth: int, ancestors: Tensor) -> Tensor:
        """parent [B, E] feed index (-1 = root), tokens [B, E], depth >= 1. Returns [B, E, V].

        A node's path is its parent's path plus its own token (parents sit one level up, which
        both tree builders guarantee: the ``ancestors`` mask is therefore not needed here).
        """
        assert self.codes is not None and self.lengths is not None and self._fed_paths is not None
        start = time.perf_counter()
        b, e = tokens.shape
        fed = self._fed_paths  # [B, F, Dmax]
        parent_depth = torch.tensor([0, *self._fed_depth], device=tokens.device)[parent + 1]  # [B, E]
        check(bool((parent_depth == depth - 1).all()), "oracle: a fed node's parent must sit one level up")
        width = max(fed.shape[2], depth)
        fed = torch.nn.functional.pad(fed, (0, width - fed.shape[2]))
        root_row = torch.zeros(b, 1, width, dtype=torch.long, device=tokens.device)
        source = torch.cat([root_row, fed], dim=1)  # [B, 1 + F, W]; row 0 = the root's empty path
        paths = source.gather(1, (parent + 1)[:, :, None].expand(-1, -1, width)).clone()  # [B, E, W]
        paths[:, :, depth - 1] = tokens
        self._fed_paths = torch.cat([fed, paths], dim=1)
        self._fed_depth.extend([depth] * e)
        seqs = self._with_paths(paths[:, :, :depth])  # [B, E, W_codes + depth]
        logits = self._score(seqs, (self.lengths + depth)[:, None].expand(-1, e))
        self._clock(start)
        return logits

    def _clock(self, start: float) -> None:
        """Add the time since ``start`` to ``seconds`` (after the GPU's queued work has run)."""
        if self.model.device.type == "cuda":
            torch.cuda.synchronize(self.model.device)
        self.seconds += time.perf_counter() - start

    def _with_paths(self, paths: Tensor) -> Tensor:
        """Known codes followed by each node's path, placed at each row's own length.

        paths [B, E, d] -> [B, E, W + d] (right-padded with 0)."""
        assert self.codes is not None and self.lengths is not None
        b, e, d = paths.shape
        w = self.codes.shape[1]
        seqs = torch.zeros(b, e, w + d, dtype=torch.long, device=paths.device)
        seqs[:, :, :w] = self.codes[:, None]
        cols = self.lengths[:, None, None] + torch.arange(d, device=paths.device)  # [B, 1, d]
        # Positions >= length hold padding (0) in self.codes, so overwriting them is safe.
        return seqs.scatter(2, cols.expand(-1, e, -1), paths)

    def _score(self, seqs: Tensor, lengths: Tensor) -> Tensor:
        """seqs [B, E, L] image tokens, lengths [B, E] valid prefix -> guided logits [B, E, V]
        for the token at position ``lengths`` (logit row i of the forward predicts token i).

        Rows whose image is complete are not run (the loop ignores their drafts; they get zero
        logits): near the end of a batch most rows are done and the oracle would otherwise cost a
        full-batch forward per step for the few stragglers."""
        assert self.lengths is not None
        b, e, length = seqs.shape
        out = torch.zeros(b, e, self.model.config.vocab_size, device=seqs.device)
        alive = (self.lengths < self.model.config.block_size).nonzero().flatten()  # [B_a]
        if alive.numel() == 0:
            return out
        width = int(lengths[alive].max())  # tokens past the longest read position are not needed
        flat = seqs[alive, :, :width].reshape(-1, width)  # [B_a*E, width]
        cond = self.cond[alive].repeat_interleave(e, dim=0)
        mask = None if self.cond_mask is None else self.cond_mask[alive].repeat_interleave(e, dim=0)
        streams = 2 if self.sampling.use_cfg else 1
        if streams == 2:
            cond = torch.cat([cond, self.model.null_condition(cond.shape[0]).to(cond.dtype)])
            flat = flat.repeat(2, 1)
            mask = None if mask is None else mask.repeat(2, 1)
        logits, _ = self.model(cond, flat, mask)  # [S*B_a*E, width+1, V]
        self.forwards += 1
        idx = lengths[alive].reshape(-1).repeat(streams)[:, None, None].expand(-1, 1, logits.shape[-1])
        picked = logits.gather(1, idx)[:, 0]  # [S*B_a*E, V]
        guided = apply_cfg(picked, self.sampling.cfg_scale, streams)  # [B_a*E, V]
        out[alive] = (guided * self.logit_scale).reshape(alive.numel(), e, -1)
        return out


def make_oracle_drafter(
    model: LlamaGen,
    cond: Tensor,
    sampling: SamplingConfig,
    tree: TreeConfig,
    logit_scale: float = 1.0,
    cond_mask: Tensor | None = None,
) -> TreeDrafter:
    """A :class:`TreeDrafter` over an :class:`OracleBackend` (build a fresh one per ``generate``)."""
    backend = OracleBackend(model, cond, sampling, logit_scale, cond_mask)
    return TreeDrafter(backend, tree, sampling, model.config.vocab_size)


