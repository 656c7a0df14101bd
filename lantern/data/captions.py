"""Image-caption pairs on disk, as ``img2dataset`` downloads LAION-COCO and the like (its ``files``
output format): every image beside a ``.txt`` of the same stem holding its caption, in numbered
sub-folders (``00000/000000001.jpg`` + ``00000/000000001.txt``)."""

from __future__ import annotations

import os
from pathlib import Path

from lantern.errors import LanternError, check
from lantern.images import IMAGE_SUFFIXES


def caption_folder(folder: str | os.PathLike[str], what: str = "--images") -> list[tuple[Path, str]]:
    """Every image under ``folder`` (sub-folders included), in path order, with its caption: the
    text of the ``.txt`` beside it, whitespace collapsed to single spaces (a caption is one
    prompt). An image without a caption, or with an empty one, is refused by name: a pair that
    silently fell out would change the data set without a word."""
    root = Path(folder)
    check(root.is_dir(), f"{what}: no such folder {root}")
    images = sorted(p for p in root.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())
    check(bool(images), f"{what}: {root} holds no images ({', '.join(IMAGE_SUFFIXES)}, each with a .txt caption "
                        "beside it, as img2dataset writes them)")
    pairs = []
    for image in images:
        text = image.with_suffix(".txt")
        check(text.is_file(), f"{what}: {image} has no caption ({text.name} beside it, as img2dataset writes)")
        try:
            caption = " ".join(text.read_text(encoding="utf-8-sig").split())
        except UnicodeDecodeError as e:
            raise LanternError(f"{what}: {text} is not UTF-8 text ({e.reason} at byte {e.start})") from None
        check(bool(caption), f"{what}: the caption {text} is empty")
        pairs.append((image, caption))
    return pairs

