"""Deterministic image data sets for training and evaluating tokenizers, targets and drafters.

``load_dataset("photos" | "digits" | folder, split)`` returns an :class:`ImageDataset` whose items
are ``(float32 [C, S, S] in [-1, 1], label)``; :func:`batch_images` stacks a batch of them.
"""

from __future__ import annotations

from lantern.data.base import ImageDataset
from lantern.data.datasets import (
    PHOTO_MAX_SCALE,
    PHOTO_NAMES,
    DigitsDataset,
    PhotoCrop,
    PhotoDataset,
    batch_images,
    load_dataset,
    photo_region,
)
from lantern.data.folder import FolderDataset

__all__ = [
    "PHOTO_MAX_SCALE",
    "PHOTO_NAMES",
    "DigitsDataset",
    "FolderDataset",
    "ImageDataset",
    "PhotoCrop",
    "PhotoDataset",
    "batch_images",
    "load_dataset",
    "photo_region",
]
