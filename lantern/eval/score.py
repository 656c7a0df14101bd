"""``lantern score``: the quality of folders of images already generated, as ``lantern bench`` scores
its own (FID, KID, precision / recall, class accuracy, CLIP score, HPS), without decoding again.

What LANTERN's ``eval_fid_clip.py``, ``eval_prec_recall.py`` and ``eval_hpsv2.py`` do on the image
folders its ``generate_images.py`` writes, for the folders any job writes: a 50,000-image
``lantern generate`` run on several GPUs, scored afterwards. Images stream from disk in batches
(features, logits and scores are kept; pixels are not), so a folder's size is bounded by its
features, not by memory for its pixels.

A folder ``lantern generate`` wrote is read by its own record: each ``NNNN_labelC.png`` is an image
of class C, each ``NNNN_promptJ.png`` one of ``run.json``'s prompt J (so ``--indices`` runs and
sharded jobs read the same). Any other folder is every image in it (``grid.png`` aside), and its
prompts come from ``--prompts FILE`` by the number in each file name, as LANTERN's scripts match
them (``prompt_12.png``, ``image_12.png`` or ``12.png``: prompt 12).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from lantern.errors import LanternError, check
from lantern.eval.metrics import FeatureExtractor, Features

LANTERN_NAME = re.compile(r"^(\d+)_(label|prompt)(\d+)\.png$")  # lantern generate's file names
NUMBERED = (re.compile(r"(?:prompt|image)_(\d+)\.[A-Za-z]+$"), re.compile(r"(\d+)\.[A-Za-z]+$"))  # LANTERN's
PREVIEW = "grid.png"  # generate's preview, never a sample


@dataclass
class ImageFolder:
    """One folder's images in file-name order, with the class or prompt of each where known."""

    path: Path
    files: list[Path]
    labels: list[int] | None = None  # class ids (lantern's c2i runs)
    prompts: list[str] | None = None  # each image's prompt (lantern's t2i runs, or --prompts FILE)
    source: str = "folder"  # "lantern generate" when read by its run.json
    method: str | None = None  # a lantern run's method and its tokens per target forward (run.json)
    tau: float | None = None

    @classmethod
    def read(cls, folder: str | os.PathLike[str], prompts: Sequence[str] | None = None) -> ImageFolder:
        """``folder``'s images; ``prompts``: a prompt list for a folder lantern did not write (the
        image numbered i is prompt i)."""
        from lantern.images import IMAGE_SUFFIXES

        path = Path(folder)
        check(path.is_dir(), f"score: no such folder {path}")
        named = sorted(p for p in path.iterdir() if LANTERN_NAME.match(p.name))
        if named and (path / "run.json").is_file():
            return cls._lantern(path, named)
        files = sorted(p for p in path.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES and p.name != PREVIEW)
        check(len(files) >= 2, f"score: {path} holds {len(files)} image{'' if len(files) == 1 else 's'} "
                               f"({', '.join(IMAGE_SUFFIXES)}); FID needs 2")
        if prompts is None:
            return cls(path, files)
        return cls(path, files, prompts=[prompts[_number(p, len(prompts))] for p in files])

    @classmethod
    def _lantern(cls, path: Path, files: list[Path]) -> ImageFolder:
        from lantern.io import read_json_object

        run = read_json_object(path / "run.json", "score: run.json")
        names = [LANTERN_NAME.fullmatch(p.name) for p in files]
        kinds = {m[2] for m in names if m is not None}
        check(len(kinds) == 1, f"score: {path} mixes labelled and prompted images")
        values = [int(m[3]) for m in names if m is not None]
        method, stats = run.get("method"), run.get("stats")
        record: dict[str, Any] = {"source": "lantern generate",
                                  "method": method.get("method") if isinstance(method, dict) else None,
                                  "tau": stats.get("mean_accepted") if isinstance(stats, dict) else None}
        if kinds == {"label"}:
            return cls(path, files, labels=values, **record)
        prompts = run.get("prompts")
        check(isinstance(prompts, list) and all(0 <= j < len(prompts) for j in values),
              f"score: {path}/run.json does not list the prompts its file names number")
        assert isinstance(prompts, list)  # (checked above)
        return cls(path, files, prompts=[str(prompts[j]) for j in values], **record)

    def batches(self, batch_size: int) -> Iterator[tuple[int, Tensor]]:
        """(first index, images [b, C, H, W] in [-1, 1]) in file order; every image of one size and mode."""
        shape: tuple[int, ...] | None = None
        for lo in range(0, len(self.files), batch_size):
            chunk = [_read(p) for p in self.files[lo : lo + batch_size]]
            for p, image in zip(self.files[lo : lo + batch_size], chunk, strict=True):
                shape = shape or tuple(image.shape)
                check(tuple(image.shape) == shape, f"score: {p} is {_shape(image)}, but the folder's first image is "
                                                   f"{_shape(torch.empty(shape))}: a folder is one model's samples")
            yield lo, torch.stack(chunk)


