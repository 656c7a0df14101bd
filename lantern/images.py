"""Image output helpers: grids and atomic PNG writes."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

from PIL import Image

from lantern.io import atomic_path


def image_grid(images: Sequence[Image.Image], ncol: int | None = None, pad: int = 2) -> Image.Image:
    """Tile equally sized images row by row (``ncol`` per row) with a ``pad``-pixel white border."""
    if not images:
        raise ValueError("image_grid needs at least one image")
    ncol = ncol or math.ceil(math.sqrt(len(images)))
    nrow = math.ceil(len(images) / ncol)
    w, h = images[0].size
    mode = "RGB" if any(im.mode != "L" for im in images) else "L"
    grid = Image.new(mode, (ncol * (w + pad) + pad, nrow * (h + pad) + pad), "white")
    for i, im in enumerate(images):
        r, c = divmod(i, ncol)
        grid.paste(im.convert(mode), (pad + c * (w + pad), pad + r * (h + pad)))
    return grid


def save_png(image: Image.Image, path: str | os.PathLike[str]) -> None:
    with atomic_path(path) as tmp:
        image.save(tmp, format="PNG")
