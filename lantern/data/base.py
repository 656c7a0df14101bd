"""The base of every data set (:class:`ImageDataset`) and the helpers the sources share: the argument
checks, per-item random generators, optional imports and source digests."""

from __future__ import annotations

import hashlib
import importlib
import json
import operator
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from types import ModuleType
from typing import Any, SupportsIndex

import numpy as np
import torch

from lantern.errors import LanternError, check

SPLITS = ("train", "test")
# Bump when the item computation changes, so fingerprints of old caches stop matching.
FORMAT_VERSION = 1
INSTALL_HINT = "pip install 'lantern-ar[train]'"


class ImageDataset(ABC):
    """A finite, deterministic, indexable set of ``(image [C, S, S] in [-1, 1], label)`` items."""

    name: str
    split: str
    num_classes: int
    channels: int
    image_size: int
    class_names: list[str]
    seed: int
    num_samples: int
    _fingerprint: str | None = None

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def _item(self, i: int) -> tuple[torch.Tensor, int]:
        """Item ``i`` for ``0 <= i < len(self)``."""

    def describe(self) -> dict[str, Any]:
        """JSON-able keyword arguments that rebuild this data set with :func:`load_dataset`
        (built-in sources; the folder data set adds its path and labels file)."""
        return {
            "source": self.name,
            "split": self.split,
            "image_size": self.image_size,
            "seed": self.seed,
            "num_samples": self.num_samples,
            "channels": self.channels,
        }

    @abstractmethod
    def _fingerprint_params(self) -> dict[str, Any]:
        """Every parameter that affects the items (JSON-able)."""

    @abstractmethod
    def _source_digest(self) -> str:
        """sha256 hex of the source pixels or bytes."""

    def __getitem__(self, i: SupportsIndex) -> tuple[torch.Tensor, int]:
        n = len(self)
        j = operator.index(i)
        if j < 0:
            j += n
        # IndexError (not LanternError) keeps Python's iteration and slicing conventions working.
        if not 0 <= j < n:
            raise IndexError(f"index {operator.index(i)} out of range for the {self.name} {self.split} set of {n}")
        return self._item(j)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, int]]:
        return (self._item(i) for i in range(len(self)))

    def fingerprint(self) -> str:
        """sha256 hex over the source pixels and every parameter that affects the items (cached)."""
        if self._fingerprint is None:
            params = {"format": FORMAT_VERSION, "name": self.name, "split": self.split, **self._fingerprint_params()}
            h = hashlib.sha256(json.dumps(params, sort_keys=True).encode())
            h.update(self._source_digest().encode())
            self._fingerprint = h.hexdigest()
        return self._fingerprint

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(split={self.split!r}, len={len(self)}, image_size={self.image_size}, "
            f"channels={self.channels}, num_classes={self.num_classes})"
        )


def _to_tensor(pixels: np.ndarray) -> torch.Tensor:
    """uint8 ``[H, W]`` or ``[H, W, C]`` -> float32 ``[C, H, W]`` in ``[-1, 1]``."""
    arr = np.asarray(pixels, dtype=np.float32) / np.float32(127.5) - np.float32(1.0)
    if arr.ndim == 2:
        arr = arr[None]
    else:
        arr = arr.transpose(2, 0, 1)
    return torch.from_numpy(np.ascontiguousarray(arr))


def _item_rng(seed: int, split: str, i: int) -> np.random.Generator:
    return np.random.default_rng([seed, SPLITS.index(split), i])


def _import(module: str, package: str, what: str) -> ModuleType:
    """Import an optional dependency, or say which package to install."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise LanternError(
            f"the {what} data set needs the '{package}' package, which is not installed: "
            f"{INSTALL_HINT} (or pip install {package})"
        ) from e


def _sha256_arrays(arrays: Sequence[np.ndarray]) -> str:
    h = hashlib.sha256()
    for a in arrays:
        h.update(f"{a.dtype}{a.shape}".encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def _resolve_num_samples(num_samples: int | None, available: int, what: str) -> int:
    """Truncation for finite sets: ``None`` means all; more than available is an error."""
    if num_samples is None:
        return available
    num_samples = int(num_samples)
    check(
        num_samples <= available,
        f"num_samples={num_samples} is more than the {available} images in the {what}",
    )
    return num_samples


def _check_positive_int(value: Any, arg: str) -> None:
    ok = isinstance(value, int | np.integer) and not isinstance(value, bool) and bool(value >= 1)  # (numpy: np.bool_)
    check(ok, f"{arg} must be a positive integer, got {value!r}")


# The largest image side and class id the data sets take: past them, the images or the class list
# of one run outgrow any machine's memory (a label of 1e11 made a class-name list of 1e11 entries).
MAX_IMAGE_SIDE = 8192
MAX_CLASSES = 1_000_000


def _check_args(split: str, image_size: int | None, seed: int, num_samples: int | None, channels: int | None) -> None:
    check(split in SPLITS, f"split must be 'train' or 'test', got {split!r}")
    if image_size is not None:
        _check_positive_int(image_size, "image_size")
        # a side of a million pixels filled the machine's memory before any error (a probe, 2026-11-29)
        check(image_size <= MAX_IMAGE_SIDE, f"image_size (--image-size) must be at most {MAX_IMAGE_SIDE} pixels, "
                                            f"got {image_size}")
    if num_samples is not None:
        _check_positive_int(num_samples, "num_samples")
    seed_ok = isinstance(seed, int | np.integer) and not isinstance(seed, bool) and seed >= 0
    check(seed_ok, f"seed must be a non-negative integer, got {seed!r}")
    check(channels in (None, 1, 3), f"channels must be 1 or 3, got {channels!r}")
