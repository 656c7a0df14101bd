"""EAGLE draft backend: the drafter model's cache, feeds and guided logits (bound to the EAGLE model)."""

from __future__ import annotations

import torch
from torch import Tensor

from lantern.decoding.cache import CachePool, KVCache
from lantern.decoding.compiling import resolve_compile, step_fn
from lantern.decoding.config import SamplingConfig, TreeConfig
from lantern.decoding.drafting import TreeDrafter, guided_logits
from lantern.decoding.loop import CodeHead
from lantern.decoding.phases import phase
from lantern.drafters.checks import check_drafter_layout, check_drafter_matches_target
from lantern.errors import check
from lantern.models.drafter import EagleDrafterModel
from lantern.models.invariant import follow_batch_invariance
from lantern.models.llamagen import LlamaGen


class EagleBackend:
    """Scores tree nodes with an EAGLE drafter and its own static KV cache (one stream per CFG row).

    Static shapes throughout, so the two steps compile to one graph each (per fed-node count):
    attention spans the whole cache, and the fed nodes' predicted features live in a
    preallocated buffer ``[S*B, max_len, D]`` (column 0 = the root, column 1 + f = fed node f).
    """

    def __init__(
        self,
        model: EagleDrafterModel,
        lm_head: CodeHead,
        sampling: SamplingConfig,
        streams: int,
        max_len: int,
        compile: str | None = None,
        cache_pool: CachePool | None = None,
    ) -> None:
        self.model, self.lm_head, self.sampling = model.eval(), lm_head, sampling
        follow_batch_invariance(self.model, lm_head)
        self.streams, self.max_len = streams, max_len
        self.compile = resolve_compile(compile, model.device)
        self.cache_pool = cache_pool if cache_pool is not None else CachePool()
        self.cache: KVCache | None = None
        self.forwards = torch.zeros((), dtype=torch.long, device=model.device)  # in place: see LlamaGenTarget
        self._pending: tuple[Tensor, Tensor, Tensor] | None = None  # feats, tokens, counts
        self._hidden: Tensor | None = None  # [S*B, max_len, D] root + fed nodes' outputs
        self._fed = 0  # nodes fed since the context pass
        self._base: Tensor | None = None  # [S*B] committed length after the context pass

    def start(self, hidden: Tensor, root: Tensor, path_width: int | None = None) -> None:
        """hidden [S*B, L, D]: the condition's target features; root [B]: image token 0.

        path_width: the width of every later round's commit (the accepted path, root included).
        The condition's first L - 1 pairs are absorbed here (part of the prefill), and its last
        pair is left pending, padded to ``path_width``: the first round's context pass then has
        the shape of every other round's, so a compiled round is one graph from the first round on.
        """
        cfg = self.model.config
        n, length, _ = hidden.shape
        static = self.compile is not None
        self.cache = self.cache_pool.get("drafter", 1, n, cfg.kv_heads, self.max_len, cfg.head_dim,
                                         self.model.dtype, self.model.device, static=static)
        self._hidden = self.cache_pool.buffer("drafter_hidden", (n, self.max_len, cfg.hidden_size), self.model.dtype,
                                              self.model.device, static=static)
        b, device = root.shape[0], root.device
        feats = hidden.to(self.model.dtype)
        if length > 1:  # condition positions pair with placeholder token 0 ([LANTERN code] ea_model_llamagen.py)
            zeros = torch.zeros(b, length - 1, dtype=torch.long, device=device)
            step_fn(_context_step, self.compile, self.model.device)(
                self.model, self.lm_head, self.cache, self._hidden, feats[:, :-1], zeros,
                torch.full((b,), length - 1, dtype=torch.long, device=device), self.streams, self.sampling.cfg_scale)
            self.forwards += 1
        width = max(path_width or 1, 1)
        last = torch.zeros(n, width, feats.shape[-1], dtype=feats.dtype, device=device)
        last[:, 0] = feats[:, -1]
        tokens = torch.zeros(b, width, dtype=torch.long, device=device)
        tokens[:, 0] = root
        self._pending = (last, tokens, torch.ones(b, dtype=torch.long, device=device))
        self._base = torch.zeros(n, dtype=torch.long, device=device)
        self._fed = 0  # (a backend reused for another decode starts like a new one: same fingerprint)

    def commit(self, hidden: Tensor, next_tokens: Tensor, num_new: Tensor) -> None:
        pending = self._pending
        if pending is not None and pending[0].shape == hidden.shape and pending[1].shape == next_tokens.shape:
            # In place: a compiled round's state keeps its addresses (CUDA graphs replay on them).
            for buf, new in zip(pending, (hidden, next_tokens, num_new), strict=True):
                buf.copy_(new)
        else:
            self._pending = (hidden.clone(), next_tokens.clone(), num_new.clone())

    def row_tensors(self) -> list[tuple[Tensor | None, int, int]]:
        """Per-row state (``lantern.decoding.rows``): the drafter's cache and feature buffer, the
        pending (features, tokens, counts) of the last commit, the base lengths."""
        assert self.cache is not None and self._pending is not None
        s = self.streams
        feats, tokens, counts = self._pending
        return [*self.cache.row_tensors(s), (self._hidden, s, 0), (feats, s, 0), (tokens, 1, 0), (counts, 1, 0),
                (self._base, s, 0)]

    @torch.no_grad()
    def begin(self) -> Tensor:
        """Context pass over each row's new (feature, token) pairs; returns root logits [B, V]."""
        assert self.cache is not None and self._pending is not None and self._hidden is not None
        feats, tokens, counts = self._pending
        with phase("drafter"):
            step = step_fn(_context_step, self.compile, self.model.device)
            logits = step(self.model, self.lm_head, self.cache, self._hidden, feats.to(self.model.dtype), tokens,
                          counts, self.streams, self.sampling.cfg_scale)[0]
        self.forwards += 1
        assert self._base is not None
        self._base.copy_(self.cache.lengths)
        self._fed = 0
        return logits

    @torch.no_grad()
    def feed(self, parent: Tensor, tokens: Tensor, depth: int, ancestors: Tensor) -> Tensor:
        assert self.cache is not None and self._base is not None and self._hidden is not None
        with phase("drafter"):
            s, e, base, f_prev = self.streams, tokens.shape[1], self._base, self._fed
            slots = base[:, None] + (f_prev + torch.arange(e, device=tokens.device))  # [N, E]
            positions = (base[:, None] + (depth - 1)).expand(-1, e)
            tree_cols = _fed_columns(ancestors.repeat(s, 1, 1), f_prev, self.max_len)
            step = step_fn(_feed_step, self.compile, self.model.device)
            logits = step(self.model, self.lm_head, self.cache, self._hidden, parent.repeat(s, 1), tokens.repeat(s, 1),
                          base, slots, positions, tree_cols, s, self.sampling.cfg_scale)[0]
        self.forwards += 1
        self._fed += e
        return logits


