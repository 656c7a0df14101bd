"""Tests for lantern.data: determinism, split disjointness, folder validation, batching."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from lantern.data import (
    PHOTO_MAX_SCALE,
    PHOTO_NAMES,
    DigitsDataset,
    FolderDataset,
    PhotoDataset,
    batch_images,
    load_dataset,
    photo_region,
)
from lantern.data import datasets as data_mod
from lantern.errors import LanternError

# --------------------------------------------------------------------------------------------
# photos
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def photos() -> PhotoDataset:
    ds = load_dataset("photos", num_samples=44, image_size=32)
    assert isinstance(ds, PhotoDataset)
    return ds


def items(ds, order) -> dict[int, tuple[torch.Tensor, int]]:
    return {i: ds[i] for i in order}


@pytest.mark.slow
def test_photos_deterministic_in_any_order(photos: PhotoDataset) -> None:
    other = load_dataset("photos", num_samples=44, image_size=32)
    forward = items(photos, range(len(photos)))
    backward = items(other, reversed(range(len(other))))
    for i in range(len(photos)):
        assert torch.equal(forward[i][0], backward[i][0])
        assert forward[i][1] == backward[i][1]
    # Repeated access after other items changes nothing (no shared RNG state).
    assert torch.equal(photos[3][0], forward[3][0])
    assert torch.equal(photos[-1][0], forward[len(photos) - 1][0])


def test_photos_seed_changes_items(photos: PhotoDataset) -> None:
    other = load_dataset("photos", num_samples=44, image_size=32, seed=1)
    differ = sum(not torch.equal(photos[i][0], other[i][0]) for i in range(22))
    assert differ == 22
    assert [photos[i][1] for i in range(22)] == [other[i][1] for i in range(22)]


def test_photos_shapes_ranges_and_defaults(photos: PhotoDataset) -> None:
    image, label = photos[0]
    assert image.shape == (3, 32, 32) and image.dtype == torch.float32
    assert isinstance(label, int)
    stack = torch.stack([photos[i][0] for i in range(len(photos))])
    assert stack.min() >= -1.0 and stack.max() <= 1.0
    assert stack.std() > 0.1  # real image content, not a constant
    grey = load_dataset("photos", num_samples=3, channels=1, image_size=16)
    assert grey[0][0].shape == (1, 16, 16)
    assert len(load_dataset("photos")) == 20000 and len(load_dataset("photos", "test")) == 2000
    default = load_dataset("photos", num_samples=1)
    assert (default.image_size, default.channels, default.num_classes) == (64, 3, 11)
    assert default[0][0].shape == (3, 64, 64)
    assert default.class_names == list(PHOTO_NAMES) and default.class_names[-1] == "grace_hopper"


def test_photos_labels_balanced() -> None:
    ds = load_dataset("photos", num_samples=110, image_size=8)
    counts = Counter(ds[i][1] for i in range(len(ds)))
    assert counts == dict.fromkeys(range(11), 10)


def test_photo_regions_partition_every_photo() -> None:
    for p in range(len(PHOTO_NAMES)):
        train, test = photo_region(p, "train"), photo_region(p, "test")
        height, width = data_mod.photo_sources()[p].shape[:2]
        assert train == (0, 0, width * 4 // 5, height)
        assert test == (width * 4 // 5, 0, width, height)


@pytest.mark.parametrize("image_size", [16, 64, 256])
def test_photo_crops_stay_inside_their_split_region(image_size: int) -> None:
    for split in ("train", "test"):
        ds = PhotoDataset(split, image_size=image_size, num_samples=1100)
        flips = 0
        for i in range(len(ds)):
            photo, (left, top, right, bottom), flip = ds.crop_params(i)
            flips += flip
            r_left, r_top, r_right, r_bottom = photo_region(photo, split)
            assert photo == i % 11
            assert r_left <= left < right <= r_right and r_top <= top < bottom <= r_bottom
            side = right - left
            assert side == bottom - top
            assert min(image_size, r_right - r_left, r_bottom - r_top) <= side
            assert side <= round(image_size * PHOTO_MAX_SCALE)
            # The train region ends where the test region starts: no pixel in both.
            boundary = photo_region(photo, "test")[0]
            assert (right <= boundary) if split == "train" else (left >= boundary)
        assert 0.4 < flips / len(ds) < 0.6


def test_photo_items_come_from_their_crop_box() -> None:
    ds = PhotoDataset("test", image_size=24, num_samples=6, seed=3)
    for i in range(len(ds)):
        photo, (left, top, right, bottom), flip = ds.crop_params(i)
        pixels = data_mod.photo_sources()[photo][top:bottom, left:right]
        if flip:
            pixels = pixels[:, ::-1]
        expected = Image.fromarray(np.ascontiguousarray(pixels)).resize((24, 24), Image.Resampling.LANCZOS)
        expected_t = torch.from_numpy(np.asarray(expected, dtype=np.float32)).permute(2, 0, 1) / 127.5 - 1
        assert torch.equal(ds[i][0], expected_t)


def test_photos_fingerprint_and_describe(photos: PhotoDataset) -> None:
    fp = photos.fingerprint()
    assert len(fp) == 64 and int(fp, 16) >= 0
    assert fp == load_dataset("photos", num_samples=44, image_size=32).fingerprint()
    variants = [
        {"seed": 1},
        {"split": "test"},
        {"image_size": 16},
        {"num_samples": 45},
        {"channels": 1},
    ]
    base = {"source": "photos", "split": "train", "num_samples": 44, "image_size": 32}
    fps = {load_dataset(**{**base, **v}).fingerprint() for v in variants}
    assert len(fps) == len(variants) and fp not in fps
    desc = photos.describe()
    assert json.loads(json.dumps(desc)) == desc
    assert load_dataset(**desc).fingerprint() == fp


@pytest.mark.slow
def test_import_is_lazy() -> None:
    code = (
        "import sys, lantern.data; "
        "print(sorted(m for m in ('skimage', 'sklearn', 'matplotlib', 'mlxtend') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"


def test_missing_package_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(data_mod, "_photo_cache", None)
    monkeypatch.setitem(sys.modules, "skimage.data", None)  # makes the import raise ImportError
    with pytest.raises(LanternError, match=r"scikit-image.*lantern-ar\[train\]"):
        load_dataset("photos", num_samples=1)


# --------------------------------------------------------------------------------------------
# digits
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def digits() -> tuple[DigitsDataset, DigitsDataset]:
    train, test = load_dataset("digits"), load_dataset("digits", "test")
    assert isinstance(train, DigitsDataset) and isinstance(test, DigitsDataset)
    return train, test


def test_digits_split_sizes_and_disjoint(digits: tuple[DigitsDataset, DigitsDataset]) -> None:
    train, test = digits
    assert (len(train), len(test)) == (4500, 500)
    x, y = data_mod.mnist_source()
    train_rows, test_rows = set(train.source_indices.tolist()), set(test.source_indices.tolist())
    assert not train_rows & test_rows and len(train_rows | test_rows) == 5000
    train_pixels = {x[r].tobytes() for r in train_rows}
    assert not any(x[r].tobytes() in train_pixels for r in test_rows)
    assert Counter(y[test.source_indices].tolist()) == dict.fromkeys(range(10), 50)
    assert train.class_names == [str(c) for c in range(10)] and train.num_classes == 10


def test_digits_items_match_source(digits: tuple[DigitsDataset, DigitsDataset]) -> None:
    _, test = digits
    x, y = data_mod.mnist_source()
    labels = []
    for i in range(0, 500, 7):
        image, label = test[i]
        row = int(test.source_indices[i])
        assert image.shape == (1, 32, 32) and image.dtype == torch.float32
        assert label == y[row]
        border = torch.ones(32, 32, dtype=torch.bool)
        border[2:30, 2:30] = False
        assert torch.all(image[0][border] == -1.0)
        expected = torch.from_numpy(x[row].reshape(28, 28).astype(np.float32)) / 127.5 - 1
        assert torch.equal(image[0, 2:30, 2:30], expected)
        assert image.min() >= -1 and image.max() <= 1
        labels.append(label)
    assert len(set(labels)) == 10


def test_digits_deterministic_and_seed_independent_split(digits: tuple[DigitsDataset, DigitsDataset]) -> None:
    _, test = digits
    again = load_dataset("digits", "test", seed=5)
    assert np.array_equal(again.source_indices, test.source_indices)
    for i in (499, 0, 250):
        assert torch.equal(again[i][0], test[i][0]) and again[i][1] == test[i][1]
    assert again.fingerprint() == test.fingerprint()  # seed changes no item
    assert again.describe()["seed"] == 5 and load_dataset(**again.describe()).fingerprint() == test.fingerprint()


def test_digits_truncation_resize_and_channels() -> None:
    small = load_dataset("digits", num_samples=100, image_size=16, channels=3)
    assert len(small) == 100
    assert Counter(small[i][1] for i in range(100)) == dict.fromkeys(range(10), 10)
    image, _ = small[0]
    assert image.shape == (3, 16, 16) and torch.equal(image[0], image[2])
    assert small.fingerprint() != load_dataset("digits", num_samples=100).fingerprint()
    with pytest.raises(LanternError, match="num_samples=501 is more than the 500"):
        load_dataset("digits", "test", num_samples=501)


# --------------------------------------------------------------------------------------------
# folder
# --------------------------------------------------------------------------------------------


def save(folder: Path, name: str, image: Image.Image) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    image.save(folder / name)


def solid_folder(folder: Path, n: int, size: int = 8) -> list[str]:
    """``n`` grey images whose value encodes their sorted index."""
    names = [f"img{i:03d}.png" for i in range(n)]
    for i, name in enumerate(names):
        save(folder, name, Image.new("L", (size, size), i))
    return names


def test_folder_mixed_modes_are_converted(tmp_path: Path) -> None:
    save(tmp_path, "a_rgb.png", Image.new("RGB", (8, 8), (255, 0, 0)))
    save(tmp_path, "b_l.png", Image.new("L", (8, 8), 255))
    save(tmp_path, "c_rgba.png", Image.new("RGBA", (8, 8), (0, 255, 0, 255)))
    palette = Image.new("P", (8, 8), 0)
    palette.putpalette([0, 0, 255] + [0] * 765)
    save(tmp_path, "d_p.png", palette)
    save(tmp_path, "E_CMYK.JPG", Image.new("CMYK", (8, 8), (0, 0, 0, 0)))  # upper-case suffix, CMYK white
    (tmp_path / "notes.txt").write_text("not an image")

    train = load_dataset(str(tmp_path))
    test = load_dataset(str(tmp_path), "test")
    assert train.files == ["E_CMYK.JPG", "a_rgb.png", "b_l.png", "c_rgba.png"] and test.files == ["d_p.png"]
    assert train.image_size == 8 and train.channels == 3 and train.num_classes == 1 and train.class_names == ["0"]
    expected = {
        "a_rgb.png": (1, -1, -1),
        "b_l.png": (1, 1, 1),
        "c_rgba.png": (-1, 1, -1),
    }
    for i, name in enumerate(train.files):
        image, label = train[i]
        assert image.shape == (3, 8, 8) and label == 0
        if name in expected:
            assert image.mean(dim=(1, 2)).tolist() == list(expected[name])
    assert train[0][0].min() > 0.9  # CMYK white
    assert test[0][0].mean(dim=(1, 2)).tolist() == [-1, -1, 1]
    grey = load_dataset(str(tmp_path), channels=1)
    assert grey[0][0].shape == (1, 8, 8)
    assert torch.all(grey[2][0] == 1.0)


def test_folder_transparency_composited_on_white(tmp_path: Path) -> None:
    save(tmp_path, "a.png", Image.new("RGBA", (4, 4), (0, 0, 0, 0)))
    assert torch.all(load_dataset(str(tmp_path))[0][0] == 1.0)


def test_folder_mixed_sizes(tmp_path: Path) -> None:
    save(tmp_path, "a.png", Image.new("RGB", (8, 8)))
    wide = Image.new("RGB", (12, 8), (0, 0, 255))
    wide.paste((255, 0, 0), (0, 0, 2, 8))
    wide.paste((0, 255, 0), (2, 0, 10, 8))
    save(tmp_path, "b.png", wide)
    with pytest.raises(LanternError, match=r"a\.png is 8x8.*b\.png is 12x8.*--image-size"):
        load_dataset(str(tmp_path))
    ds = load_dataset(str(tmp_path), image_size=8)
    assert ds.files == ["a.png"]
    center = load_dataset(str(tmp_path), "test", image_size=8)[0][0]
    assert center.mean(dim=(1, 2)).tolist() == [-1, 1, -1]  # the red and blue edges were cropped away
    assert load_dataset(str(tmp_path), image_size=4)[0][0].shape == (3, 4, 4)


def test_folder_non_square_rejected(tmp_path: Path) -> None:
    save(tmp_path, "a.png", Image.new("RGB", (10, 6)))
    with pytest.raises(LanternError, match=r"not square.*a\.png is 10x6.*--image-size"):
        load_dataset(str(tmp_path))
    assert load_dataset(str(tmp_path), image_size=6)[0][0].shape == (3, 6, 6)


def test_folder_corrupt_image_named(tmp_path: Path) -> None:
    save(tmp_path, "a.png", Image.new("RGB", (8, 8)))
    (tmp_path / "x.png").write_bytes(b"this is not a png at all")
    with pytest.raises(LanternError, match=r"x\.png"):
        load_dataset(str(tmp_path))


def test_folder_truncated_image_named(tmp_path: Path) -> None:
    save(tmp_path, "a.png", Image.new("RGB", (64, 64), (1, 2, 3)))
    data = (tmp_path / "a.png").read_bytes()
    (tmp_path / "a.png").write_bytes(data[: len(data) // 2])
    with pytest.raises(LanternError, match=r"a\.png"):
        load_dataset(str(tmp_path))


def test_folder_path_errors(tmp_path: Path) -> None:
    with pytest.raises(LanternError, match="image folder not found"):
        load_dataset(str(tmp_path / "nope"))
    (tmp_path / "file.png").write_bytes(b"")
    with pytest.raises(LanternError, match="is a file"):
        load_dataset(str(tmp_path / "file.png"))
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "readme.txt").write_text("x")
    with pytest.raises(LanternError, match=r"no \.png/\.jpg/\.jpeg files in"):
        load_dataset(str(empty))


def test_folder_labels(tmp_path: Path) -> None:
    folder = tmp_path / "imgs"
    names = solid_folder(folder, 4)
    labels = tmp_path / "labels.csv"
    labels.write_text("# name,label\n\n" + "".join(f"{n},{k * 2}\n" for k, n in enumerate(names)))
    train = load_dataset(str(folder), labels_file=str(labels))
    assert train.labels == [0, 2, 4] and [train[i][1] for i in range(3)] == [0, 2, 4]
    assert train.num_classes == 7 and train.class_names == [str(c) for c in range(7)]
    test = load_dataset(str(folder), "test", labels_file=str(labels))
    assert test[0][1] == 6 and test.num_classes == 7
    relabelled = tmp_path / "relabelled.csv"
    relabelled.write_text("".join(f"{n},{k}\n" for k, n in enumerate(names)))
    assert load_dataset(str(folder), labels_file=str(relabelled)).fingerprint() != train.fingerprint()


@pytest.mark.parametrize(
    ("content", "pattern"),
    [
        ("img000.png,0\nimg001.png,0\nghost.png,1\n", r"unknown image id 'ghost\.png' on line 3"),
        ("img000.png,0\n", r"img001\.png"),  # img001.png has no label
        ("img000.png,0\nimg001.png\n", r"line 2 .*'img001\.png'"),
        ("img000.png,0\nimg001.png,-1\n", r"line 2 .*non-negative"),
        ("img000.png,0\nimg001.png,one\n", r"line 2"),
        ("img000.png,0\nimg001.png,1\nimg000.png,1\n", r"duplicate filename 'img000\.png' on line 3.*line 1"),
    ],
)
def test_folder_label_errors(tmp_path: Path, content: str, pattern: str) -> None:
    folder = tmp_path / "imgs"
    solid_folder(folder, 2)
    labels = tmp_path / "labels.csv"
    labels.write_text(content)
    with pytest.raises(LanternError, match=pattern):
        load_dataset(str(folder), labels_file=str(labels))


def test_folder_non_utf8_labels_file(tmp_path: Path) -> None:
    solid_folder(tmp_path / "imgs", 2)
    labels = tmp_path / "labels.csv"
    labels.write_bytes(b"img000.png,0\nimg\xff.png,1\n")
    with pytest.raises(LanternError, match=r"labels file .*labels\.csv is not UTF-8 text \(byte 16: invalid start"):
        load_dataset(str(tmp_path / "imgs"), labels_file=str(labels))


def test_folder_missing_labels_file(tmp_path: Path) -> None:
    solid_folder(tmp_path, 2)
    with pytest.raises(LanternError, match="labels file not found"):
        load_dataset(str(tmp_path), labels_file=str(tmp_path / "missing.csv"))


def test_folder_split_deterministic_and_disjoint(tmp_path: Path) -> None:
    names = solid_folder(tmp_path, 25)
    train, test = load_dataset(str(tmp_path)), load_dataset(str(tmp_path), "test")
    assert test.files == [names[9], names[19]] and len(train) == 23
    assert not set(train.files) & set(test.files) and len(set(train.files) | set(test.files)) == 25
    # Pixel value encodes the sorted index, so items are checkably the right files.
    assert [round((test[i][0][0, 0, 0].item() + 1) * 127.5) for i in range(2)] == [9, 19]
    again = load_dataset(str(tmp_path), "test")
    assert all(torch.equal(again[i][0], test[i][0]) for i in (1, 0))
    assert again.fingerprint() == test.fingerprint()
    assert len(load_dataset(str(tmp_path), num_samples=5)) == 5
    with pytest.raises(LanternError, match="num_samples=3 is more than the 2"):
        load_dataset(str(tmp_path), "test", num_samples=3)
    desc = test.describe()
    assert json.loads(json.dumps(desc)) == desc and load_dataset(**desc).fingerprint() == test.fingerprint()


def test_folder_small_splits(tmp_path: Path) -> None:
    one, three = tmp_path / "one", tmp_path / "three"
    solid_folder(one, 1)
    names = solid_folder(three, 3)
    assert len(load_dataset(str(one))) == 1 and len(load_dataset(str(one), "test")) == 0
    assert load_dataset(str(three), "test").files == [names[2]]
    assert load_dataset(str(three)).files == names[:2]


def test_folder_fingerprint_follows_content(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    solid_folder(a, 3)
    solid_folder(b, 3)
    fp = load_dataset(str(a)).fingerprint()
    assert load_dataset(str(b)).fingerprint() == fp  # same files elsewhere: same data
    save(b, "img001.png", Image.new("L", (8, 8), 200))
    assert load_dataset(str(b)).fingerprint() != fp
    assert load_dataset(str(a), image_size=4).fingerprint() != fp


# --------------------------------------------------------------------------------------------
# arguments and batching
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"split": "val"}, "split must be 'train' or 'test'"),
        ({"image_size": 0}, "image_size must be a positive integer"),
        ({"num_samples": 0}, "num_samples must be a positive integer"),
        ({"channels": 2}, "channels must be 1 or 3"),
        ({"seed": -1}, "seed must be a non-negative integer"),
        ({"labels_file": "x.csv"}, "labels_file is only for image folders"),
    ],
)
def test_bad_arguments(kwargs: dict, pattern: str) -> None:
    with pytest.raises(LanternError, match=pattern):
        load_dataset("photos", **kwargs)


def test_index_out_of_range(photos: PhotoDataset) -> None:
    with pytest.raises(IndexError):
        photos[len(photos)]
    assert len(list(iter(load_dataset("photos", num_samples=3, image_size=8)))) == 3


def test_batch_images(photos: PhotoDataset, tmp_path: Path) -> None:
    images, labels = batch_images(photos, [5, 0, 5])
    assert images.shape == (3, 3, 32, 32) and images.dtype == torch.float32
    assert labels.dtype == torch.int64 and labels.tolist() == [5, 0, 5]
    assert torch.equal(images[0], photos[5][0]) and torch.equal(images[1], photos[0][0])
    t_images, t_labels = batch_images(photos, torch.tensor([5, 0, 5]))
    assert torch.equal(t_images, images) and torch.equal(t_labels, labels)
    empty_images, empty_labels = batch_images(photos, [])
    assert empty_images.shape == (0, 3, 32, 32) and empty_labels.shape == (0,)
    with pytest.raises(LanternError, match="integer tensor"):
        batch_images(photos, torch.tensor([0.0]))
    solid_folder(tmp_path, 3)
    folder = load_dataset(str(tmp_path), channels=1)
    assert isinstance(folder, FolderDataset)
    assert batch_images(folder, [1, 0])[0].shape == (2, 1, 8, 8)
