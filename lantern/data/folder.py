"""A folder of the user's own images (``load_dataset(path)``): every image directly inside it, labels
from an optional ``filename,label`` file, every 10th image held out as the test split."""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageOps

from lantern.data.base import MAX_CLASSES, ImageDataset, _check_args, _resolve_num_samples, _to_tensor
from lantern.errors import LanternError, check

FOLDER_SUFFIXES = (".png", ".jpg", ".jpeg")
FOLDER_TEST_EVERY = 10  # sorted index i is a test image when i % 10 == 9


@dataclass(frozen=True)
class _FolderImage:
    name: str
    data: bytes  # raw file bytes, for the fingerprint
    image: Image.Image  # decoded, EXIF-rotated, not yet converted


def _list_image_files(folder: Path) -> list[Path]:
    check(folder.exists(), f"--data: image folder not found: {folder} (expected digits, photos or a folder of "
                           ".png/.jpg/.jpeg images)")
    check(folder.is_dir(), f"image folder {folder} is a file, expected a directory of .png/.jpg/.jpeg images")
    files = sorted(
        p
        for p in folder.iterdir()
        # Hidden files (macOS "._x.png" resource forks, editor droppings) are not images.
        if p.is_file() and not p.name.startswith(".") and p.suffix.lower() in FOLDER_SUFFIXES
    )
    check(bool(files), f"no .png/.jpg/.jpeg files in {folder}")
    return files


def _read_image(path: Path) -> _FolderImage:
    data = path.read_bytes()
    try:
        image: Image.Image = Image.open(io.BytesIO(data))  # (an ImageFile, then exif_transpose's Image)
        image.load()
        # Phone photos store their rotation in EXIF; apply it so sizes and pixels match what viewers show.
        image = ImageOps.exif_transpose(image)
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        # (Pillow names the in-memory file it was given, "<_io.BytesIO object at 0x...>": not the user's)
        reason = re.sub(r"\s*<_io\.BytesIO object at 0x[0-9a-f]+>", "", str(e))
        raise LanternError(f"cannot read image {path}: {reason}") from None
    return _FolderImage(path.name, data, image)


def _convert(image: Image.Image, channels: int) -> Image.Image:
    """RGB (channels=3) or L (channels=1); transparent pixels become white."""
    mode = "RGB" if channels == 3 else "L"
    has_alpha = image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info)
    if has_alpha:
        # The colour under a transparent pixel is arbitrary; compose onto white as viewers do.
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        image = Image.alpha_composite(background, rgba)
    return image.convert(mode)


def _check_sizes(images: Sequence[_FolderImage], folder: Path) -> int:
    """Without ``image_size`` every image must be square and of one size; return that size."""
    first = images[0]
    for other in images[1:]:
        check(
            other.image.size == first.image.size,
            f"images in {folder} have different sizes: {first.name} is {first.image.size[0]}x{first.image.size[1]}, "
            f"{other.name} is {other.image.size[0]}x{other.image.size[1]}; "
            "pass --image-size (image_size=) to center-crop and resize them all",
        )
    width, height = first.image.size
    check(
        width == height,
        f"images in {folder} are not square ({first.name} is {width}x{height}); "
        "pass --image-size (image_size=) to center-crop and resize them",
    )
    return width


def _square(image: Image.Image, size: int) -> Image.Image:
    """Center-crop to a square, then resize to ``size`` (LANCZOS)."""
    width, height = image.size
    side = min(width, height)
    left, top = (width - side) // 2, (height - side) // 2
    image = image.crop((left, top, left + side, top + side))
    if side != size:
        image = image.resize((size, size), Image.Resampling.LANCZOS)
    return image


def read_labels_file(path: Path, names: Sequence[str], folder: Path) -> list[int]:
    """Labels for ``names`` from ``filename,label`` lines ('#' comments and blank lines ignored)."""
    check(path.is_file(), f"labels file {path} is a folder, not a file" if path.is_dir()
          else f"labels file not found: {path}")
    known = set(names)
    labels: dict[str, int] = {}
    seen_on: dict[str, int] = {}
    try:
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as e:
        raise LanternError(f"labels file {path} is not UTF-8 text (byte {e.start}: {e.reason})") from None
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        name, label = _parse_label_line(line, lineno, path)
        check(
            name not in seen_on,
            f"duplicate filename {name!r} on line {lineno} of labels file {path} (first on line {seen_on.get(name)})",
        )
        check(
            name in known,
            f"unknown image id {name!r} on line {lineno} of labels file {path}: no such image in {folder}",
        )
        labels[name] = label
        seen_on[name] = lineno
    missing = [n for n in names if n not in labels]
    check(
        not missing,
        f"{len(missing)} image(s) in {folder} have no label in {path}: {', '.join(missing[:5])}"
        + (", ..." if len(missing) > 5 else ""),
    )
    return [labels[n] for n in names]


