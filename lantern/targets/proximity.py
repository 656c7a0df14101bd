"""Latent proximity table: each visual token's nearest other tokens in the VQ codebook ([LANTERN], [LANTERN code]).

LANTERN's relaxed acceptance credits a drafted token with the target mass of its latent
neighbours ([LANTERN]), so it needs, for every token, the other tokens in order of codebook
distance. The official code stores the full V×(V-1) uint16 argsort (512 MiB for V = 16384) at a
hard-coded path. We store only the ``K_max`` nearest as int32, built in chunks so a V×V matrix is
never held, in one safetensors file whose header records what it was built from:

* ``codebook_sha256``: sha256 of the *raw* codebook (``quantize.embedding.weight``) as float32
  little-endian contiguous bytes, checked against the tokenizer when the table is loaded;
* ``table_sha256``: sha256 of the table itself (int32 little-endian contiguous bytes), checked
  when the file is loaded. The codebook hash says what a table was built *for*; only this one
  says the rows were not changed since (the distance-order check below samples 64 rows, so a
  rewrite of the others would pass it). A table without it (written before this entry existed,
  or with it deleted) has every row's distance order checked instead, which costs what building
  the table costs (V x V distances, in chunks);
* ``metric`` (``l2`` as the official code, or ``cosine``) and ``normalized`` (whether rows were
  L2-normalised first, as the decoder sees them; False reproduces the official numbers).

Column 0 is the nearest *other* token: a token is excluded from its own row by index, even when
another entry has an identical vector (distance 0). Ties are broken by the smaller index, so the
table is deterministic.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from lantern.decoding.acceptance import check_k
from lantern.errors import LanternError, check
from lantern.io import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    atomic_path,
    load_checkpoint,
    read_json_object,
    read_safetensors,
    save_safetensors,
)

Metric = Literal["l2", "cosine"]
FORMAT = "lantern-proximity"
FORMAT_VERSION = "1"
TENSOR_NAME = "neighbours"
CODEBOOK_KEY = "quantize.embedding.weight"
VQ_MODEL_TYPE = "lantern-vq"
SAMPLE_ROWS = 64  # rows whose distance order is checked against the codebook when a table is used
CHECK_CHUNK = 1024  # rows whose distances to the codebook are held at once by the distance-order check


def codebook_sha256(codebook: Tensor) -> str:
    """sha256 of the raw codebook [V, C] as float32 little-endian contiguous bytes."""
    array = codebook.detach().to(device="cpu", dtype=torch.float32).contiguous().numpy()
    return hashlib.sha256(array.astype("<f4", copy=False).tobytes()).hexdigest()


def table_sha256(neighbours: Tensor) -> str:
    """sha256 of a neighbour table [V, K] as int32 little-endian contiguous bytes."""
    array = neighbours.detach().to(device="cpu", dtype=torch.int32).contiguous().numpy()
    return hashlib.sha256(array.astype("<i4", copy=False).tobytes()).hexdigest()


@dataclass(frozen=True)
class ProximityTable:
    """``neighbours[i, j]``: the j-th nearest other token to token i (distance order)."""

    neighbours: Tensor  # [V, K_max] int32
    codebook_sha256: str
    metric: str
    normalized: bool
    source: str = field(default="proximity table", compare=False)  # for messages: "proximity table FILE"
    # Whether its rows are vouched for by a table_sha256 (checked when the file was read; a table
    # built in this process is too): if not, validate checks every row instead of a sample.
    hashed: bool = field(default=True, compare=False)

    @property
    def k_max(self) -> int:
        return int(self.neighbours.shape[1])

    @property
    def vocab_size(self) -> int:
        return int(self.neighbours.shape[0])

    def check_k(self, k: int) -> None:
        """LanternError if the relaxation asks for more neighbours than the table holds."""
        check_k(k, self.k_max)

    def neighbours_for(self, k: int) -> Tensor:
        """[V, k] int64 copy of the k nearest neighbours (acceptance also takes the int32 table)."""
        self.check_k(k)
        return self.neighbours[:, :k].long()

    def validate(self, codebook: Tensor) -> None:
        """LanternError unless the table was built from exactly this raw codebook [V, C]: the hash
        recorded in its header, and (as the header can be copied onto a tampered table) the
        neighbours themselves (:meth:`check_distance_order`): on a fixed sample of rows, or on every
        row of a table no table_sha256 vouches for."""
        v = int(codebook.shape[0])
        check(
            v == self.vocab_size,
            f"{self.source} has {self.vocab_size} tokens, but the tokenizer's codebook has {v}",
        )
        actual = codebook_sha256(codebook)
        check(
            actual == self.codebook_sha256,
            f"{self.source} was built for codebook sha256 {self.codebook_sha256}, but the "
            f"tokenizer's codebook has {actual}; rebuild it with `lantern build-proximity`",
        )
        self.check_distance_order(codebook, SAMPLE_ROWS if self.hashed else self.vocab_size)

    def check_indices(self) -> None:
        """LanternError unless every entry is another token's index (in [0, V), never the row's own)."""
        v, nbr = self.vocab_size, self.neighbours
        check(not nbr.is_floating_point() and not nbr.is_complex(),
              f"{self.source} holds {nbr.dtype} values, expected integer token indices")
        lo, hi = int(nbr.min()), int(nbr.max())
        check(0 <= lo and hi < v, f"{self.source} holds token indices in [{lo}, {hi}], expected [0, {v - 1}]")
        own = (nbr == torch.arange(v, dtype=nbr.dtype)[:, None]).any(dim=1)  # [V]
        if bool(own.any()):
            raise LanternError(f"{self.source} lists token {int(own.nonzero()[0, 0])} as its own neighbour (a token "
                               "is never its own neighbour); rebuild it with `lantern build-proximity`")

    def check_distance_order(self, codebook: Tensor, rows: int = SAMPLE_ROWS) -> None:
        """LanternError unless, on ``rows`` evenly spaced rows (V: all of them), the listed
        neighbours are the K_max nearest other codebook entries in distance order (compared by
        distance, so ties may list either of two equally near tokens). Costs ``rows`` x V
        distances, :data:`CHECK_CHUNK` rows at a time."""
        sample = torch.linspace(0, self.vocab_size - 1, min(rows, self.vocab_size)).round().long().unique()
        e = _prepare(codebook, self.metric, self.normalized)  # type: ignore[arg-type]
        for chunk in sample.split(CHECK_CHUNK):
            d = torch.cdist(e[chunk], e, compute_mode="donot_use_mm_for_euclid_dist")  # [S, V]
            d[torch.arange(len(chunk)), chunk] = float("inf")
            listed = d.gather(1, self.neighbours[chunk].long())  # [S, K]
            nearest = d.topk(self.k_max, dim=1, largest=False).values  # [S, K] ascending
            ok = torch.isclose(listed, nearest, rtol=1e-6, atol=1e-9).all(dim=1)  # [S]
            if not bool(ok.all()):
                raise LanternError(f"{self.source}: token {int(chunk[~ok][0])}'s neighbours are not its nearest "
                                   f"codebook entries in distance order ({self.metric}); rebuild it with "
                                   "`lantern build-proximity`")

    def metadata(self) -> dict[str, str]:
        return {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "codebook_sha256": self.codebook_sha256,
            "table_sha256": table_sha256(self.neighbours),
            "metric": self.metric,
            "normalized": str(self.normalized).lower(),
            "k_max": str(self.k_max),
            "vocab_size": str(self.vocab_size),
        }

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write one safetensors file (metadata in its header), atomically."""
        path = Path(path)
        tensor = self.neighbours.detach().to(device="cpu", dtype=torch.int32).contiguous()
        with atomic_path(path) as tmp:
            save_safetensors({TENSOR_NAME: tensor}, tmp, metadata=self.metadata())
        return path

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> ProximityTable:
        """Read a file written by :meth:`save`; LanternError if missing or not a proximity table."""
        path = Path(path)
        check(path.is_file(), f"proximity table not found: {path}")
        tensors, meta = read_safetensors(path, "proximity table", [TENSOR_NAME])
        tensor = tensors.get(TENSOR_NAME)
        check(
            meta.get("format") == FORMAT and tensor is not None,
            f"{path} is not a lantern proximity table (build one with `lantern build-proximity`)",
        )
        assert tensor is not None
        check(tensor.dim() == 2 and tensor.numel() > 0,
              f"proximity table {path} holds a {tuple(tensor.shape)} tensor, expected [V, K] with V, K >= 1")
        metric = meta.get("metric", "l2")
        check(metric in ("l2", "cosine"), f"proximity table {path}: metric must be l2 or cosine, got {metric!r}")
        recorded = meta.get("table_sha256")
        table = cls(tensor, meta.get("codebook_sha256", ""), metric, meta.get("normalized") == "true",
                    source=f"proximity table {path}", hashed=recorded is not None)
        if recorded is not None:  # absent in tables written before it was recorded: validate checks every row
            check(recorded == table_sha256(tensor),
                  f"proximity table {path}: its neighbours do not match the table_sha256 in its header (the file "
                  "was changed after it was built); rebuild it with `lantern build-proximity`")
        table.check_indices()
        return table


