"""Tests for lantern.targets.proximity: k-NN table vs brute force, ties, duplicates, files, tokenizers."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from torch import Tensor

from lantern.decoding.acceptance import relaxed_mass
from lantern.decoding.config import RelaxationConfig
from lantern.errors import LanternError
from lantern.targets.proximity import (
    ProximityTable,
    build_proximity,
    build_proximity_file,
    codebook_from_tokenizer,
    codebook_sha256,
)


def randn(*shape: int, seed: int = 0) -> Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def brute_force(codebook: Tensor, rows: list[int], k: int, metric: str = "l2") -> Tensor:
    """[len(rows), k] k nearest other entries by a full stable sort of float64 distances."""
    e = codebook.double()
    if metric == "cosine":
        e = e / e.norm(dim=-1, keepdim=True)
    out = []
    for i in rows:
        if metric == "l2":
            d = ((e - e[i]) ** 2).sum(-1).sqrt()
        else:
            d = 1.0 - (e * e[i]).sum(-1)
        d[i] = float("inf")
        out.append(torch.argsort(d, stable=True)[:k])
    return torch.stack(out)


@pytest.mark.slow
def test_full_size_build_matches_brute_force() -> None:
    """V = 16384, C = 8 (LlamaGen VQ-16), K_max = 1024: sampled rows equal brute force, and the
    build stays well within a minute on 2 CPU cores (measured ~8 s)."""
    g = torch.Generator().manual_seed(0)
    codebook = torch.randn(16384, 8, generator=g)
    start = time.perf_counter()
    table = build_proximity(codebook, 1024)
    elapsed = time.perf_counter() - start
    print(f"build_proximity V=16384 C=8 K_max=1024: {elapsed:.1f} s")
    assert table.neighbours.shape == (16384, 1024) and table.neighbours.dtype == torch.int32
    rows = torch.randint(0, 16384, (24,), generator=g).tolist() + [0, 16383]
    assert torch.equal(table.neighbours[rows].long(), brute_force(codebook, rows, 1024))
    assert elapsed < 120  # generous: a regression to O(V^2 log V) sorting would take minutes


@pytest.mark.parametrize(("metric", "normalize"), [("l2", True), ("cosine", False), ("cosine", True)])
def test_cosine_and_normalised_variants(metric: str, normalize: bool) -> None:
    """Cosine ranking (and L2 on normalised rows, the same order) match brute force."""
    g = torch.Generator().manual_seed(1)
    codebook = torch.randn(700, 8, generator=g) * torch.rand(700, 1, generator=g) * 3
    table = build_proximity(codebook, 64, metric=metric, normalize=normalize, chunk_size=128)
    rows = list(range(0, 700, 7))
    assert torch.equal(table.neighbours[rows].long(), brute_force(codebook, rows, 64, "cosine"))
    assert table.metric == metric and table.normalized == normalize
    raw = build_proximity(codebook, 64)
    assert not torch.equal(raw.neighbours, table.neighbours)  # the scales matter for raw L2


def test_duplicates_excluded_by_index_and_ties_by_index() -> None:
    """Identical vectors are 0 apart: each lists the others first, in index order, never itself."""
    g = torch.Generator().manual_seed(2)
    codebook = torch.randn(50, 4, generator=g)
    codebook[[7, 9, 30]] = codebook[3].clone()
    codebook[12] = codebook[0].clone()
    table = build_proximity(codebook, 10, chunk_size=16)
    nbr = table.neighbours.long()
    assert nbr[3, :3].tolist() == [7, 9, 30] and nbr[30, :3].tolist() == [3, 7, 9]
    assert nbr[0, 0].item() == 12 and nbr[12, 0].item() == 0
    assert all(i not in nbr[i].tolist() for i in range(50))
    assert all(len(set(row.tolist())) == 10 for row in nbr)


def test_heavy_ties_are_deterministic() -> None:
    """An integer grid makes many equal distances, including at the K_max boundary: the table
    equals the brute-force stable sort (distance, then index) for every chunk size."""
    grid = torch.stack(torch.meshgrid(torch.arange(6), torch.arange(6), torch.arange(4), indexing="ij"), -1)
    codebook = grid.reshape(-1, 3).float()  # [144, 3]
    want = brute_force(codebook, list(range(144)), 20)
    for chunk in (1, 17, 144):
        assert torch.equal(build_proximity(codebook, 20, chunk_size=chunk).neighbours.long(), want)


def test_build_validation() -> None:
    codebook = randn(10, 3)
    for bad in (0, 10, 11):
        with pytest.raises(LanternError, match="k_max"):
            build_proximity(codebook, bad)
    with pytest.raises(LanternError, match="metric"):
        build_proximity(codebook, 3, metric="manhattan")  # type: ignore[arg-type]
    with pytest.raises(LanternError, match="NaN"):
        build_proximity(torch.full((10, 3), float("nan")), 3)
    with pytest.raises(LanternError, match="codebook"):
        build_proximity(randn(10), 3)
    assert build_proximity(codebook, 9).neighbours.shape == (10, 9)  # K_max = V - 1 is allowed


def test_codebook_sha256_is_float32_little_endian_bytes() -> None:
    codebook = torch.randn(16, 4, generator=torch.Generator().manual_seed(3))
    want = hashlib.sha256(codebook.numpy().astype("<f4").tobytes()).hexdigest()
    assert codebook_sha256(codebook) == want
    assert codebook_sha256(codebook.double()) == want  # float32 values, any input dtype
    assert codebook_sha256(codebook.t().contiguous().t()) == want  # memory layout does not matter
    assert codebook_sha256(codebook + 1e-3) != want


def test_save_load_round_trip(tmp_path: Path) -> None:
    codebook = torch.randn(40, 8, generator=torch.Generator().manual_seed(4))
    table = build_proximity(codebook, 12, metric="cosine", normalize=True)
    path = table.save(tmp_path / "proximity.safetensors")
    assert [p.name for p in tmp_path.iterdir()] == ["proximity.safetensors"]  # no temp left over
    loaded = ProximityTable.load(path)
    assert torch.equal(loaded.neighbours, table.neighbours) and loaded.neighbours.dtype == torch.int32
    assert (loaded.codebook_sha256, loaded.metric, loaded.normalized) == (codebook_sha256(codebook), "cosine", True)
    assert (loaded.k_max, loaded.vocab_size) == (12, 40)
    loaded.validate(codebook)


def test_validate_rejects_other_codebooks() -> None:
    codebook = torch.randn(40, 8, generator=torch.Generator().manual_seed(5))
    table = build_proximity(codebook, 5)
    other = codebook.clone()
    other[0, 0] += 1.0
    message = f"built for codebook sha256 {table.codebook_sha256}.*{codebook_sha256(other)}"
    with pytest.raises(LanternError, match=message):
        table.validate(other)
    with pytest.raises(LanternError, match="40 tokens.*has 41"):
        table.validate(randn(41, 8))


def test_k_against_k_max() -> None:
    table = build_proximity(torch.randn(30, 4, generator=torch.Generator().manual_seed(6)), 8)
    with pytest.raises(LanternError, match=r"lantern_k \(9\) exceeds the proximity table's K_max \(8\)"):
        table.check_k(9)
    with pytest.raises(LanternError, match="K_max"):
        table.neighbours_for(9)
    nbr = table.neighbours_for(5)
    assert nbr.shape == (30, 5) and nbr.dtype == torch.int64
    assert torch.equal(nbr, table.neighbours[:, :5].long())
    # The stored int32 table plugs straight into the acceptance rule.
    r = torch.softmax(torch.randn(2, 30, generator=torch.Generator().manual_seed(7)), -1)
    x = torch.tensor([3, 4])
    cfg = RelaxationConfig(k=8, delta=0.2)
    stored, wide = relaxed_mass(r, x, table.neighbours, cfg), relaxed_mass(r, x, table.neighbours_for(8), cfg)
    assert torch.equal(stored[0], wide[0]) and torch.equal(stored[1], wide[1])


def test_load_errors(tmp_path: Path) -> None:
    with pytest.raises(LanternError, match="not found"):
        ProximityTable.load(tmp_path / "missing.safetensors")
    other = tmp_path / "model.safetensors"
    save_file({"w": torch.zeros(2, 2)}, str(other), metadata={"format": "pt"})
    with pytest.raises(LanternError, match="not a lantern proximity table"):
        ProximityTable.load(other)
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"definitely not safetensors")
    with pytest.raises(LanternError, match=r"proximity table .*junk\.safetensors is not a readable safetensors"):
        ProximityTable.load(junk)


# ---- tokenizers ---------------------------------------------------------------------------------


def write_folder(folder: Path, codebook: Tensor, model_type: str = "lantern-vq") -> Path:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": model_type, "codebook_size": codebook.shape[0]}))
    save_file({"quantize.embedding.weight": codebook, "decoder.w": torch.zeros(3)}, str(folder / "model.safetensors"))
    return folder


@pytest.mark.parametrize("layout", ["model", "state_dict", "raw"])
def test_codebook_from_official_checkpoint(tmp_path: Path, layout: str) -> None:
    codebook = randn(20, 8)
    state = {"quantize.embedding.weight": codebook, "encoder.w": torch.zeros(2)}
    obj = state if layout == "raw" else {layout: state, "steps": 10, "optimizer": {}}
    torch.save(obj, tmp_path / "vq.pt")
    assert torch.equal(codebook_from_tokenizer(tmp_path / "vq.pt"), codebook)


def test_codebook_from_folder(tmp_path: Path) -> None:
    codebook = randn(20, 8)
    assert torch.equal(codebook_from_tokenizer(write_folder(tmp_path / "tok", codebook)), codebook)
    with pytest.raises(LanternError, match="model_type"):
        codebook_from_tokenizer(write_folder(tmp_path / "gpt", codebook, "lantern-llamagen"))


def test_codebook_from_tokenizer_errors(tmp_path: Path) -> None:
    with pytest.raises(LanternError, match="not found"):
        codebook_from_tokenizer(tmp_path / "nothing")
    torch.save({"model": {"other": torch.zeros(2)}}, tmp_path / "vq.pt")
    with pytest.raises(LanternError, match="quantize.embedding.weight"):
        codebook_from_tokenizer(tmp_path / "vq.pt")
    (tmp_path / "text.pt").write_text("not a checkpoint")
    with pytest.raises(LanternError):
        codebook_from_tokenizer(tmp_path / "text.pt")
    (tmp_path / "empty").mkdir()
    with pytest.raises(LanternError, match="config"):
        codebook_from_tokenizer(tmp_path / "empty")


def test_build_proximity_file(tmp_path: Path) -> None:
    codebook = torch.randn(64, 8, generator=torch.Generator().manual_seed(8))
    folder = write_folder(tmp_path / "tok", codebook)
    out = tmp_path / "tables" / "proximity.safetensors"
    table = build_proximity_file(str(folder), 16, str(out))
    loaded = ProximityTable.load(out)
    loaded.validate(codebook)
    assert torch.equal(loaded.neighbours, table.neighbours)
    assert torch.equal(loaded.neighbours.long(), brute_force(codebook, list(range(64)), 16))
    assert np.array_equal(loaded.neighbours.numpy(), table.neighbours.numpy())
