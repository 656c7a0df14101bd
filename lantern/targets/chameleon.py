"""Chameleon-family target adapter (Anole, Lumina-mGPT) for the one decoding loop.

The loop sees what it sees for LlamaGen: B rows of image *codes*, a vocabulary of VQGAN codes,
guided logits per tree node, hidden states ``[S*B, T, D]`` for an EAGLE drafter. Everything that
is Chameleon-specific stays here:

* **Prompts and guidance.** Conditional rows are ``head + prompt + tail + prefix`` (left-padded to
  a common length, positions counted from each row's first real token); unconditional rows are the
  layout's guidance context. Both are prefilled in one forward.
* **Restricted vocabulary.** Logits come from the image rows of ``lm_head`` only
  (``ChameleonLM.image_head``), so text and special tokens can never be sampled and top-k / top-p /
  LANTERN's neighbour sets all live in code space.
* **End-of-row tokens** (Lumina-mGPT). The model's sequence has a fixed new-line token after each
  row of codes; the loop's does not. ``verify`` therefore expands the loop's tree: every node that
  ends an image row gets a *shadow* child carrying the new-line token, the node's real children
  hang under the shadow, positions count the inserted tokens, and the logits / hidden state that
  predict the node's children are read at the shadow. ``commit`` keeps each accepted node's
  shadow with it. The drafter and the acceptance rules never see a new-line token.
* **A fixed prompt width.** Every prompt context is left-padded to ``prompt_width`` columns
  (masked), whatever the other prompts of its batch: a row's keys sit at the same cache columns
  alone and in any batch, and a row can move between batches (``row_tensors``). Attention kernels
  split the key axis into blocks by column, so a batch-dependent padding would change a row's
  floats (measured: ATen's CPU kernel gives other bits for 32 more padding columns).
* **Static shapes** (``compile``, or the batch-invariant mode of ``lantern.models.invariant``).
  Nothing reads the device and no shape depends on the batch: the forward attends over the whole
  cache (masked) instead of the longest row, and the new-line shadows take a fixed number of
  slots, the most row ends the tree can hold (``_window``: the loop passes the tree's static
  sizes), whether or not a row reaches its row end this round (padding shadows attend to
  themselves and are never kept). Eager default decoding sizes both to the batch and skips the
  columns that are padding in every row, in the prefill too (one host read per forward: cheaper,
  and its floats may differ from a row's alone in the last bits, as the default mode's matmuls
  may); deterministic mode computes the prefill over every column.
* **Drafter context.** ``start`` hands the drafter the features of the image prefix only (the
  same positions in conditional and unconditional rows, no padding); the prompt reaches the
  drafter through the target's features there.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

from lantern.decoding.cache import CachePool, KVCache
from lantern.decoding.compiling import resolve_compile
from lantern.decoding.config import SamplingConfig
from lantern.decoding.pjd import commit_cells, grid_verify_mask, kept_offsets
from lantern.decoding.sampling import apply_cfg
from lantern.decoding.trees import TreeBuffers
from lantern.errors import LanternError, check
from lantern.models.chameleon import ChameleonLM, ImageLayout
from lantern.models.invariant import is_batch_invariant, key_granule, round_up

if TYPE_CHECKING:
    from lantern.models.emu3 import Emu3LM
    from lantern.models.janus import JanusLM


# Columns every prompt context is left-padded to (the prompt in its template: the layout's head,
# tail and image prefix included). Real prompts of the field's benchmarks (GenEval, DPG, COCO
# captions) take 20-120 tokens in Lumina-mGPT's template; Emu3's negative prompt ~60.
DEFAULT_PROMPT_WIDTH = 256


def encode_prompts(token_lists: Sequence[Sequence[int]], layout: ImageLayout,
                   width: int | None = None, repeats: int = 1) -> tuple[Tensor, Tensor]:
    """Conditional contexts for text token lists: (ids [B, L] left-padded, mask [B, L] True = real),
    each list's context ``repeats`` times in a row. ``width``: the target's prompt width, which no
    context may exceed (None: no bound); the first that does is named by its index in the list."""
    check(len(token_lists) > 0, "no prompts to generate from")
    rows = [[*layout.head, *map(int, t), *layout.tail, *layout.prefix] for t in token_lists]
    if width is not None:
        check_prompt_widths([len(r) for r in rows], width)
    return left_padded([r for r in rows for _ in range(repeats)])


def left_padded(rows: Sequence[Sequence[int]]) -> tuple[Tensor, Tensor]:
    """Token rows as (ids [B, L], mask [B, L] True = real), each at the end of the longest's width."""
    length = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), length, dtype=torch.long)
    mask = torch.zeros(len(rows), length, dtype=torch.bool)
    for i, r in enumerate(rows):
        ids[i, length - len(r) :] = torch.tensor(list(r), dtype=torch.long)
        mask[i, length - len(r) :] = True
    return ids, mask