# ---- building ---------------------------------------------------------------------------------


def _prepare(codebook: Tensor, metric: Metric, normalize: bool) -> Tensor:
    """float64 codebook [V, C]; L2-normalised when asked, or for cosine (which ranks unit vectors
    by Euclidean distance: the same order as 1 - cos, computed without a matrix product)."""
    e = codebook.detach().to(device="cpu", dtype=torch.float64)
    return F.normalize(e, dim=-1) if normalize or metric == "cosine" else e


def _chunk_distances(e: Tensor, start: int, stop: int) -> Tensor:
    """[stop-start, V] Euclidean distances from rows start..stop to every entry, +inf on the
    diagonal. Direct differences (not |a|^2 + |b|^2 - 2ab), so identical vectors are exactly 0
    apart and tie with each other; for unit vectors ½·d² = 1 - cos, the cosine order."""
    d = torch.cdist(e[start:stop], e, compute_mode="donot_use_mm_for_euclid_dist")  # [n, V]
    own = torch.arange(start, stop)
    d[own - start, own] = float("inf")  # self excluded by index, duplicates kept
    return d


def _nearest(d: Tensor, k: int) -> Tensor:
    """[n, k] indices of the k smallest entries per row, ordered by (distance, index)."""
    values, idx = torch.topk(d, k, dim=1, largest=False, sorted=False)  # [n, k]
    by_index = idx.argsort(dim=1)
    values, idx = values.gather(1, by_index), idx.gather(1, by_index)
    order = values.argsort(dim=1, stable=True)  # distance, then index among equal distances
    idx = idx.gather(1, order)
    # topk may pick any of several entries tied at the k-th distance; redo those rows exactly.
    kth = values.gather(1, order[:, -1:])  # [n, 1]
    tied = (d <= kth).sum(1) > k  # [n]
    if bool(tied.any()):
        idx[tied] = d[tied].argsort(dim=1, stable=True)[:, :k]
    return idx


