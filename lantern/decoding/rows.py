"""Moving decode rows between batches: the engine side of continuous batching.

A serving engine retires a finished row at a round boundary and fills it with a new request
(vLLM's and SGLang's continuous batching), so no request waits for its batch-mates' images. The
loop already keeps every row apart: its own committed length, random stream and cache rows, and
rows that are not ``active`` compute but write nothing. A new row is therefore made by prefilling
it in a small batch of its own (``start_decode`` on fresh adapters) and copying that batch's
per-row state into free rows of the running batch, in place: the running batch keeps its buffers'
addresses, so a compiled round (and its CUDA graphs) is reused, never recompiled. Because the
copied state is exactly what the row would hold in a batch of its own, and later rounds treat
rows independently, a row's codes do not depend on when it joined or whom it ran beside
(``tests/test_rows.py``).

Every stateful piece of a decode (the target adapter, the drafter and its backend, the random
streams, the loop's own counters) lists its per-row tensors with :meth:`RowState.row_tensors`,
each as ``(tensor, streams, axis)``: ``axis`` is the row axis, and ``streams`` is 2 when the
tensor holds classifier-free guidance's rows stream-major (``[cond rows; uncond rows]``, S * B
of them) and 1 otherwise. Pieces that do not list their state (PJD's 2-D grid drafter) cannot move
rows; :func:`movable` says so and a server runs them in static batches.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from lantern.errors import check

RowTensor = tuple[Tensor | None, int, int]  # (state, streams, row axis); None: unused by this decode


@runtime_checkable
class RowState(Protocol):
    def row_tensors(self) -> list[RowTensor]:
        """Every per-row tensor of this object's decode state, in a fixed order."""
        ...


def movable(*parts: object) -> bool:
    """Whether rows of a decode made of these parts (None: absent) can be moved between batches
    (a drafter's scoring ``backend`` must list its state too)."""
    return all(p is None or (isinstance(p, RowState) and movable(getattr(p, "backend", None))) for p in parts)


def _stream_rows(rows: Tensor, batch: int, streams: int) -> Tensor:
    """Indices of ``rows`` [k] in a stream-major tensor of ``streams * batch`` rows: [S * k]."""
    return torch.cat([rows + s * batch for s in range(streams)])


def copy_rows(dst: Sequence[RowTensor], src: Sequence[RowTensor], dst_rows: Tensor, src_rows: Tensor,
              dst_batch: int, src_batch: int) -> None:
    """Copy rows ``src_rows`` of a decode's state ``src`` into rows ``dst_rows`` of ``dst``, in place.

    dst / src: the ``row_tensors()`` lists of two decodes built the same way (same method, settings
    and model), of ``dst_batch`` and ``src_batch`` rows."""
    check(len(dst) == len(src), f"decode states differ: {len(dst)} and {len(src)} per-row tensors")
    for (d, d_streams, axis), (s, s_streams, s_axis) in zip(dst, src, strict=True):
        if d is None or s is None:
            check(d is None and s is None, "decode states differ: a per-row tensor is set in one only")
            continue
        check(d_streams == s_streams and axis == s_axis and d.shape[:axis] == s.shape[:axis]
              and d.shape[axis + 1:] == s.shape[axis + 1:],
              f"decode states differ: per-row tensor {tuple(s.shape)} does not fit {tuple(d.shape)}")
        to = _stream_rows(dst_rows, dst_batch, d_streams)
        taken = s.index_select(axis, _stream_rows(src_rows, src_batch, s_streams))
        d.index_copy_(axis, to, taken.to(d.dtype))
