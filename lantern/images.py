"""Image helpers: codes' pixels to PIL images (one ``to_pil`` for every model family), grids and
atomic PNG writes; real images read as a model's square input (:func:`square_image`)."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

import torch
from PIL import Image
from torch import Tensor

from lantern.errors import LanternError, check
from lantern.io import atomic_path

ROUNDINGS = ("half_up", "truncate")


def to_pil(images: Tensor, rounding: str = "half_up") -> list[Image.Image]:  # [B, C, H, W] in ~[-1, 1]
    """PIL images (mode L for one channel, RGB for three) of ``clamp((x+1)/2, 0, 1) * 255``.

    ``rounding``: ``half_up`` (``floor(v + 0.5)``, as torchvision's ``save_image`` and so
    LlamaGen's samples) or ``truncate`` (a plain uint8 cast, as Chameleon's ``_pil_from_chw_tensor``).
    """
    check(rounding in ROUNDINGS, f"rounding must be one of {', '.join(ROUNDINGS)}, got {rounding!r}")
    check(images.ndim == 4 and images.shape[1] in (1, 3),
          f"images must be [B, 1 or 3, H, W], got {tuple(images.shape)}")
    x = ((images.detach().float().cpu() + 1.0) / 2.0).clamp(0.0, 1.0)
    offset = 0.5 if rounding == "half_up" else 0.0
    levels = (x * 255.0 + offset).floor().clamp(0, 255).to(torch.uint8)  # [B, C, H, W]
    pixels = levels.permute(0, 2, 3, 1).numpy()  # [B, H, W, C]
    if images.shape[1] == 1:
        return [Image.fromarray(p[..., 0]) for p in pixels]
    return [Image.fromarray(p) for p in pixels]


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


IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")


SQUARINGS = ("lanczos", "adm")


def square_image(path: str | os.PathLike[str], size: int, what: str, squaring: str = "lanczos") -> Tensor:
    """The image file ``path`` as ``[3, size, size]`` in [-1, 1], squared so that real photos of any
    size meet a model at its size; ``what`` (the argument that named it) leads the error of an
    unreadable file. ``squaring``: ``lanczos`` centre-crops to a square, then resizes with Lanczos
    (clean-fid's and LANTERN's evaluation resize: reference images for FID); ``adm`` is ADM's
    ``center_crop_arr``, which LlamaGen and LANTERN train and extract codes with (box-halving while
    the short side is at least twice ``size``, a bicubic resize of the short side to ``size``, then
    the centre crop)."""
    check(squaring in SQUARINGS, f"squaring must be one of {', '.join(SQUARINGS)}, got {squaring!r}")
    if squaring == "lanczos":
        return fitted_image(path, (size, size), what)
    rgb = _read_rgb(path, what)
    while min(rgb.size) >= 2 * size:
        rgb = rgb.resize((rgb.width // 2, rgb.height // 2), resample=Image.Resampling.BOX)
    scale = size / min(rgb.size)
    rgb = rgb.resize((round(rgb.width * scale), round(rgb.height * scale)), resample=Image.Resampling.BICUBIC)
    left, top = (rgb.width - size) // 2, (rgb.height - size) // 2
    return _pixels(rgb.crop((left, top, left + size, top + size)))


def fitted_image(path: str | os.PathLike[str], size: tuple[int, int], what: str) -> Tensor:
    """The image file ``path`` as ``[3, H, W]`` in [-1, 1] for ``size`` = (H, W): the largest centred
    crop of that aspect, resized with Lanczos (clean-fid's resize; a square ``size`` is the square
    centre crop), so that real photos meet a wide or tall model's images at their shape rather than
    squashed from a square."""
    height, width = size
    rgb = _read_rgb(path, what)
    if rgb.width * height > width * rgb.height:  # wider than the target: keep the full height
        crop_w, crop_h = max(1, round(rgb.height * width / height)), rgb.height
    else:
        crop_w, crop_h = rgb.width, max(1, round(rgb.width * height / width))
    left, top = (rgb.width - crop_w) // 2, (rgb.height - crop_h) // 2
    return _pixels(rgb.crop((left, top, left + crop_w, top + crop_h)).resize((width, height),
                                                                             Image.Resampling.LANCZOS))


def _read_rgb(path: str | os.PathLike[str], what: str) -> Image.Image:
    try:
        with Image.open(path) as image:
            return image.convert("RGB")
    except (OSError, ValueError, Image.DecompressionBombError) as e:
        raise LanternError(f"{what}: {path} is not a readable image ({e})") from None


def _pixels(rgb: Image.Image) -> Tensor:
    """[3, H, W] in [-1, 1] of an RGB image."""
    pixels = torch.frombuffer(bytearray(rgb.tobytes()), dtype=torch.uint8).view(rgb.height, rgb.width, 3)
    return pixels.permute(2, 0, 1).float() / 127.5 - 1
