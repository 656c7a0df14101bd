"""Code sets: images turned into token grids by a tokenizer (input of target and drafter training).

A code set is one safetensors file::

    codes   int32 [N, n]   row-major code grids (n = g*g tokens per image)
    labels  int64 [N]      class ids
    metadata (JSON string "lantern"): vocab_size, grid, num_classes, class_names, tokenizer
        codebook sha256, the data set description and fingerprint

``lantern extract-codes`` writes ``train.safetensors`` and ``test.safetensors`` into one folder.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lantern.errors import LanternError, check
from lantern.io import atomic_path, ensure_writable_dir, read_safetensors, save_safetensors
from lantern.models.vq import VQModel

SPLIT_FILES = {"train": "train.safetensors", "test": "test.safetensors"}


@dataclass
class CodeSet:
    codes: Tensor  # [N, n] int64 in memory
    labels: Tensor  # [N] int64
    meta: dict[str, Any]

    def __len__(self) -> int:
        return int(self.codes.shape[0])

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

    @property
    def num_classes(self) -> int:
        return int(self.meta["num_classes"])

    @property
    def seq_len(self) -> int:
        return int(self.codes.shape[1])

    def fingerprint(self) -> str:
        h = hashlib.sha256()
        h.update(self.codes.to(torch.int32).contiguous().numpy().tobytes())
        h.update(self.labels.contiguous().numpy().tobytes())
        return h.hexdigest()

    def unigram_bits(self, other: CodeSet) -> float:
        """Bits per token of ``other``'s codes under this set's add-one-smoothed unigram model."""
        counts = torch.bincount(self.codes.reshape(-1), minlength=self.vocab_size).double() + 1.0
        logp = (counts / counts.sum()).log2()
        return float(-logp[other.codes.reshape(-1)].mean())

    def save(self, path: str | os.PathLike[str]) -> Path:
        path = Path(path)
        with atomic_path(path) as tmp:
            save_safetensors({"codes": self.codes.to(torch.int32).contiguous(), "labels": self.labels.contiguous()},
                             tmp, metadata={"lantern": json.dumps(self.meta)})
        return path

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> CodeSet:
        path = Path(path)
        if not path.is_file():
            raise LanternError(f"code set not found: {path} (make one with `lantern extract-codes`)")
        tensors, header = read_safetensors(path, "code set", ["codes", "labels"])
        try:
            meta = json.loads(header.get("lantern", "null"))
        except (json.JSONDecodeError, RecursionError):
            meta = None
        check(isinstance(meta, dict) and len(tensors) == 2,
              f"{path} is not a lantern code set (no 'lantern' metadata, or no codes/labels tensors)")
        codes, labels = tensors["codes"].long(), tensors["labels"].long()
        check(codes.ndim == 2 and labels.shape == (codes.shape[0],), f"{path}: codes/labels shapes do not match")
        # the metadata and the values the trainers index with: else an IndexError or KeyError deep in a run
        for key in ("vocab_size", "num_classes"):
            value = meta.get(key)
            check(isinstance(value, int) and not isinstance(value, bool) and value >= 1,
                  f"{path}: its metadata's {key} must be a positive integer, got {value!r}")
        if codes.numel():
            low, high = int(codes.min()), int(codes.max())
            check(low >= 0 and high < meta["vocab_size"],
                  f"{path} holds code {low if low < 0 else high}, outside its vocabulary of {meta['vocab_size']}")
        if labels.numel():
            low, high = int(labels.min()), int(labels.max())
            check(low >= 0 and high < meta["num_classes"],
                  f"{path} holds label {low if low < 0 else high}, outside its {meta['num_classes']} classes")
        return cls(codes, labels, meta)


def load_code_dir(directory: str | os.PathLike[str], split: str) -> CodeSet:
    directory = Path(directory)
    if not directory.is_dir():
        raise LanternError(f"--codes: no such folder {directory} (make one with `lantern extract-codes`)")
    path = directory / SPLIT_FILES[split]
    if not path.is_file():
        raise LanternError(f"--codes: {directory} has no {path.name}: not a code set folder (make one with "
                           "`lantern extract-codes`)")
    return CodeSet.load(path)


def codebook_sha256(tokenizer: VQModel) -> str:
    """The tokenizer's codebook hash, as proximity tables record it: the one hash ``load_stack``
    compares a target's recorded tokenizer with."""
    from lantern.targets.proximity import codebook_sha256 as sha256_of

    return sha256_of(tokenizer.quantize.embedding.weight)


@torch.no_grad()
def extract_codes(tokenizer: VQModel, data: Any, batch_size: int = 64, progress: bool = True) -> CodeSet:
    """Encode every image of ``data`` (a :class:`lantern.data.ImageDataset`)."""
    from tqdm.auto import tqdm

    from lantern.data import batch_images

    check(isinstance(batch_size, int) and batch_size >= 1, f"--batch-size must be an integer >= 1, got {batch_size!r}")
    check(len(data) > 0, f"extract-codes: the {data.split} split of {data.name} is empty")
    check(data.channels == tokenizer.config.in_channels,
          f"the tokenizer takes {tokenizer.config.in_channels}-channel images but the data set has {data.channels}")
    tokenizer = tokenizer.eval()
    codes, labels = [], []
    for lo in tqdm(range(0, len(data), batch_size), desc=f"encode {data.split}", disable=not progress):
        images, lab = batch_images(data, list(range(lo, min(lo + batch_size, len(data)))))
        codes.append(tokenizer.encode(images.to(tokenizer.quant_conv.weight.device)).cpu())
        labels.append(lab)
    all_codes = torch.cat(codes)
    meta = {
        "vocab_size": tokenizer.config.codebook_size,
        "grid": int(round(all_codes.shape[1] ** 0.5)),
        "num_classes": data.num_classes,
        "class_names": list(data.class_names),
        "image_size": data.image_size,
        "channels": data.channels,
        "tokenizer_codebook_sha256": codebook_sha256(tokenizer),
        "data": data.describe(),
        "data_fingerprint": data.fingerprint(),
    }
    return CodeSet(all_codes, torch.cat(labels), meta)


def extract_code_dir(tokenizer: VQModel, train: Any, test: Any, out: str | os.PathLike[str],
                     batch_size: int = 64, progress: bool = True) -> dict[str, CodeSet]:
    out = ensure_writable_dir(out)
    sets = {}
    for split, data in (("train", train), ("test", test)):
        sets[split] = extract_codes(tokenizer, data, batch_size, progress)
        sets[split].save(out / SPLIT_FILES[split])
    return sets
