"""Subsequence verification (SJD-SV, Zhang et al., ICML 2026, arXiv 2609.13245): a relaxed plug-in
for the verification of a Jacobi window (SJD, GSD, LANTERN). Pure functions.

A single image token often describes too small a patch to be judged on its own, so SJD-SV tests
*runs* of drafts instead of each draft:

1. Partition. The window's drafts x_1..x_D are cut into maximal runs along which the target's
   probability of the draft, p_d(x_d), does not decrease (a drop starts a new run).
2. High-confidence tail. In a run x_b..x_e the tail starts at the largest g with
   ``sum_{i=g..e} p_i(x_i) >= alpha * sum_{i=b..e} p_i(x_i)`` (alpha: ``SubsequenceConfig.alpha``,
   the paper's 0.8).
3. Joint test. One uniform u for the run; the run passes when
   ``u < min(1, prod_{i=g..e} ratio_i)``, where ratio_i is the base rule's acceptance ratio
   (p(x)/q(x) for SJD, p~(x)/q(x) for LANTERN, p(G)/q(G) for GSD). The head x_b..x_{g-1} is not
   tested: it is accepted with its tail.
4. Fallback. Otherwise the tail's end moves back, e' = e-1, ..., g, and the longest x_g..x_e' that
   passes with the same u is kept; the first draft after the kept ones is resampled from the base
   rule's residual at that position (norm(max(p - q, 0)) for SJD), and the walk stops there. A run
   that passed in full hands over to the next run.

``min(1, prod a_i) >= prod min(1, a_i)``, so a run passes at least as often as its drafts would one
by one, and the head is never tested: this is *not* lossless, whatever the base rule.

Left open by the paper as we read it (the choices are ours, and the docs say so):

* Which uniform the fallback uses: the run's one u again (each shorter tail is a weaker claim of
  the same event, so one u decides them all; a row's random numbers stay a fixed count per round).
  A run uses the uniform of its first draft, so a run of one draft is SJD's own test of it.
* When even the one-draft tail x_g fails: the first failed position is g, so x_g is resampled and
  the head x_b..x_{g-1} stands (the fallback resamples from the first failed position on, and the
  head is never what rejects a run).
* A run whose probabilities sum to 0: its tail is its last draft.
* Drafts the paper's Jacobi methods do not have: a draft no model drew (a Jacobi initial guess,
  ``member`` False: lantern.decoding.acceptance, drawn / undrawn) or that the target cannot produce
  (p(x) = 0, outside top-k / top-p) never shares a run: it is a run of its own, tested exactly as
  SJD does, so noise or an impossible token is never carried into the image by its neighbours.
* Greedy decoding (temperature 0), which the paper does not run: the ratio of a draft is 1 when it
  is its parent's (LANTERN-relaxed) argmax and 0 otherwise (point masses), and the confidences
  are ``softmax(logits)`` without temperature, as the greedy relaxed test reads them
  ([LANTERN code]). It does not reduce to greedy acceptance: a head is kept whatever it holds.

Not implemented: subsequence verification of trees (SJD-PAC) and of PJD's grid.
"""

from __future__ import annotations

import torch
from torch import Tensor

# SJD-SV's setting lives in the torch-free lantern.decoding.config; re-exported here, where it was defined first.
from lantern.decoding.config import DEFAULT_SV_ALPHA as DEFAULT_SV_ALPHA
from lantern.decoding.config import SubsequenceConfig as SubsequenceConfig


def run_starts(conf: Tensor, member: Tensor) -> Tensor:
    """[B, D] bool: draft d opens a run: the first draft, a drop in confidence, or a side of a
    draft that may not share a run (``member`` False)."""
    drop = conf[:, 1:] < conf[:, :-1]
    joined = member[:, 1:] & member[:, :-1]
    return torch.cat([torch.ones_like(member[:, :1]), drop | ~joined], dim=1)


def subsequence_accepted(
    conf: Tensor,  # [B, D] target probability p(x_d) of each draft (the partition's confidence)
    ratio: Tensor,  # [B, D] each draft's acceptance ratio under the base rule, uncapped (> 0 where conf > 0)
    member: Tensor | None,  # [B, D] bool: the draft may share a run (drawn by a model); None: every draft
    usable: Tensor,  # [B, D] bool: the draft is tested at all (within the depth cap, drawable)
    u: Tensor,  # [B, D] uniforms in [0, 1): column d is used when a run starts at d
    alpha: float,
) -> Tensor:
    """[B, D] bool: the drafts SJD-SV accepts, a prefix of each row (module docstring, steps 1-4).

    Vectorised over the window with [B, D, D] run masks (D is a window: at most a few dozen), no
    host sync; the products are sums of logs, so long runs neither overflow nor underflow.
    """
    d = conf.shape[1]
    idx = torch.arange(d, device=conf.device)
    may_join = usable & (conf > 0) if member is None else member & usable & (conf > 0)
    run = run_starts(conf, may_join).long().cumsum(1)  # [B, D] run number of each draft
    same = run[:, :, None] == run[:, None, :]  # [B, D(j), D(i)]: i is in j's run
    first = torch.where(same, idx, d).amin(-1)  # [B, D] the run's first draft
    zero = torch.zeros((), dtype=conf.dtype, device=conf.device)
    total = torch.where(same, conf[:, None, :], zero).sum(-1)  # [B, D] the run's confidence
    rest = torch.where(same & (idx >= idx[:, None]), conf[:, None, :], zero).sum(-1)  # from j to the run's end
    starts_tail = rest >= alpha * total  # true from the run's start up to its tail's start
    tail = torch.where(same & starts_tail[:, None, :], idx, -1).amax(-1)  # [B, D] g of j's run
    span = same & (idx >= tail[:, :, None]) & (idx <= idx[:, None])  # [B, j, i]: i in x_g..x_j
    log_joint = torch.where(span, ratio.log()[:, None, :], zero).sum(-1)  # log prod_{g..j} ratio_i
    passes = (idx < tail) | (u.gather(1, first).log() < log_joint)  # the head always; a tail end by the test
    end = torch.where(same & passes[:, None, :], idx, -1).amax(-1)  # the longest passing end of j's run
    return ((idx <= end) & usable).long().cumprod(1).bool()