def new_line_slots(nodes: int, per_depth: int, levels: int, width: int) -> int:
    """The most row-end nodes a forward over ``nodes`` nodes can hold, whatever the row's position:
    the nodes span ``levels`` depths with at most ``per_depth`` at each, and a node ends an image
    row where root index + depth + 1 is a multiple of ``width``, so at most ceil(levels / width)
    of the depths can."""
    return min(nodes, per_depth * math.ceil(levels / width))


def check_prompt_widths(lengths: Sequence[int], width: int) -> None:
    """Every prompt context (``lengths``: tokens in the model's template) fits ``width`` columns.
    Of several prompts, the first that does not is named by its index (as the image files and
    ``--prompts`` order name them), with the longest, so that one rerun with the right
    ``--prompt-width`` suffices."""
    over = [i for i, n in enumerate(lengths) if n > width]
    if not over:
        return
    cost = "every row then pays that many cache columns"
    if len(lengths) == 1:
        check(False, f"the prompt takes {lengths[0]} tokens in the model's template, more than --prompt-width "
                     f"{width} (shorten it, or raise --prompt-width to {lengths[0]} or more: {cost})", field="prompt")
    j = max(range(len(lengths)), key=lengths.__getitem__)
    check(False, f"prompt {over[0]} takes {lengths[over[0]]} tokens in the model's template, more than --prompt-width "
                 f"{width} ({len(over)} of {len(lengths)} prompts do; the longest, prompt {j}, takes {lengths[j]}): "
                 f"shorten them, or raise --prompt-width to {lengths[j]} or more ({cost})", field="prompt")