def _number(path: Path, count: int) -> int:
    for pattern in NUMBERED:
        match = pattern.search(path.name)
        if match is not None:
            index = int(match[1])
            check(index < count, f"score: {path.name} is image {index}, but --prompts holds {count} prompts")
            return index
    raise LanternError(f"score: {path.name} has no number in its name to find its prompt by (prompt_12.png, "
                       "image_12.png or 12.png: prompt 12)")


def _read(path: Path) -> Tensor:
    """``[C, H, W]`` in [-1, 1] (C = 1 for a grey image, 3 otherwise), as a PNG's bytes say."""
    try:
        with Image.open(path) as image:
            image.load()
            grey = image.mode in ("L", "1") or image.mode.startswith("I;16")
            if image.mode.startswith("I;16"):  # 16-bit grey: its top 8 bits (convert("L") would clip at 255)
                return torch.from_numpy(np.asarray(image, dtype=np.float32) / 257.0)[None] / 127.5 - 1
            pixels = image.convert("L" if grey else "RGB")
    except (OSError, ValueError, Image.DecompressionBombError) as e:
        raise LanternError(f"score: {path} is not a readable image ({e})") from None
    data = torch.frombuffer(bytearray(pixels.tobytes()), dtype=torch.uint8)
    channels = 1 if grey else 3
    return data.view(pixels.height, pixels.width, channels).permute(2, 0, 1).float() / 127.5 - 1


def _shape(image: Tensor) -> str:
    c, h, w = image.shape
    return f"{w}x{h} {'grey' if c == 1 else 'RGB'}"


@dataclass
class FolderScore:
    """One folder's metrics (``score.json``'s row)."""

    folder: str
    images: int
    source: str
    metrics: dict[str, Any] = field(default_factory=dict)
    vs_ar: dict[str, list[str]] | None = None  # with --ar: the metrics worse / better than AR's spread
    method: str | None = None  # a lantern run's, with its tokens per target forward
    tau: float | None = None


def folder_features(folder: ImageFolder, extractor: FeatureExtractor, scorers: Sequence[tuple[str, Any]],
                    batch_size: int = 100, progress: bool = False) -> tuple[Features, dict[str, float]]:
    """The folder's features (and class logits), and the mean of each prompt scorer (``clip_score``,
    ``hps``) over its images, one batch of pixels in memory at a time."""
    from tqdm.auto import tqdm

    from lantern.eval.metrics import extract_features

    parts: list[Features] = []
    sums = {name: 0.0 for name, _ in scorers}
    with tqdm(total=len(folder.files), desc=f"scoring {folder.path.name}", unit="img", disable=not progress,
              dynamic_ncols=True) as bar:
        for lo, images in folder.batches(batch_size):
            parts.append(extract_features(extractor, images, batch_size=batch_size, arg=f"the images of {folder.path}"))
            for name, scorer in scorers:
                assert folder.prompts is not None  # checked by score_folders
                sums[name] += float(scorer.scores(images, folder.prompts[lo : lo + len(images)]).sum())
            bar.update(len(images))
    return merge_features(parts, extractor), {name: total / len(folder.files) for name, total in sums.items()}


def merge_features(parts: Sequence[Features], extractor: FeatureExtractor) -> Features:
    """One set's features from its batches' (class logits too, where the extractor has a head)."""
    logits = [p.logits for p in parts if p.logits is not None]
    return Features(torch.cat([p.features for p in parts]), torch.cat(logits) if len(logits) == len(parts) else None,
                    extractor.name)