def _parse_label_line(line: str, lineno: int, path: Path) -> tuple[str, int]:
    # Split at the last comma so filenames that contain commas still work.
    name, sep, label = line.rpartition(",")
    name, label = name.strip(), label.strip()
    ok = bool(sep) and bool(name) and label.isdigit() and label.isascii()
    check(
        ok,
        f"line {lineno} of labels file {path} is {line!r}; expected 'filename,label' with a non-negative "
        "integer label (comment out a header line with '#')",
    )
    check(len(label) <= 7 and int(label) < MAX_CLASSES,
          f"line {lineno} of labels file {path}: label {label[:20]} is past the largest class id, {MAX_CLASSES - 1} "
          "(labels are class ids counted from 0)")
    return name, int(label)


def folder_split_indices(n: int, split: str) -> list[int]:
    """Sorted-order indices of ``split``: every 10th image (i % 10 == 9) is test.

    With fewer than 10 images the last one is the test set (if there are at least 2), so a
    small folder still gets a held-out image; a single image is train only.
    """
    if n >= FOLDER_TEST_EVERY:
        test = [i for i in range(n) if i % FOLDER_TEST_EVERY == FOLDER_TEST_EVERY - 1]
    else:
        test = [n - 1] if n >= 2 else []
    if split == "test":
        return test
    test_set = set(test)
    return [i for i in range(n) if i not in test_set]


class FolderDataset(ImageDataset):
    """Images directly inside a folder, loaded eagerly; labels from an optional CSV file."""

    def __init__(
        self,
        folder: str | os.PathLike[str],
        split: str = "train",
        *,
        image_size: int | None = None,
        seed: int = 0,
        num_samples: int | None = None,
        labels_file: str | os.PathLike[str] | None = None,
        channels: int = 3,
    ) -> None:
        _check_args(split, image_size, seed, num_samples, channels)
        self.folder = Path(folder)
        self.name = "folder"
        self.split = split
        self.seed = int(seed)  # no augmentation, so it does not affect items; kept for describe()
        self.channels = int(channels)
        self.labels_file = None if labels_file is None else Path(labels_file)
        self._requested = {
            "image_size": None if image_size is None else int(image_size),
            "num_samples": None if num_samples is None else int(num_samples),
        }

        images = [_read_image(p) for p in _list_image_files(self.folder)]
        names = [im.name for im in images]
        all_labels = (
            [0] * len(images) if self.labels_file is None else read_labels_file(self.labels_file, names, self.folder)
        )
        self.image_size = _check_sizes(images, self.folder) if image_size is None else int(image_size)
        self._digest = self._hash_sources(images, all_labels)

        rows = folder_split_indices(len(images), split)
        self.num_samples = _resolve_num_samples(num_samples, len(rows), f"{split} split of {self.folder}")
        rows = rows[: self.num_samples]
        self.files = [names[r] for r in rows]
        self.labels = [all_labels[r] for r in rows]
        # Every image is decoded above (so a corrupt file fails for both splits), but only this split is kept.
        self._pixels = [np.asarray(_square(_convert(images[r].image, channels), self.image_size)) for r in rows]
        self.num_classes = max(all_labels) + 1
        self.class_names = [str(c) for c in range(self.num_classes)]

    @staticmethod
    def _hash_sources(images: Sequence[_FolderImage], labels: Sequence[int]) -> str:
        h = hashlib.sha256()
        for im, label in zip(images, labels, strict=True):
            h.update(json.dumps([im.name, label, len(im.data)]).encode())
            h.update(im.data)
        return h.hexdigest()

    def __len__(self) -> int:
        return len(self._pixels)

    def _item(self, i: int) -> tuple[torch.Tensor, int]:
        return _to_tensor(self._pixels[i]), self.labels[i]

    def describe(self) -> dict[str, Any]:
        return {
            "source": str(self.folder.resolve()),
            "split": self.split,
            "image_size": self._requested["image_size"],
            "seed": self.seed,
            "num_samples": self._requested["num_samples"],
            "labels_file": None if self.labels_file is None else str(self.labels_file.resolve()),
            "channels": self.channels,
        }

    def _fingerprint_params(self) -> dict[str, Any]:
        # The folder path is left out: the same files elsewhere are the same data.
        return {"image_size": self.image_size, "num_samples": self.num_samples, "channels": self.channels}

    def _source_digest(self) -> str:
        return self._digest
