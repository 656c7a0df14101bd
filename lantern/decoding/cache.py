"""Static, preallocated KV cache with per-row lengths and an in-place ``commit``.

Layout: ``k``/``v`` are [n_layer, N, H, S_max, Dh] where N counts model rows (with guidance the
adapter doubles B rows into ``[cond; uncond]``). Each row has its own committed length: the rows
of a batch accept different numbers of draft tokens per step and so drift apart.

A verification forward writes its T tree nodes at slots ``[len, len + T)`` of each row (the
model's ``forward`` takes the slots explicitly); ``commit`` then keeps the chosen subset of those
fresh slots (the accepted path) by moving them to ``[len, len + a)`` and advancing the length, as
EAGLE's ``KVCache.copy`` does. Slots past a row's length are garbage and must be masked out by the
caller's attention mask.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from lantern.decoding.resident import Residents


class KVCache:
    def __init__(
        self,
        n_layer: int,
        rows: int,
        n_head: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (n_layer, rows, n_head, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.lengths = torch.zeros(rows, dtype=torch.long, device=device)  # [N]
        self.max_len = max_len
        self._layer_ids = torch.arange(n_layer, device=device)  # [L] advanced index of each layer

    @staticmethod
    def nbytes(n_layer: int, rows: int, n_head: int, max_len: int, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes of ``k`` and ``v`` for these sizes: what the constructor allocates (checked first)."""
        return 2 * n_layer * rows * n_head * max_len * head_dim * dtype.itemsize

    @property
    def rows(self) -> int:
        return self.k.shape[1]

    def write(self, layer: int, slots: Tensor, k: Tensor, v: Tensor) -> None:
        """Store k/v [N, H, T, Dh] at per-row slots [N, T]."""
        rows = torch.arange(k.shape[0], device=k.device)[:, None]  # [N, 1]
        # One index_put_ on the whole buffer, the layer an advanced index too (not ``self.k[layer]``):
        # a compiled graph then writes in place instead of copying the cache back after a view write.
        # Advanced indices around a slice put the indexed dims first: the target is [N, T, H, Dh].
        index = (self._layer_ids[layer : layer + 1], rows, slice(None), slots)
        self.k[index] = k.transpose(1, 2).to(self.k.dtype)
        self.v[index] = v.transpose(1, 2).to(self.v.dtype)

    def read(self, layer: int, kv_len: int, start: int = 0) -> tuple[Tensor, Tensor]:
        """Keys and values of slots ``start`` .. ``kv_len - 1``: [N, H, kv_len - start, Dh] each."""
        return self.k[layer, :, :, start:kv_len], self.v[layer, :, :, start:kv_len]

    def commit(self, keep: Tensor, num_keep: Tensor, in_order: bool = False) -> None:
        """Keep fresh slots ``lengths + keep[:, j]`` (j < num_keep) at ``lengths + j``; advance.
        ``in_order``: the caller knows ``keep[:, j] == j`` (a chain's path): only the lengths move.

        keep: [N, A] offsets relative to each row's length (e.g. the accepted tree path, root
        first), -1 padded; num_keep: [N]. Offsets must be >= their destination (j), which holds for
        tree paths because a node's index is never smaller than its depth.
        """
        n, a = keep.shape
        if a == 0:
            return
        if in_order:
            self.lengths += num_keep
            return
        j = torch.arange(a, device=keep.device)[None, :]  # [1, A]
        valid = j < num_keep[:, None]  # [N, A]
        dst = self.lengths[:, None] + j  # [N, A]
        src = torch.where(valid, self.lengths[:, None] + keep.clamp(min=0), dst)
        rows = torch.arange(n, device=keep.device)[:, None]
        # Gather first (advanced indexing copies), then scatter: overlapping moves stay correct.
        for buf in (self.k, self.v):
            moved = buf[:, rows, :, src]  # [N, A, L, H, Dh] (indexed dims first)
            buf[:, rows, :, dst] = moved
        self.lengths += num_keep

    def reset(self) -> None:
        self.lengths.zero_()

    def row_tensors(self, streams: int) -> list[tuple[Tensor | None, int, int]]:
        """Per-row state (``lantern.decoding.rows``): keys and values (rows on axis 1), lengths."""
        return [(self.k, streams, 1), (self.v, streams, 1), (self.lengths, streams, 0)]


class CachePool:
    """KV caches kept across images, one per (owner, shape): the same buffers every image, as
    gpt-fast's idempotent ``setup_caches`` (CUDA graphs replay on fixed addresses; no allocation
    per image). A reused cache is reset (lengths 0); its stale slots are masked like any others.
    ``residents``: the rest of a decode's state, kept at fixed addresses by
    :func:`lantern.decoding.resident.keep_resident`."""

    def __init__(self) -> None:
        self._caches: dict[tuple[object, ...], KVCache] = {}
        self._buffers: dict[tuple[object, ...], Tensor] = {}
        self.residents: dict[object, Residents] = {}

    def buffer(
        self, owner: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str, static: bool = False
    ) -> Tensor:
        """A zeroed work buffer of this shape, the same tensor every time it is asked for."""
        key = (owner, shape, dtype, str(device))
        buf = self._buffers.get(key)
        if buf is None:
            buf = torch.zeros(shape, dtype=dtype, device=device)
            if static:
                from lantern.decoding.compiling import mark_static

                mark_static(buf)
            self._buffers[key] = buf
        return buf.zero_()

    def get(
        self,
        owner: str,
        n_layer: int,
        rows: int,
        n_head: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        static: bool = False,
    ) -> KVCache:
        """A reset cache of this shape; ``static``: mark its buffers' addresses static for dynamo."""
        key = (owner, n_layer, rows, n_head, max_len, head_dim, dtype, str(device))
        cache = self._caches.get(key)
        if cache is None:
            cache = KVCache(n_layer, rows, n_head, max_len, head_dim, dtype, device)
            if static:
                from lantern.decoding.compiling import mark_static

                mark_static(cache.k, cache.v, cache.lengths)
            self._caches[key] = cache
        cache.reset()
        return cache
