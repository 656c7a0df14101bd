"""Target adapter: the decoding loop's view of a visual AR model.

The loop works on B image rows. The adapter owns everything model-specific (STYLE lesson 8):
classifier-free guidance as a ``[cond; uncond]`` doubling of the model batch (S = 2 streams, or
S = 1 when ``cfg_scale == 1``), the static KV cache and its per-row lengths, rotary positions
(prefix length + tree depth) and the attention mask ``[prefix | tree]``. Guided logits are formed
once per tree node, before any acceptance rule sees them, as in [LANTERN code] ea_model_llamagen.py.

Hidden states are returned for both streams, ``[S*B, T, D]`` in ``[cond; uncond]`` order,
because an EAGLE drafter runs one stream per CFG row as well.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from lantern.decoding.cache import CachePool, KVCache
from lantern.decoding.compiling import resolve_compile, step_fn
from lantern.decoding.config import SamplingConfig
from lantern.decoding.pjd import commit_cells, grid_positions, grid_verify_mask
from lantern.decoding.sampling import apply_cfg
from lantern.decoding.trees import TreeBuffers
from lantern.errors import LanternError, check
from lantern.models.invariant import key_granule, round_up
from lantern.models.llamagen import LlamaGen


class LlamaGenTarget:
    """LlamaGen behind the loop's interface: ``start`` / ``verify`` / ``commit``."""

    def __init__(
        self,
        model: LlamaGen,
        sampling: SamplingConfig,
        max_tree_nodes: int = 1,
        compile: str | None = None,
        cache_pool: CachePool | None = None,
    ) -> None:
        """compile: None (eager) or a mode of :func:`lantern.decoding.compiling.resolve_compile`; cache_pool:
        caches kept across images (static buffer addresses, as CUDA graphs need; no re-allocation)."""
        self.model = model.eval()
        self.sampling = sampling
        self.max_tree_nodes = max_tree_nodes
        self.compile = resolve_compile(compile, model.device)
        self.cache_pool = cache_pool if cache_pool is not None else CachePool()
        self.streams = 2 if sampling.use_cfg else 1
        self.cache: KVCache | None = None
        self.cond_mask: Tensor | None = None  # [S*B, cls] valid caption columns (t2i)
        # PJD only: the image cell each cache slot holds (-1: condition), and the last grid block's cells
        self.slot_cell: Tensor | None = None  # [S*B, S_max]
        self._grid_cells: Tensor | None = None  # [S*B, T]
        # Model forward calls (prefill + verify), for stats: a device counter, so that a compiled round
        # counts in place instead of specialising on (and recompiling for) a Python int.
        self.forwards = torch.zeros((), dtype=torch.long, device=model.device)

    # -- properties the loop and the drafter read --------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.model.config.dim

    @property
    def num_tokens(self) -> int:
        return self.model.config.block_size

    @property
    def cls_token_num(self) -> int:
        return self.model.config.cls_token_num

    @property
    def lm_head(self) -> torch.nn.Linear:
        return self.model.output

    @property
    def device(self) -> torch.device:
        return self.model.device

    # -- the three calls of the loop --------------------------------------------------------------

    def _cache_len(self) -> int:
        cfg = self.model.config
        # batch-invariant attention: a whole number of the kernel's key blocks, whatever the tree
        return round_up(cfg.cls_token_num + cfg.block_size + self.max_tree_nodes + 1, key_granule(self.model))

    def cache_bytes(self, batch: int) -> int:
        """Bytes of the key/value cache :meth:`start` allocates for ``batch`` images."""
        cfg = self.model.config
        return KVCache.nbytes(cfg.n_layer, batch * self.streams, cfg.kv_heads, self._cache_len(), cfg.head_dim,
                              self.model.dtype)

    @torch.no_grad()
    def start(self, cond: Tensor, cond_mask: Tensor | None = None,
              guidance: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
        """Prefill the condition. cond: labels [B] or captions [B, cls, C]; cond_mask [B, cls];
        ``guidance``: none (LlamaGen's unconditional row is the model's null condition).

        Returns (guided logits for image token 0 [B, V], hidden [S*B, cls, D]).
        """
        check(guidance is None, "LlamaGen targets take no guidance rows (their unconditional row is the "
                                "model's null condition)")
        model, cfg = self.model, self.model.config
        b = cond.shape[0]
        if cfg.model_type == "c2i":
            check(cond.dim() == 1, f"c2i models take labels of shape [B], got {tuple(cond.shape)}")
            model.check_labels(cond)
        rows = cond
        if self.streams == 2:
            rows = torch.cat([cond, model.null_condition(b).to(cond.dtype)])
        n_rows, cls = rows.shape[0], cfg.cls_token_num
        self.cache = self.cache_pool.get(
            "target", cfg.n_layer, n_rows, cfg.kv_heads, self._cache_len(), cfg.head_dim, model.dtype, model.device,
            static=self.compile is not None,
        )
        self.cond_mask = None
        if cond_mask is not None:
            self.cond_mask = cond_mask.bool().repeat(self.streams, 1)  # uncond reuses the mask
        h = model.embed_condition(rows)  # [S*B, cls, D]
        pos = torch.arange(cls, device=h.device).expand(n_rows, -1)
        mask = torch.ones(cls, cls, dtype=torch.bool, device=h.device).tril().expand(n_rows, -1, -1)
        if self.cond_mask is not None:
            eye = torch.eye(cls, dtype=torch.bool, device=h.device)
            mask = mask & self.cond_mask[:, None, :] | eye
        hidden = model.forward_cached(h, pos, pos, mask, self.cache)
        self.cache.lengths.fill_(cls)
        # PJD's slot -> image cell map, made here rather than on the first grid verify: every
        # round then sees the same state (a compiled round is one graph from the first round on).
        self.slot_cell = torch.full((n_rows, self.cache.max_len), -1, dtype=torch.long, device=h.device)
        self.forwards += 1
        logits = apply_cfg(model.logits(hidden[:, -1]), self.sampling.cfg_scale, self.streams)
        return logits, hidden

    @torch.no_grad()
    def verify(self, tokens: Tensor, tree_mask: Tensor, depth: Tensor, tree: TreeBuffers | None = None
               ) -> tuple[Tensor, Tensor]:
        """One forward over a tree per row, written after each row's committed prefix.

        tokens [B, T] (node 0 = the pending root token), tree_mask [B, T, T] bool (ancestors and
        self), depth [B, T]; ``tree``'s sizes are not needed (LlamaGen inserts no row-end tokens).
        Returns (guided logits [B, T, V], hidden [S*B, T, D]).
        """
        cache = self._cache()
        t = tokens.shape[1]
        if t > self.max_tree_nodes:
            raise LanternError(f"tree of {t} nodes exceeds the {self.max_tree_nodes} the cache was sized for")
        step = step_fn(_verify_step, self.compile, self.device)
        logits, hidden = step(self.model, cache, self.cond_mask, tokens, tree_mask, depth, self.streams,
                              self.sampling.cfg_scale)
        self.forwards += 1
        return logits, hidden

    def commit(self, path: Tensor, num_keep: Tensor, in_order: bool = False) -> None:
        """Keep tree nodes ``path[:, :num_keep]`` (node indices, root first) in the cache
        (``in_order``: ``Target.commit``'s)."""
        step_fn(_commit_step, self.compile, self.device)(self._cache(), path, num_keep, self.streams, in_order)

    @torch.no_grad()
    def verify_grid(self, tokens: Tensor, cells: Tensor, rows: Tensor, chains: int | None = None) -> Tensor:
        """PJD's forward (``lantern.decoding.pjd``): block tokens [B, T] at image cells [B, T], in windows
        ``rows`` [B, T] (-1 = padding), written after each row's cached slots; positions from the
        grid, visibility from :func:`lantern.decoding.pjd.grid_verify_mask` (``chains`` is not needed).
        Returns guided logits [B, T, V]."""
        cache = self._cache()
        if tokens.shape[1] > self.max_tree_nodes:
            raise LanternError(f"grid block of {tokens.shape[1]} nodes exceeds the {self.max_tree_nodes} "
                               "the cache was sized for")
        assert self.slot_cell is not None
        self._grid_cells = cells.repeat(self.streams, 1)
        step = step_fn(_verify_grid_step, self.compile, self.device)
        logits = step(self.model, cache, self.cond_mask, self.slot_cell, tokens, self._grid_cells,
                      rows.repeat(self.streams, 1), self.streams, self.sampling.cfg_scale)
        self.forwards += 1
        return logits

    def commit_grid(self, keep: Tensor, num_keep: Tensor) -> None:
        """Keep block offsets ``keep[:, :num_keep]`` (ascending) of the last grid block, recording
        their cells in ``slot_cell`` (the cache's slots are in commit order, not raster order)."""
        assert self.slot_cell is not None and self._grid_cells is not None
        cache = self._cache()
        keep_s, num_s = keep.repeat(self.streams, 1), num_keep.repeat(self.streams)
        commit_cells(self.slot_cell, cache.lengths, self._grid_cells, keep_s, num_s)
        cache.commit(keep_s, num_s)

    def row_tensors(self) -> list[tuple[Tensor | None, int, int]]:
        """Per-row state (``lantern.decoding.rows``): the cache, the caption mask, PJD's slot map."""
        s = self.streams
        return [*self._cache().row_tensors(s), (self.cond_mask, s, 0), (self.slot_cell, s, 0)]

    # -- helpers ----------------------------------------------------------------------------------

    def _cache(self) -> KVCache:
        if self.cache is None:
            raise RuntimeError("LlamaGenTarget.start() must be called before verify/commit")
        return self.cache


def _verify_step(
    model: LlamaGen,
    cache: KVCache,
    cond_mask: Tensor | None,  # [S*B, cls] valid caption columns (t2i)
    tokens: Tensor,  # [B, T]
    tree_mask: Tensor,  # [B, T, T]
    depth: Tensor,  # [B, T]
    streams: int,
    cfg_scale: float,
) -> tuple[Tensor, Tensor]:
    """The target step: one forward over a tree per row after its committed prefix, with static
    shapes (the compiled region of ``--compile``). Returns (guided logits [B, T, V], hidden [S*B, T, D])."""
    t = tokens.shape[1]
    lengths = cache.lengths  # [S*B]
    slots = lengths[:, None] + torch.arange(t, device=tokens.device)  # [S*B, T]
    positions = lengths[:, None] + depth.repeat(streams, 1)
    mask = _verify_mask(tree_mask.repeat(streams, 1, 1), lengths, t, cache.max_len, cond_mask)
    h = model.tok_embeddings(tokens.repeat(streams, 1))
    hidden = model.forward_cached(h, positions, slots, mask, cache)
    return apply_cfg(model.logits(hidden), cfg_scale, streams), hidden


def _verify_grid_step(
    model: LlamaGen,
    cache: KVCache,
    cond_mask: Tensor | None,  # [S*B, cls]
    slot_cell: Tensor,  # [S*B, S_max]
    tokens: Tensor,  # [B, T]
    cells: Tensor,  # [S*B, T]
    rows: Tensor,  # [S*B, T]
    streams: int,
    cfg_scale: float,
) -> Tensor:
    """The grid step (PJD): like :func:`_verify_step` with positions and mask from the grid."""
    cfg = model.config
    lengths = cache.lengths
    slots = lengths[:, None] + torch.arange(tokens.shape[1], device=tokens.device)
    positions = grid_positions(cells, cfg.cls_token_num, math.isqrt(cfg.block_size))
    mask = grid_verify_mask(slot_cell, lengths, cells, rows, cache.max_len)
    if cond_mask is not None:  # padded caption columns stay invisible (as in _verify_mask)
        cls = cond_mask.shape[1]
        mask = torch.cat([mask[:, :, :cls] & cond_mask[:, None, :], mask[:, :, cls:]], dim=2)
    h = model.tok_embeddings(tokens.repeat(streams, 1))
    hidden = model.forward_cached(h, positions, slots, mask, cache)
    return apply_cfg(model.logits(hidden), cfg_scale, streams)


def _commit_step(cache: KVCache, path: Tensor, num_keep: Tensor, streams: int, in_order: bool) -> tuple[()]:
    """The cache commit of every CFG stream (a compiled region: one fused gather + scatter)."""
    cache.commit(path.repeat(streams, 1), num_keep.repeat(streams), in_order)
    return ()


def _verify_mask(tree_mask: Tensor, lengths: Tensor, t: int, kv_len: int, cond_mask: Tensor | None) -> Tensor:
    """[S*B, T, kv_len] bool: the committed prefix, then the row's tree mask at its slots.

    kv_len is the whole cache, not the longest row: a static shape (one compiled graph, no host
    sync to read the lengths) for the price of attending over masked-out slots.
    """
    cols = torch.arange(kv_len, device=lengths.device)  # [S]
    rel = cols[None, :] - lengths[:, None]  # [N, S] offset from the row's prefix end
    prefix = rel < 0
    if cond_mask is not None:
        cls = cond_mask.shape[1]
        prefix = torch.cat([prefix[:, :cls] & cond_mask, prefix[:, cls:]], dim=1)
    in_tree = (rel >= 0) & (rel < t)
    idx = rel.clamp(0, t - 1)[:, None, :].expand(-1, t, -1)  # [N, T, S]
    tree = torch.gather(tree_mask, 2, idx) & in_tree[:, None, :]
    return prefix[:, None, :] | tree