def _context_step(
    model: EagleDrafterModel,
    lm_head: CodeHead,
    cache: KVCache,
    hidden_buf: Tensor,  # [N, W, D]; column 0 receives the root's predicted feature
    feats: Tensor,  # [N, A, D] target features of each row's new tokens
    tokens: Tensor,  # [B, A] the token after each feature
    counts: Tensor,  # [B] new tokens per row (<= A)
    streams: int,
    cfg_scale: float,
) -> tuple[Tensor]:
    """The drafter's context pass (a compiled region): absorb the new pairs into the cache,
    advance its lengths, and score the root. Returns (guided root logits [B, V],)."""
    a = tokens.shape[1]
    counts_s = counts.repeat(streams)
    lengths = cache.lengths
    j = torch.arange(a, device=feats.device)
    slots = lengths[:, None] + j  # [N, A]
    rel = torch.arange(cache.max_len, device=feats.device)[None, None, :] - lengths[:, None, None]  # [N, 1, S]
    mask = (rel < 0) | ((rel >= 0) & (rel <= j[None, :, None]))  # prefix + causal among new
    out = model(feats, tokens.repeat(streams, 1), slots, mask, cache, slots)
    cache.lengths += counts_s
    last = (counts_s - 1).clamp(min=0)
    root = out.gather(1, last[:, None, None].expand(-1, 1, out.shape[-1]))  # [N, 1, D]
    hidden_buf.index_copy_(1, torch.zeros(1, dtype=torch.long, device=root.device), root)  # in place, no view
    return (guided_logits(lm_head, root, cfg_scale, streams)[:, 0],)