def score_folders(folders: Sequence[ImageFolder], real: Features, extractor: FeatureExtractor,
                  scorers: Sequence[tuple[str, Any]] = (), batch_size: int = 100,
                  progress: bool = False) -> list[FolderScore]:
    """Each folder against the reference features ``real`` (one feature space: ``extractor``'s):
    FID, KID, precision / recall, class accuracy (labelled folders, an extractor with a classifier),
    and each of ``scorers`` (``("clip_score", ClipScorer)``, ``("hps", HpsScorer)``) where the
    folder's prompts are known."""
    from lantern.eval.metrics import quality_metrics

    for folder in folders:
        check(not scorers or folder.prompts is not None,
              f"score: {folder.path} has no prompts for {' and '.join(n for n, _ in scorers)}: it is not a prompted "
              "lantern generate run; pass --prompts FILE (LANTERN's scripts' prompt file)")
    rows = []
    for folder in folders:
        features, means = folder_features(folder, extractor, scorers, batch_size, progress)
        labels = torch.tensor(folder.labels) if folder.labels is not None and extractor.has_classifier else None
        q = quality_metrics(real, features, labels, progress=progress)
        metrics: dict[str, Any] = {"fid": q.fid, "kid": q.kid_mean, "kid_std": q.kid_std, "precision": q.precision,
                                   "recall": q.recall}
        if q.class_accuracy is not None:
            metrics["class_accuracy"] = q.class_accuracy
        rows.append(FolderScore(str(folder.path), len(folder.files), folder.source, {**metrics, **means},
                                method=folder.method, tau=folder.tau))
    return rows


def reference_features(extractor: FeatureExtractor, *, images_dir: str | os.PathLike[str] | None, model: Any,
                       num_real: int, size: int, batch_size: int = 100, progress: bool = False) -> tuple[Features, str]:
    """The reference set's features and what it is: a folder of real images (the first ``num_real``,
    centre-cropped and resized with Lanczos to ``size``, streamed as the samples are), else the data
    set of ``model`` (a preset or stack folder) that its samples are compared with in ``bench``."""
    from lantern.eval.metrics import extract_features, reference_images
    from lantern.images import IMAGE_SUFFIXES, square_image

    if images_dir is None:
        images, _ = reference_images(model)
        return extract_features(extractor, images[:num_real], batch_size=batch_size, progress=progress,
                                arg="real images"), f"the data set of {model}"
    folder = Path(images_dir)
    check(folder.is_dir(), f"--reference-images: no such folder {folder}")
    files = sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)[:num_real]
    check(len(files) >= 2, f"--reference-images: {folder} holds {len(files)} images; FID needs 2")
    from tqdm.auto import tqdm

    parts = [extract_features(extractor, torch.stack([square_image(p, size, "--reference-images")
                                                      for p in files[lo : lo + batch_size]]), arg="real images")
             for lo in tqdm(range(0, len(files), batch_size), desc="features (real images)", dynamic_ncols=True,
                            disable=not progress)]
    return merge_features(parts, extractor), f"{len(files)} images of {folder}"


def ar_spread(ar_rows: Sequence[FolderScore], num_real: int, seeds: Sequence[int]) -> Any:
    """AR's spread over its folders (one per seed), as ``bench`` reads a method against it
    (:class:`lantern.eval.report.ARSpread`): precision and class accuracy are fractions of a
    folder's images (the fewest of them), recall of the ``num_real`` real ones."""
    from lantern.eval.report import QUALITY_KEYS, ARSpread

    check(len(ar_rows) >= 2, f"--ar needs AR's folders at 2 seeds or more (a spread), got {len(ar_rows)}")
    values = {k: [float(r.metrics[k]) for r in ar_rows] for k in QUALITY_KEYS
              if all(k in r.metrics for r in ar_rows)}
    images = min(r.images for r in ar_rows)
    counts = {"precision": images, "class_accuracy": images, "recall": num_real}
    return ARSpread(tuple(seeds), values, counts={k: n for k, n in counts.items() if k in values})


def verdict(spread: Any, metrics: dict[str, Any]) -> dict[str, list[str]]:
    """A folder against AR's spread: the judged metrics it is worse on (out when any) and better on."""
    sides = spread.sides(metrics)
    return {"out": [k for k, s in sides.items() if s == "worse"], "better": [k for k, s in sides.items()
                                                                             if s == "better"]}
