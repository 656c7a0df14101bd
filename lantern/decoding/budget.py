"""The token budget of LANTERN's relaxation: a bound on every *emitted* token, not on every test.

With ``RelaxationConfig(budget="token")`` the token emitted at a tree level (the accepted child,
or the recovered token when every child is rejected) satisfies, whatever the number of siblings
and whether they are deterministic or drawn without replacement:

* absolute mode (LANTERN, δ): ``TV(emitted, p) <= δ``;
* relative mode (LANTERN++, λ): ``emitted(y) <= λ·p(y)`` for every token y.

where p is the target's distribution at the node. docs/relaxation_budget.md has the proof. Test j
of token x_j, with conditional draft probability ``q_j(x_j)`` (1 for deterministic drafts), is
reached with probability ``reach_j = Π_{i<j} (1 - a_i)`` and raises the acceptance probability
from the exact rule's ``a_exact_j`` to ``a_j``. The budget limits ``Σ_j reach_j·(a_j - a_exact_j)``,
in units of the emitted token's probability:

* sampled drafts: rejections take the *exact* residual, so the walk is coupled with the lossless
  one and can part from it only in those acceptance gaps (P(part) = the sum above);
* deterministic drafts: rejections keep the paper's residual (A(x) zeroed, the moved mass comes
  from x's neighbours), and the sum above bounds the level's TV by induction over the tests.

A test gains at most ``c/q_j(x)`` acceptance from neighbour mass c, hence the neighbour-mass cap
``left·q_j(x)/reach_j`` of :meth:`TokenBudget.cap`.

Pure functions of tensors, like :mod:`lantern.decoding.acceptance`, which calls them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from lantern.decoding.config import RelaxationConfig


@dataclass(frozen=True)
class TokenBudget:
    """What one tree level (the children of each row's current node) has left to spend."""

    p_node: Tensor  # [B, V] the target at the node: the distribution the bound refers to
    reach: Tensor  # [B] P(the next test is reached | this level's draws), over its uniforms
    spent: Tensor  # [B] Σ_i reach_i·(a_relaxed_i - a_exact_i) over the tests done so far

    @classmethod
    def start(cls, p_node: Tensor) -> TokenBudget:
        """A fresh budget at a node whose target is ``p_node`` [B, V]."""
        ones = torch.ones(p_node.shape[0], dtype=p_node.dtype, device=p_node.device)
        return cls(p_node, ones, torch.zeros_like(ones))

    def cap(self, cfg: RelaxationConfig, x: Tensor, q_x: Tensor) -> Tensor:
        """[B] most neighbour mass the test of x [B] may aggregate, q_x [B] = q_j(x) (1 if
        deterministic): reach·(c/q_x) must fit in what is left of the budget for x."""
        if cfg.mode == "absolute":
            left = (cfg.delta - self.spent).clamp(min=0.0)
        else:  # each token is tested at most once per level, so each gets its own (λ-1)·p(x)
            left = (cfg.lam - 1.0) * self.p_node.gather(-1, x[:, None]).squeeze(-1)
        return left * q_x / self.reach.clamp(min=torch.finfo(self.reach.dtype).tiny)

    def after_test(self, r_x: Tensor, p_tilde: Tensor, q_x: Tensor, tested: Tensor) -> TokenBudget:
        """The budget after testing x where ``tested`` [B]: r_x the exact residual's mass at x,
        p_tilde the relaxed mass the test used, q_x = q_j(x) (all [B])."""
        a_exact = (r_x / q_x).clamp(max=1.0)
        a_relaxed = (p_tilde / q_x).clamp(max=1.0)
        spent = torch.where(tested, self.spent + self.reach * (a_relaxed - a_exact), self.spent)
        reach = torch.where(tested, self.reach * (1.0 - a_relaxed), self.reach)
        return TokenBudget(self.p_node, reach, spent)


def uses_token_budget(relax: RelaxationConfig | None) -> bool:
    """True when ``relax`` moves mass under the token budget."""
    return relax is not None and not relax.is_exact and relax.budget == "token"