def build_proximity(
    codebook: Tensor,  # [V, C] raw codebook (quantize.embedding.weight)
    k_max: int,
    metric: Metric = "l2",
    normalize: bool = False,
    chunk_size: int = 1024,
    progress: bool = False,
) -> ProximityTable:
    """The ``k_max`` nearest other entries of every codebook row, nearest first ([LANTERN code] generate_codebook.py).

    Works on ``chunk_size`` rows at a time (peak memory ~ a few chunk×V float64 matrices) and
    computes in float64 so the ranking does not depend on summation order. ``normalize`` ranks
    the L2-normalised vectors the decoder uses; the official table used the raw ones (False).
    """
    check(codebook.dim() == 2, f"codebook must be [V, C], got {tuple(codebook.shape)}")
    v = int(codebook.shape[0])
    check(metric in ("l2", "cosine"), f"proximity metric must be 'l2' or 'cosine', got {metric!r}")
    check(isinstance(k_max, int) and 1 <= k_max < v, f"k_max must be in [1, V-1 = {v - 1}], got {k_max}")
    check(chunk_size >= 1, f"chunk_size must be >= 1, got {chunk_size}")
    check(bool(torch.isfinite(codebook).all()), "codebook contains NaN or infinite values")
    e = _prepare(codebook, metric, normalize)
    out = torch.empty(v, k_max, dtype=torch.int32)
    starts = range(0, v, chunk_size)
    if progress and len(starts) > 1:  # one chunk (the presets' 1024 codes) is done at once: no bar
        from tqdm.auto import tqdm

        starts = tqdm(starts, desc="proximity", unit="chunk")
    for start in starts:
        stop = min(start + chunk_size, v)
        out[start:stop] = _nearest(_chunk_distances(e, start, stop), k_max).to(torch.int32)
    return ProximityTable(out, codebook_sha256(codebook), metric, normalize)


# ---- from a tokenizer to a file ----------------------------------------------------------------