class ChameleonTarget:
    """A Chameleon LM behind the loop's interface: ``start`` / ``verify`` / ``commit``.

    ``model`` may also be a :class:`~lantern.models.janus.JanusLM` or an
    :class:`~lantern.models.emu3.Emu3LM`, which offer the same members (``lantern.targets.janus.JanusTarget``
    changes only the guidance rows; ``lantern.targets.emu3.Emu3Target`` the guidance rows and how
    they are combined)."""

    def __init__(self, model: ChameleonLM | JanusLM | Emu3LM, layout: ImageLayout, sampling: SamplingConfig,
                 max_tree_nodes: int = 1, compile: str | None = None, cache_pool: CachePool | None = None,
                 prompt_width: int = DEFAULT_PROMPT_WIDTH) -> None:
        """compile: None (eager) or a mode of :func:`lantern.decoding.compiling.resolve_compile`;
        cache_pool: caches kept across images (static buffer addresses, as CUDA graphs need);
        prompt_width: the columns every prompt context is left-padded to."""
        self.model = model
        self.layout = layout
        self.sampling = sampling
        self.max_tree_nodes = max_tree_nodes
        self.compile = resolve_compile(compile, model.device)
        self.prompt_width = prompt_width
        # Static shapes (see the module docstring): compiled, or batch-invariant (deterministic mode,
        # whose promise is a row's floats alone in every batch: then no shape follows the batch).
        self.invariant = is_batch_invariant(model)
        self.static = self.compile is not None or self.invariant
        self.cache_pool = cache_pool if cache_pool is not None else CachePool()
        self.streams = 2 if sampling.use_cfg else 1
        # What the loop and the drafter read (code space: the image rows of the LM head).
        self.vocab_size, self.hidden_size, self.lm_head = model.num_codes, model.hidden_size, model.image_head
        self.num_tokens, self.device = layout.num_tokens, model.device
        self.prefix_len = len(layout.prefix)  # positions ``start`` hands the drafter (the image prefix)
        self.cache: KVCache | None = None
        # Model forwards (prefill + verify), for stats: a device counter, so that a compiled round
        # counts in place instead of baking a Python int into its graph.
        self.forwards = torch.zeros((), dtype=torch.long, device=model.device)
        self.key_mask: Tensor | None = None  # [S*B, L] real prompt columns
        self.pos_offset: Tensor | None = None  # [S*B] left padding of each row (position = slot - offset)
        self.root_index: Tensor | None = None  # [B] code index of the pending root token
        self._shadows: tuple[Tensor, Tensor] | None = None  # (row_end [B, T], shadow slot [B, T]) of the last verify
        # PJD (verify_grid): each cache slot's grid key (2 * cell, + 1 for a new-line token; -1:
        # prompt), and the last grid block's keys and new-line shadows (owner node [B, E], valid [B, E])
        self.slot_cell: Tensor | None = None
        self._grid: tuple[Tensor, Tensor, Tensor] | None = None
        # What a drafter that reads the whole model sequence (LANTERN's released Chameleon drafters,
        # lantern.drafters.released) needs beyond the loop's interface: the prefill's ids and features,
        # each verified node's own feature (at a row end: the state at the code, not at its new-line),
        # and the last committed path.
        self.prefill: tuple[Tensor, Tensor] | None = None  # (ids [S*B, L], hidden [S*B, L, D])
        self.node_hidden: Tensor | None = None  # [S*B, T, D]
        self.last_path: Tensor | None = None  # [B, W]

    # -- the three calls of the loop --------------------------------------------------------------

    @torch.no_grad()
    def start(self, cond: Tensor, cond_mask: Tensor | None = None,
              guidance: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
        """Prefill. cond: prompt contexts [B, L] (``encode_prompts``); cond_mask [B, L] (True = real);
        ``guidance``: CFG's unconditional rows (ids [B, L'], mask, left-padded: Emu3's negative prompt
        per row), else :meth:`guidance_rows`'.

        Returns (guided logits for code 0 [B, V], hidden of the image prefix [S*B, P, D]).
        """
        check(cond.dim() == 2, f"Chameleon targets take token ids [B, L], got shape {tuple(cond.shape)}")
        b, length = cond.shape
        mask = torch.ones_like(cond, dtype=torch.bool) if cond_mask is None else cond_mask.bool()
        prefix = torch.tensor(self.layout.prefix, device=cond.device)
        p = len(self.layout.prefix)
        check(
            length >= p and bool((cond[:, -p:] == prefix).all()) and bool(mask[:, -p:].all()),
            "every prompt context must end with the layout's image prefix (build them with encode_prompts)",
        )
        check_prompt_widths([length], self.prompt_width)
        extra = self.prompt_width - length  # the same columns for every row, alone or in any batch
        cond, mask, length = F.pad(cond, (extra, 0)), F.pad(mask, (extra, 0), value=False), self.prompt_width
        ids, mask = cond, mask
        if self.streams == 2:
            u_ids, u_mask = self.guidance_rows(cond, mask) if guidance is None else self._given(guidance, b)
            ids, mask = torch.cat([cond, u_ids]), torch.cat([mask, u_mask])
        n_rows = ids.shape[0]
        cfg = self.model.config
        self.cache = self.cache_pool.get("target", cfg.num_hidden_layers, n_rows, self.model.kv_heads,
                                         self._cache_len(length), self.model.head_dim, self.model.dtype,
                                         self.model.device, static=self.compile is not None)
        self.key_mask = mask
        self.pos_offset = (~mask).sum(1)
        self.root_index = torch.zeros(b, dtype=torch.long, device=cond.device)
        # The prefill computes every column in deterministic mode; otherwise it starts at the
        # longest prompt's first token (the columns before it are padding in every row: skipping
        # them changes no real token's attention, only, possibly, its rounding).
        lo = 0 if self.invariant else int(self.pos_offset.min())
        cols = torch.arange(lo, length, device=cond.device)
        positions = (cols[None, :] - self.pos_offset[:, None]).clamp(min=0)
        causal = torch.ones(length - lo, length - lo, dtype=torch.bool, device=cond.device).tril()
        attn = (causal[None] & mask[:, None, lo:]) | torch.eye(length - lo, dtype=torch.bool, device=cond.device)
        slots = cols.expand(n_rows, -1)
        hidden = self.model.forward_cached(ids[:, lo:], positions, slots, attn, self.cache, kv_start=lo)
        self.cache.lengths.fill_(length)
        self.forwards += 1
        self.prefill = (ids, F.pad(hidden, (0, 0, lo, 0)))  # a feature per column (zeros: padding not computed)
        # PJD's slot -> grid key map, made here rather than on the first grid verify: every round then
        # sees the same state (a compiled round is one graph from the first round on).
        self.slot_cell = torch.full((n_rows, self.cache.max_len), -1, dtype=torch.long, device=cond.device)
        logits = self.guided_logits(hidden[:, -1])
        # contiguous: the prefix's strides would follow the batch's prompts (a compiled drafter
        # prefill would recompile on them)
        return logits, hidden[:, hidden.shape[1] - p :].contiguous()

    def guided_logits(self, hidden: Tensor) -> Tensor:
        """hidden [S*B, ..., D] of both streams -> guided code logits [B, ..., V]: CFG of the raw code
        logits. (Emu3 overrides this: transformers guides its log-softmax over the whole vocabulary.)"""
        return apply_cfg(self.model.image_logits(hidden), self.sampling.cfg_scale, self.streams)

    def _given(self, guidance: tuple[Tensor, Tensor], batch: int) -> tuple[Tensor, Tensor]:
        """Guidance rows given per row, left-padded to the prompt width like the prompts (padding is
        masked: no position, never attended, so the width changes no value)."""
        ids, mask = guidance
        check(ids.dim() == 2 and ids.shape[0] == batch and tuple(mask.shape) == tuple(ids.shape),
              f"guidance rows: expected ids and a mask of [{batch}, L], got {tuple(ids.shape)} and {tuple(mask.shape)}")
        check(int(ids.shape[1]) <= self.prompt_width,
              f"guidance rows of {int(ids.shape[1])} columns are wider than --prompt-width {self.prompt_width}")
        extra = self.prompt_width - int(ids.shape[1])
        return F.pad(ids, (extra, 0)), F.pad(mask.bool(), (extra, 0), value=False)

    def guidance_rows(self, cond: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        """CFG's unconditional rows for prompt contexts cond [B, L] (mask [B, L]): the layout's
        guidance context, left-padded to L. (Janus overrides this: its prompt with pad tokens.)"""
        b, length = cond.shape
        uncond = torch.tensor(self.layout.uncond, device=cond.device)
        check(len(uncond) <= length, "prompt contexts are shorter than the guidance context")
        u_ids = torch.zeros(b, length, dtype=torch.long, device=cond.device)
        u_ids[:, length - len(uncond) :] = uncond
        u_mask = torch.zeros(b, length, dtype=torch.bool, device=cond.device)
        u_mask[:, length - len(uncond) :] = True
        return u_ids, u_mask

    @torch.no_grad()
    def verify(self, tokens: Tensor, tree_mask: Tensor, depth: Tensor, tree: TreeBuffers | None = None
               ) -> tuple[Tensor, Tensor]:
        """One forward over each row's tree of codes (node 0 = the pending root), with end-of-row
        tokens inserted as shadow nodes. ``tree``: the tree's buffers, whose static sizes (the most
        nodes at one depth, the depth levels) bound the shadows a static forward makes room for
        (None: T). Returns (guided logits [B, T, V], hidden [S*B, T, D])."""
        cache = self._cache()
        assert self.root_index is not None and self.pos_offset is not None
        s, (b, t) = self.streams, tokens.shape
        if t > self.max_tree_nodes:
            raise LanternError(f"tree of {t} nodes exceeds the {self.max_tree_nodes} the cache was sized for")
        ids = self.model.code_to_bpe(tokens)
        mask, model_depth = tree_mask, depth
        row_end = torch.zeros(b, t, dtype=torch.bool, device=tokens.device)
        if self.layout.eol is not None:
            row_end = (self.root_index[:, None] + depth + 1) % self.layout.width == 0
        per_depth, levels = (t, t) if tree is None else (tree.widest, tree.max_depth + 1)
        e, kv_start, kv_end = self._window(row_end, per_depth, levels)
        read_at = torch.arange(t, device=tokens.device).expand(b, -1)
        shadow_slot = torch.full((b, t), -1, dtype=torch.long, device=tokens.device)
        if e > 0:
            assert self.layout.eol is not None  # (row ends, hence shadows, only where the layout has EOL tokens)
            ids, mask, model_depth, shadow_slot = _expand_row_ends(ids, tree_mask, depth, row_end, e, self.layout.eol)
            read_at = torch.where(row_end, shadow_slot, read_at)
        self._shadows = (row_end, shadow_slot)
        n = ids.shape[1]
        lengths = cache.lengths  # [S*B]
        slots = lengths[:, None] + torch.arange(n, device=tokens.device)
        positions = lengths[:, None] - self.pos_offset[:, None] + model_depth.repeat(s, 1)
        attn = self._verify_mask(mask.repeat(s, 1, 1), lengths, n, kv_end)[:, :, kv_start:]
        hidden = self.model.forward_cached(ids.repeat(s, 1), positions, slots, attn, cache, kv_start)
        self.forwards += 1
        self.node_hidden = hidden[:, :t]
        idx = read_at.repeat(s, 1)[:, :, None].expand(-1, -1, hidden.shape[-1])
        hidden = hidden.gather(1, idx)  # [S*B, T, D]: the state that predicts each node's children
        logits = self.guided_logits(hidden)
        return logits, hidden

    def commit(self, path: Tensor, num_keep: Tensor, in_order: bool = False) -> None:
        """Keep tree nodes ``path[:, :num_keep]`` (root first), each with its end-of-row shadow
        (``in_order``: ``Target.commit``'s; it holds here only without new-line shadows)."""
        cache = self._cache()
        assert self.root_index is not None and self._shadows is not None
        row_end, shadow_slot = self._shadows
        keep, count = path, num_keep
        if self.layout.eol is not None and (self.static or bool(row_end.any())):
            keep, count, in_order = *_with_shadows(path, num_keep, row_end, shadow_slot), False
        cache.commit(keep.repeat(self.streams, 1), count.repeat(self.streams), in_order)
        self.root_index.add_(num_keep)  # in place: read by the next round (CUDA graphs replay on its address)
        self.last_path = path  # (like _shadows and node_hidden: made and read within one round)

    @torch.no_grad()
    def verify_grid(self, tokens: Tensor, cells: Tensor, rows: Tensor, chains: int | None = None) -> Tensor:
        """PJD's forward (``lantern.decoding.pjd``): codes [B, T] at image cells, in windows ``rows`` (-1 =
        padding). Lumina-mGPT's new-line tokens: a node at a row's last cell (a chain root: a
        stand-in or a flushed row end) gets a shadow carrying the new-line token one position
        later, in its own window, and its logits are read there (as :meth:`verify` does). In the
        mask, cells are doubled so a new-line token sits between its row's last cell and the next
        row's first. ``chains``: windows per row (at most T), which bound the shadows a compiled
        forward makes room for. Returns guided logits [B, T, V]."""
        cache = self._cache()
        assert self.pos_offset is not None and self.key_mask is not None
        s, (b, t), width = self.streams, tokens.shape, self.layout.width
        ids, keys, model_rows = self.model.code_to_bpe(tokens), 2 * cells, rows
        positions = self.key_mask.shape[1] + cells + (cells // width if self.layout.eol is not None else 0)
        read_at = torch.arange(t, device=tokens.device).expand(b, -1)
        row_end = (rows >= 0) & (cells % width == width - 1) & (self.layout.eol is not None)
        chains = chains or t
        e, kv_start, kv_end = self._window(row_end, chains, t // chains)  # a chain's cells: one per depth
        owner = torch.argsort((~row_end).to(torch.int8), dim=1, stable=True)[:, :e]  # [B, E]
        valid = torch.arange(e, device=tokens.device)[None, :] < row_end.sum(1, keepdim=True)
        if e > 0:
            assert self.layout.eol is not None
            ids = torch.cat([ids, torch.full_like(owner, self.layout.eol)], dim=1)
            keys = torch.cat([keys, keys.gather(1, owner) + 1], dim=1)
            model_rows = torch.cat([rows, torch.where(valid, rows.gather(1, owner), -1)], dim=1)
            positions = torch.cat([positions, positions.gather(1, owner) + 1], dim=1)
            shadow = t + torch.arange(e, device=tokens.device).expand(b, -1)
            read_at = read_at.scatter(1, owner, torch.where(valid, shadow, owner))
        assert self.slot_cell is not None
        keys_s, lengths, n = keys.repeat(s, 1), cache.lengths, ids.shape[1]
        mask = grid_verify_mask(self.slot_cell, lengths, keys_s, model_rows.repeat(s, 1), kv_end)
        prompt = self.key_mask.shape[1]
        mask[:, :, :prompt] &= self.key_mask[:, None, :]  # left padding is never attended
        slots = lengths[:, None] + torch.arange(n, device=tokens.device)
        hidden = self.model.forward_cached(ids.repeat(s, 1), positions.repeat(s, 1) - self.pos_offset[:, None],
                                           slots, mask[:, :, kv_start:], cache, kv_start)
        self.forwards += 1
        self._grid = (keys_s, owner, valid)
        idx = read_at.repeat(s, 1)[:, :, None].expand(-1, -1, hidden.shape[-1])
        return self.guided_logits(hidden.gather(1, idx))

    def commit_grid(self, keep: Tensor, num_keep: Tensor) -> None:
        """Keep block nodes ``keep[:, :num_keep]`` of the last grid block, each with its new-line
        shadow, recording their grid keys in ``slot_cell``."""
        cache = self._cache()
        assert self._grid is not None and self.slot_cell is not None
        keys_s, owner, valid = self._grid
        b, e = owner.shape
        t = keys_s.shape[1] - e
        kept = torch.zeros(b, t + 1, dtype=torch.bool, device=keep.device)
        j = torch.arange(keep.shape[1], device=keep.device)[None, :]
        kept.scatter_(1, torch.where(j < num_keep[:, None], keep, t), True)  # column t: padding
        kept = torch.cat([kept[:, :t], valid & kept.gather(1, owner)], dim=1)
        offsets, count = kept_offsets(kept)
        offsets_s, count_s = offsets.repeat(self.streams, 1), count.repeat(self.streams)
        commit_cells(self.slot_cell, cache.lengths, keys_s, offsets_s, count_s)
        cache.commit(offsets_s, count_s)

    # -- helpers ----------------------------------------------------------------------------------

    def _cache_len(self, context: int) -> int:
        # batch-invariant attention: a whole number of the kernel's key blocks, whatever the tree
        return round_up(context + self._max_model_tokens() + 2 * self.max_tree_nodes + 1, key_granule(self.model))

    def cache_bytes(self, batch: int) -> int:
        """Bytes of the key/value cache :meth:`start` allocates for ``batch`` prompts (each padded
        to the prompt width)."""
        m = self.model
        return KVCache.nbytes(m.config.num_hidden_layers, batch * self.streams, m.kv_heads,
                              self._cache_len(self.prompt_width), m.head_dim, m.dtype)

    def row_tensors(self) -> list[tuple[Tensor | None, int, int]]:
        """Per-row state (``lantern.decoding.rows``): the cache, the prompt mask and padding, the
        root's code index, PJD's slot map. Rows of one prompt width have the same shapes, so a row
        prefilled alone can join a running batch."""
        s = self.streams
        return [*self._cache().row_tensors(s), (self.key_mask, s, 0), (self.pos_offset, s, 0),
                (self.root_index, 1, 0), (self.slot_cell, s, 0)]

    def _max_model_tokens(self) -> int:
        extra = self.layout.height if self.layout.eol is not None else 0
        return self.layout.num_tokens + extra

    def _cache(self) -> KVCache:
        if self.cache is None:
            raise RuntimeError("ChameleonTarget.start() must be called before verify/commit")
        return self.cache

    def _window(self, row_end: Tensor, per_depth: int, levels: int) -> tuple[int, int, int]:
        """(new-line shadows per row, first key column, key columns' end) of a forward over
        ``row_end``'s T nodes and their shadows.

        Static: the most shadows a forward can have over the whole cache, so nothing is read and
        no shape follows the batch. Nodes span ``levels`` depths with at most ``per_depth`` at
        each; a row ends where root index + depth + 1 is a multiple of ``width``, so at most
        ceil(levels / width) depths can hold row ends. Eager: one host read of the most row ends a row has,
        the longest row and the least left padding (the columns before it are padding in every
        row), so the forward spans the batch's real columns only."""
        t = row_end.shape[1]
        cache = self._cache()
        if self.static:
            e = 0 if self.layout.eol is None else new_line_slots(t, per_depth, levels, self.layout.width)
            return e, 0, cache.max_len
        assert self.pos_offset is not None
        ends = row_end.sum(1).max() if self.layout.eol is not None else torch.zeros_like(cache.lengths[0])
        e, longest, lo = torch.stack([ends, cache.lengths.max(), self.pos_offset.min()]).tolist()
        return e, lo, longest + t + e

    def _verify_mask(self, tree_mask: Tensor, lengths: Tensor, t: int, kv_len: int) -> Tensor:
        """[S*B, T, kv_len] bool: the row's real prefix columns, then its tree mask at its slots."""
        assert self.key_mask is not None
        cols = torch.arange(kv_len, device=lengths.device)
        rel = cols[None, :] - lengths[:, None]
        prefix = rel < 0
        prompt = self.key_mask.shape[1]
        prefix[:, :prompt] &= self.key_mask  # left padding is never attended
        in_tree = (rel >= 0) & (rel < t)
        idx = rel.clamp(0, t - 1)[:, None, :].expand(-1, t, -1)
        tree = torch.gather(tree_mask, 2, idx) & in_tree[:, None, :]
        return prefix[:, None, :] | tree


def _expand_row_ends(
    ids: Tensor,  # [B, T] BPE ids of the nodes
    tree_mask: Tensor,  # [B, T, T] ancestors and self
    depth: Tensor,  # [B, T]
    row_end: Tensor,  # [B, T] nodes whose code ends an image row
    e: int,  # shadow slots per row (max number of row-end nodes)
    eol: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Append a new-line shadow after every row-end node: (ids, mask, depth) over T + e model nodes,
    and each node's shadow index (-1 for none). Rows with fewer row-end nodes get padding shadows
    that attend only to themselves and are never kept."""
    b, t = ids.shape
    device = ids.device
    # owner[b, j]: the node whose shadow sits at T + j (row-end nodes in node order), valid[b, j].
    owner = torch.argsort((~row_end).to(torch.int8), dim=1, stable=True)[:, :e]
    valid = torch.arange(e, device=device)[None, :] < row_end.sum(1, keepdim=True)
    rank = row_end.long().cumsum(1) - 1
    shadow_slot = torch.where(row_end, t + rank, torch.full_like(rank, -1))

    eye_t = torch.eye(t, dtype=torch.bool, device=device)
    owner_cols = owner[:, None, :].expand(-1, t, -1)  # [B, T, E]
    # node i sees shadow j when owner(j) is a strict ancestor of i
    node_to_shadow = tree_mask.gather(2, owner_cols) & ~eye_t[owner].transpose(1, 2) & valid[:, None, :]
    shadow_rows = tree_mask.gather(1, owner[:, :, None].expand(-1, -1, t))  # [B, E, T] owner's ancestors + owner
    shadow_to_node = shadow_rows & valid[:, :, None]
    both_valid = valid[:, :, None] & valid[:, None, :]
    shadow_to_shadow = shadow_rows.gather(2, owner[:, None, :].expand(-1, e, -1)) & both_valid
    shadow_to_shadow |= torch.eye(e, dtype=torch.bool, device=device)  # padding shadows attend to themselves
    mask = torch.cat(
        [torch.cat([tree_mask, node_to_shadow], dim=2), torch.cat([shadow_to_node, shadow_to_shadow], dim=2)], dim=1
    )
    # a node's model depth counts the new-line tokens on its path (shadows of strict ancestors)
    inserted = (tree_mask & ~eye_t & row_end[:, None, :]).sum(-1)
    node_depth = depth + inserted
    shadow_depth = torch.where(valid, node_depth.gather(1, owner) + 1, 0)
    out_ids = torch.cat([ids, torch.full((b, e), eol, dtype=ids.dtype, device=device)], dim=1)
    return out_ids, mask, torch.cat([node_depth, shadow_depth], dim=1), shadow_slot


def _with_shadows(path: Tensor, num_keep: Tensor, row_end: Tensor, shadow_slot: Tensor) -> tuple[Tensor, Tensor]:
    """Model-node offsets to keep: each kept path node followed by its shadow when it has one."""
    b, w = path.shape
    j = torch.arange(w, device=path.device)[None, :]
    kept = (j < num_keep[:, None]) & (path >= 0)
    node = path.clamp(min=0)
    has_shadow = row_end.gather(1, node) & kept
    pairs = torch.stack([torch.where(kept, node, -1), torch.where(has_shadow, shadow_slot.gather(1, node), -1)], dim=2)
    flat = pairs.reshape(b, 2 * w)
    order = torch.argsort((flat < 0).to(torch.int8), dim=1, stable=True)  # valid entries first, in order
    keep = flat.gather(1, order)
    return keep, num_keep + has_shadow.sum(1)


# ----------------------------------------------------------------------------------------------
# Stacks and runs: a Chameleon model folder + the VQGAN + optional drafter / proximity table
