"""A decode's state at the same addresses decode after decode: what CUDA graphs replay on.

A compiled round (``lantern.decoding.compiling.round_fn``) marks every tensor of its state as a
fixed address, and under CUDA graphs a marked tensor found at another address makes torch record
the graph again. The KV caches and the drafter's feature buffer come from the pipeline's
:class:`~lantern.decoding.cache.CachePool` and keep their addresses, but much of the rest is
allocated afresh by each decode: the codes buffer, the random streams' keys and counters, the
target's slot map and forward counter, the Jacobi drafters' canvases and probabilities, the trees'
index buffers (10 of 15 state tensors for AR, 24 of 31 for coupled SJD, counted on photos).
Without this module every decode recorded its graphs again, and the recorded graphs piled up.

:func:`keep_resident` is called once per decode, before its first round, with the round's state.
It walks the state as the round's fingerprint does (the same tensors, in the same order) and
compares each tensor's *storage* with where the previous decode of the same fingerprint had it:

- a storage at the same address (a pooled cache, the acceptance's proximity table, a model
  buffer) is left alone: it is not copied, so large tables are not doubled;
- a storage that moved is allocated per decode: from then on the pool keeps one copy of it (a
  *resident*), the new decode's values are copied into it, and every state tensor on that storage
  is put back as a view of the resident with its own offset, shape and stride (views of one
  storage stay views of one storage; one tensor found twice becomes one tensor).

So the first decode of a fingerprint runs on its own tensors, the second moves its per-decode
tensors into residents (a CUDA graph is recorded once more), and every later decode replays on the
same addresses. Nothing a caller owns is ever written: residents are the pool's own tensors.

It runs eager or compiled alike (a copy of a few small tensors per decode), so the CPU tests
check the very code a GPU replays. Like the pool's caches, residents belong to one live decode per
pool and fingerprint: a second decode of the same batch size and method in the same pool resets
them, as it resets the caches (a server prefills joining rows with a pool of their own).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from lantern.decoding.compiling import Slot, round_state_key


@dataclass
class Residents:
    """What one fingerprint's state had at the last decode, and the storages the pool keeps for it."""

    addresses: list[int]  # each storage's address, in walk order
    kept: dict[int, Tensor] = field(default_factory=dict)  # storage index -> the pool's byte copy
    # The first decode's storages, held until the second decode has been compared with them: a
    # per-decode storage freed in between could be allocated again at the same address and pass
    # for a shared one (it would then be kept one decode later, at the cost of one more recording).
    first: list[torch.UntypedStorage] | None = None


def keep_resident(state: list[object], residents: dict[object, Residents]) -> None:
    """Move the state's per-decode tensors onto storages kept in ``residents`` (a pool's), in
    place: attributes of the state's objects and items of ``state`` itself are replaced."""
    slots: list[Slot] = []
    key = round_state_key(state, slots)
    storages, layout = _storages(slots)
    full_key = (key, tuple(layout))
    known = residents.get(full_key)
    if known is None:  # the first decode of this fingerprint: note where everything is
        residents[full_key] = Residents([_address(s) for s in storages], first=storages)
        return
    moved = {i for i, s in enumerate(storages) if i in known.kept or _address(s) != known.addresses[i]}
    for i in sorted(moved):
        source = storages[i]
        kept = known.kept.get(i)
        if kept is None:
            with torch.inference_mode(False):  # a plain tensor: written in or out of inference mode alike
                kept = known.kept[i] = torch.empty(source.nbytes(), dtype=torch.uint8, device=source.device)
        kept.copy_(_bytes(source))
    replaced: dict[int, Tensor] = {}  # id of a state tensor -> its view of a resident
    for (tensor, put, _), (index, _, _) in zip(slots, layout, strict=True):
        if index not in moved:
            continue
        view = replaced.get(id(tensor))
        if view is None:
            view = replaced[id(tensor)] = _view(known.kept[index], tensor)
        put(view)
    known.first = None


def _storages(slots: list[Slot]) -> tuple[list[torch.UntypedStorage], list[tuple[int, int, int]]]:
    """The distinct non-empty storages of the slots' tensors (in walk order), and for each slot its
    storage's index (-1: empty, nothing to keep), offset and storage size: two decodes whose
    tensors share storages differently are different layouts."""
    storages: list[torch.UntypedStorage] = []
    index_of: dict[tuple[str, int], int] = {}
    layout: list[tuple[int, int, int]] = []
    for tensor, _, _ in slots:
        storage = tensor.untyped_storage()
        if storage.nbytes() == 0:
            layout.append((-1, 0, 0))
            continue
        where = (str(storage.device), storage.data_ptr())
        if where not in index_of:
            index_of[where] = len(storages)
            storages.append(storage)
        layout.append((index_of[where], int(tensor.storage_offset()), storage.nbytes()))
    return storages, layout


def _address(storage: torch.UntypedStorage) -> int:
    return storage.data_ptr()


def _bytes(storage: torch.UntypedStorage) -> Tensor:
    """A storage as a flat uint8 tensor (to copy it whole)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _view(kept: Tensor, like: Tensor) -> Tensor:
    """``like``'s view (dtype, offset, shape, stride) of the resident byte copy of its storage, an
    inference tensor where ``like`` was one (dynamo guards on the difference: its dispatch keys)."""
    with torch.inference_mode(like.is_inference()):
        return torch.empty(0, dtype=like.dtype, device=like.device).set_(
            kept.untyped_storage(), like.storage_offset(), like.shape, like.stride())