def _codebook_from_folder(folder: Path) -> Tensor:
    config = read_json_object(folder / CONFIG_NAME, "tokenizer config")
    model_type = config.get("model_type")
    if model_type == "emu3":  # an Emu3 model folder: its VQ-VAE's codebook, read alone
        from lantern.models.emu3 import read_codebook

        return read_codebook(folder)
    if model_type == "janus":  # a Janus / Janus-Pro model folder: its VQ model's codebook, read alone
        from lantern.models.janus import CODEBOOK_KEY as JANUS_KEY
        from lantern.models.janus import codebook_file

        weights = codebook_file(folder)
        tensors, _ = read_safetensors(weights, "Janus weights", [JANUS_KEY])
        check(JANUS_KEY in tensors, f"{weights} has no {JANUS_KEY!r}")
        return tensors[JANUS_KEY]
    check(model_type == VQ_MODEL_TYPE, f"{folder} holds model_type {model_type!r}, not a {VQ_MODEL_TYPE!r} tokenizer")
    weights = folder / WEIGHTS_NAME
    check(weights.is_file(), f"tokenizer folder {folder} has no {WEIGHTS_NAME}")
    tensors, _ = read_safetensors(weights, "tokenizer weights", [CODEBOOK_KEY])
    check(CODEBOOK_KEY in tensors, f"{weights} has no {CODEBOOK_KEY!r}")
    return tensors[CODEBOOK_KEY]


def _codebook_from_checkpoint(path: Path, trust_checkpoint: bool | None = None) -> Tensor:
    obj = load_checkpoint(path, "VQ checkpoint", trust=trust_checkpoint)
    check(isinstance(obj, dict), f"VQ checkpoint {path} is a {type(obj).__name__}, expected a dict")
    for name in ("model", "state_dict"):
        if isinstance(obj.get(name), dict):
            obj = obj[name]
            break
    weight = obj.get(CODEBOOK_KEY)
    check(isinstance(weight, Tensor), f"VQ checkpoint {path} has no {CODEBOOK_KEY!r} tensor")
    return weight


def codebook_from_tokenizer(path: str | os.PathLike[str], *, trust_checkpoint: bool | None = None) -> Tensor:
    """The raw codebook [V, C] of a tokenizer: a model folder (``model_type`` lantern-vq, or a Janus
    or Emu3 model folder: its VQ model's codebook) or an official LlamaGen ``.pt`` (weights under
    ``'model'``, ``'state_dict'`` or at the top level), read by :func:`lantern.io.load_checkpoint`
    (``trust_checkpoint``: see there)."""
    path = Path(path)
    if path.is_dir():
        codebook = _codebook_from_folder(path)
    elif path.is_file():
        codebook = _codebook_from_checkpoint(path, trust_checkpoint)
    else:
        raise LanternError(f"tokenizer not found: {path} (expected a model folder or a .pt checkpoint)")
    check(codebook.dim() == 2, f"{path}: {CODEBOOK_KEY} must be [V, C], got {tuple(codebook.shape)}")
    return codebook.detach().float()


DEFAULT_K_MAX = 1024  # neighbours stored per code: LANTERN's largest k (1000) fits


def _check_out_is_not_input(out: Path, tokenizer: str | os.PathLike[str]) -> None:
    """The table may go into the tokenizer's folder (a Janus or Emu3 model folder's own
    ``proximity.safetensors``), but must not replace the tokenizer or one of its files: a codebook
    written over by its table is lost. An older table there may be replaced (``--overwrite``)."""
    source, out = Path(tokenizer).resolve(), out.resolve()
    inside = source.is_dir() and source in out.parents
    if out == source or (inside and out.exists() and not _is_table_file(out)):
        what = f"a file of --tokenizer {tokenizer}" if inside else f"--tokenizer {tokenizer}"
        raise LanternError(f"--out: {out} is {what}, which this command reads; writing it would replace that "
                           "input: choose another file")


def _is_table_file(path: Path) -> bool:
    from safetensors import safe_open

    try:
        with safe_open(str(path), "pt") as f:
            return (f.metadata() or {}).get("format") == FORMAT
    except Exception:  # not safetensors at all: not a table either
        return False


def build_proximity_file(
    tokenizer: str,
    k_max: int | None,
    out: str,
    metric: Metric = "l2",
    normalize: bool = False,
    progress: bool = False,
    overwrite: bool = False,
) -> ProximityTable:
    """Build the table for a tokenizer's codebook and write it to ``out`` atomically. An existing
    ``out`` is refused unless ``overwrite``; the location is checked before the codebook is read.
    ``k_max`` None: :data:`DEFAULT_K_MAX`, or every other code of a smaller codebook."""
    from lantern.outputs import OutputFile

    target = OutputFile.check(out, "--out", overwrite)
    _check_out_is_not_input(target.path, tokenizer)
    codebook = codebook_from_tokenizer(tokenizer)
    k = min(DEFAULT_K_MAX, codebook.shape[0] - 1) if k_max is None else k_max
    check(isinstance(k, int) and 1 <= k < codebook.shape[0],
          f"--k-max must be in 1..{codebook.shape[0] - 1} (the codebook's other entries), got {k}")
    table = build_proximity(codebook, k, metric, normalize, progress=progress)
    with target.write() as tmp:
        table.save(tmp)
    return table