def _feed_step(
    model: EagleDrafterModel,
    lm_head: CodeHead,
    cache: KVCache,
    hidden_buf: Tensor,  # [N, W, D] root + fed outputs; this step's outputs are written into it
    parent: Tensor,  # [N, E] feed index of each node's parent (-1 = root)
    tokens: Tensor,  # [N, E]
    base: Tensor,  # [N] committed length after the context pass
    slots: Tensor,  # [N, E] cache slots of the new nodes (base + their feed index)
    positions: Tensor,  # [N, E] rotary indices
    tree_cols: Tensor,  # [N, E, W] bool over fed indices: ancestors and self (see _fed_columns)
    streams: int,
    cfg_scale: float,
) -> tuple[Tensor]:
    """One drafter forward over E tree nodes (a compiled region). Returns (guided logits [B, E, V],)."""
    e, width = tokens.shape[1], tree_cols.shape[2]
    idx = (parent + 1)[:, :, None].expand(-1, -1, hidden_buf.shape[-1])
    feats = hidden_buf.gather(1, idx)  # [N, E, D] each node's parent's predicted feature
    rel = torch.arange(cache.max_len, device=base.device)[None, :] - base[:, None]  # [N, S] feed index
    cols = rel.clamp(0, width - 1)[:, None, :].expand(-1, e, -1)
    mask = (rel < 0)[:, None, :] | (tree_cols.gather(2, cols) & (rel >= 0)[:, None, :])  # [N, E, S]
    out = model(feats, tokens, positions, mask, cache, slots)
    hidden_buf.index_copy_(1, slots[0] - base[0] + 1, out)  # feed indices are the same in every row
    return (guided_logits(lm_head, out, cfg_scale, streams),)


def _fed_columns(ancestors: Tensor, f_prev: int, width: int) -> Tensor:
    """[N, E, W] bool over feed indices: each node's fed ancestors (< f_prev) and itself (f_prev + i),
    padded to a fixed width W so that every feed of E nodes has the same shape."""
    n, e, _ = ancestors.shape
    cols = torch.zeros(n, e, width, dtype=torch.bool, device=ancestors.device)
    cols[:, :, :f_prev] = ancestors
    i = torch.arange(e, device=ancestors.device)
    cols[:, i, f_prev + i] = True
    return cols


def make_eagle_drafter(
    model: LlamaGen, drafter_model: EagleDrafterModel, sampling: SamplingConfig, tree: TreeConfig
) -> tuple[TreeDrafter, int]:
    """An EAGLE :class:`TreeDrafter` and the ``max_tree_nodes`` the target must be built with.

    The drafter cache holds the condition, every committed token, one accepted path and the
    nodes fed in one round; its size is derived from the tree instead of guessed.
    """
    cfg = model.config
    check_drafter_matches_target(drafter_model.config, cfg)
    check_drafter_layout(drafter_model.config, cfg, "(the drafter model given)")
    streams = 2 if sampling.use_cfg else 1
    check(tree.kind != "none", "a drafter needs a tree (chain, static or dynamic)")
    max_len = cfg.cls_token_num + cfg.block_size + tree.drafter_slots
    backend = EagleBackend(drafter_model, model.output, sampling, streams, max_len)
    return TreeDrafter(backend, tree, sampling, cfg.vocab_size), tree.num_nodes
