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
them (``prompt_12.png``, ``image_12.png`` or ``12.png``: prompt 12). An ``.npz`` in the layout of
the guided-diffusion (ADM) evaluator's sample batches, which ``lantern generate --save-npz`` and
LlamaGen's sampling scripts write (``arr_0``: uint8 [N, H, W, 3]; ``arr_1``: class ids, where
guided-diffusion's class-conditional sampler writes them), is read as a folder is, image i being
prompt i of ``--prompts``; ``--save-npz``'s ``samples.npz`` in its run's folder takes each image's
class or prompt from the run.json beside it.
"""

from __future__ import annotations

import os
import re
import zipfile
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
NPZ_IMAGES, NPZ_LABELS = "arr_0", "arr_1"  # ADM's sample batch: the images, and the classes where known


@dataclass(frozen=True)
class NpzImages:
    """``arr_0`` of an ``.npz`` (uint8 [N, H, W, 3], or [N, H, W] for grey images), read a batch
    at a time from the zip member, as guided-diffusion's evaluator streams it: a 50,000-image array
    of 256 x 256 images is 9.8 GB. numpy's format reader parses the header; the bytes are only
    ever read as uint8, so nothing in the file is unpickled."""

    path: Path
    shape: tuple[int, ...]

    @classmethod
    def open(cls, path: Path, what: str) -> NpzImages:
        try:
            with zipfile.ZipFile(path) as zf:
                names = [n.removesuffix(".npy") for n in zf.namelist()]
                header = None
                if NPZ_IMAGES in names:
                    with zf.open(f"{NPZ_IMAGES}.npy") as f:
                        header = _npy_header(f)
        except (zipfile.BadZipFile, OSError, ValueError, EOFError) as e:
            raise LanternError(f"{what}: {path} is not a readable .npz ({e})") from None
        check(header is not None, f"{what}: {path} has no {NPZ_IMAGES} (the images of an ADM sample batch); it "
                                  f"holds {', '.join(names) or 'nothing'}")
        assert header is not None
        shape, fortran, dtype = header
        grey_or_rgb = len(shape) == 3 or (len(shape) == 4 and shape[3] == 3)
        check(dtype == np.uint8 and not fortran and grey_or_rgb,
              f"{what}: {path}'s {NPZ_IMAGES} is {dtype} {list(shape)}; expected uint8 [N, H, W, 3] (ADM's layout)")
        check(shape[0] >= 2, f"{what}: {path} holds {shape[0]} image{'' if shape[0] == 1 else 's'}; FID needs 2")
        return cls(path, tuple(shape))

    @property
    def count(self) -> int:
        return self.shape[0]

    def labels(self, what: str) -> list[int] | None:
        """``arr_1``: one class id per image, where the file has it."""
        with np.load(self.path, allow_pickle=False) as z:
            if NPZ_LABELS not in z.files:
                return None
            try:
                labels = z[NPZ_LABELS]
            except ValueError as e:  # an array of objects: numpy refuses to unpickle it
                raise LanternError(f"{what}: {self.path}'s {NPZ_LABELS} is not an array of class ids ({e})") from None
        check(labels.dtype.kind in "iu" and labels.shape == (self.count,),
              f"{what}: {self.path}'s {NPZ_LABELS} is {labels.dtype} {list(labels.shape)}; expected one integer class "
              f"id per image, [{self.count}]")
        return [int(v) for v in labels]

    def batches(self, batch_size: int) -> Iterator[tuple[int, Tensor]]:
        """(first index, images [b, C, H, W] in [-1, 1]) in the array's order."""
        n, h, w = self.shape[:3]
        c = self.shape[3] if len(self.shape) == 4 else 1
        item = h * w * c
        with zipfile.ZipFile(self.path) as zf, zf.open(f"{NPZ_IMAGES}.npy") as f:
            _npy_header(f)
            for lo in range(0, n, batch_size):
                b = min(batch_size, n - lo)
                data = f.read(b * item)
                check(len(data) == b * item,
                      f"score: {self.path}'s {NPZ_IMAGES} ends after {lo + len(data) // item} of its {n} images")
                pixels = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(b, h, w, c)
                yield lo, pixels.permute(0, 3, 1, 2).float() / 127.5 - 1


def _npy_header(f: Any) -> tuple[tuple[int, ...], bool, np.dtype[Any]]:
    """(shape, fortran order, dtype) of the .npy stream ``f``, left at the array's first byte."""
    version = np.lib.format.read_magic(f)
    if version == (1, 0):
        return np.lib.format.read_array_header_1_0(f)
    if version == (2, 0):
        return np.lib.format.read_array_header_2_0(f)
    raise ValueError(f".npy format version {version[0]}.{version[1]}; numpy's savez writes 1.0 or 2.0")


@dataclass
class ImageFolder:
    """One folder's images in file-name order, with the class or prompt of each where known."""

    path: Path
    files: list[Path]
    labels: list[int] | None = None  # class ids (lantern's c2i runs)
    prompts: list[str] | None = None  # each image's prompt (lantern's t2i runs, or --prompts FILE)
    source: str = "folder"  # "lantern generate" when read by its run.json, "npz" for an ADM sample batch
    method: str | None = None  # a lantern run's method and its tokens per target forward (run.json)
    tau: float | None = None
    npz: NpzImages | None = None  # the images of an .npz (``files`` is then empty)

    @property
    def count(self) -> int:
        return self.npz.count if self.npz is not None else len(self.files)

    @classmethod
    def read(cls, folder: str | os.PathLike[str], prompts: Sequence[str] | None = None) -> ImageFolder:
        """``folder``'s images (a folder, or an ADM sample batch ``.npz``); ``prompts``: a prompt
        list for images lantern did not name (the image numbered i is prompt i)."""
        from lantern.images import IMAGE_SUFFIXES

        path = Path(folder)
        if path.suffix.lower() == ".npz" and not path.is_dir():
            return cls._npz(path, prompts)
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
    def _npz(cls, path: Path, prompts: Sequence[str] | None) -> ImageFolder:
        from lantern.jobs import NPZ_NAME

        check(path.is_file(), f"score: no such file {path}")
        npz = NpzImages.open(path, "score")
        labels = npz.labels("score")
        if prompts is not None:
            check(len(prompts) >= npz.count, f"score: {path} holds {npz.count} images, but --prompts holds "
                                             f"{len(prompts)} prompts")
            prompts = list(prompts[: npz.count])
        elif labels is None and path.name == NPZ_NAME and (path.parent / "run.json").is_file():
            return cls._npz_of_run(path, npz)  # lantern generate --save-npz: its run.json names each image
        return cls(path, [], labels=labels, prompts=None if prompts is None else list(prompts), source="npz", npz=npz)

    @classmethod
    def _npz_of_run(cls, path: Path, npz: NpzImages) -> ImageFolder:
        """``--save-npz``'s file, in the order of the run's images: run.json's ``labels`` (one per
        image), or its ``prompts`` with each image's ``prompt_index``."""
        from lantern.io import read_json_object

        run = read_json_object(path.parent / "run.json", "score: run.json")
        labels = run.get("labels")
        per_image = labels if labels is not None else run.get("prompt_index")
        check(isinstance(per_image, list) and len(per_image) == npz.count,
              f"score: {path.parent}/run.json does not describe the {npz.count} images of {path.name} (a run's own "
              f"record names each image's class or prompt); score a copy of {path.name} kept apart from it")
        record = _run_record(run)
        if labels is not None:
            return cls(path, [], labels=[int(v) for v in labels], npz=npz, **record)
        assert isinstance(per_image, list)  # (checked above)
        return cls(path, [], prompts=_run_prompts(run, per_image, path.parent), npz=npz, **record)

    @classmethod
    def _lantern(cls, path: Path, files: list[Path]) -> ImageFolder:
        from lantern.io import read_json_object

        run = read_json_object(path / "run.json", "score: run.json")
        names = [LANTERN_NAME.fullmatch(p.name) for p in files]
        kinds = {m[2] for m in names if m is not None}
        check(len(kinds) == 1, f"score: {path} mixes labelled and prompted images")
        values = [int(m[3]) for m in names if m is not None]
        record = _run_record(run)
        if kinds == {"label"}:
            return cls(path, files, labels=values, **record)
        return cls(path, files, prompts=_run_prompts(run, values, path), **record)

    def batches(self, batch_size: int) -> Iterator[tuple[int, Tensor]]:
        """(first index, images [b, C, H, W] in [-1, 1]) in file order; every image of one size and mode."""
        if self.npz is not None:
            yield from self.npz.batches(batch_size)
            return
        shape: tuple[int, ...] | None = None
        for lo in range(0, len(self.files), batch_size):
            chunk = [_read(p) for p in self.files[lo : lo + batch_size]]
            for p, image in zip(self.files[lo : lo + batch_size], chunk, strict=True):
                shape = shape or tuple(image.shape)
                check(tuple(image.shape) == shape, f"score: {p} is {_shape(image)}, but the folder's first image is "
                                                   f"{_shape(torch.empty(shape))}: a folder is one model's samples")
            yield lo, torch.stack(chunk)


def _run_prompts(run: dict[str, Any], index: list[Any], folder: Path) -> list[str]:
    """Each image's prompt: run.json's ``prompts`` at the image's prompt number."""
    prompts = run.get("prompts")
    check(isinstance(prompts, list) and all(isinstance(j, int) and 0 <= j < len(prompts) for j in index),
          f"score: {folder}/run.json does not list the prompts its images number")
    assert isinstance(prompts, list)  # (checked above)
    return [str(prompts[j]) for j in index]


def _run_record(run: dict[str, Any]) -> dict[str, Any]:
    """What a row says of a lantern generate run: its source, method and tokens per target forward."""
    method, stats = run.get("method"), run.get("stats")
    return {"source": "lantern generate", "method": method.get("method") if isinstance(method, dict) else None,
            "tau": stats.get("mean_accepted") if isinstance(stats, dict) else None}


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
    with tqdm(total=folder.count, desc=f"scoring {folder.path.name}", unit="img", disable=not progress,
              dynamic_ncols=True) as bar:
        for lo, images in folder.batches(batch_size):
            parts.append(extract_features(extractor, grey_as_stored(images, extractor), batch_size=batch_size,
                                          arg=f"the images of {folder.path}"))
            for name, scorer in scorers:
                assert folder.prompts is not None  # checked by score_folders
                sums[name] += float(scorer.scores(images, folder.prompts[lo : lo + len(images)]).sum())
            bar.update(len(images))
    return merge_features(parts, extractor), {name: total / folder.count for name, total in sums.items()}


def grey_as_stored(images: Tensor, extractor: FeatureExtractor) -> Tensor:
    """ADM's layout is RGB even for grey images (``--save-npz`` repeats a grey PNG's one channel
    three times): for a feature net of grey images, three equal channels are that channel. Colour
    images stay as they are (and the net refuses them)."""
    if extractor.in_channels == 1 and images.shape[1] == 3 and torch.equal(images[:, :1].expand_as(images), images):
        return images[:, :1]
    return images


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
        rows.append(FolderScore(str(folder.path), folder.count, folder.source, {**metrics, **means},
                                method=folder.method, tau=folder.tau))
    return rows


def reference_features(extractor: FeatureExtractor, *, images_dir: str | os.PathLike[str] | None, model: Any,
                       num_real: int, size: tuple[int, int], batch_size: int = 100,
                       progress: bool = False) -> tuple[Features, str]:
    """The reference set's features and what it is: a folder of real images (the first ``num_real``,
    centre-cropped to the aspect of ``size`` = (H, W) and resized with Lanczos to it, streamed as the
    samples are), else the data set of ``model`` (a preset or stack folder) that its samples are
    compared with in ``bench``."""
    from lantern.eval.metrics import extract_features, reference_images
    from lantern.images import IMAGE_SUFFIXES, fitted_image

    if images_dir is None:
        images, _ = reference_images(model)
        return extract_features(extractor, images[:num_real], batch_size=batch_size, progress=progress,
                                arg="real images"), f"the data set of {model}"
    folder = Path(images_dir)
    if folder.suffix.lower() == ".npz" and folder.is_file():  # ADM's reference batch: images as they are
        return _npz_reference(extractor, NpzImages.open(folder, "--reference-images"), num_real, batch_size, progress)
    check(folder.is_dir(), f"--reference-images: no such folder or .npz {folder}")
    files = sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)[:num_real]
    check(len(files) >= 2, f"--reference-images: {folder} holds {len(files)} images; FID needs 2")
    from tqdm.auto import tqdm

    parts = [extract_features(extractor, torch.stack([fitted_image(p, size, "--reference-images")
                                                      for p in files[lo : lo + batch_size]]), arg="real images")
             for lo in tqdm(range(0, len(files), batch_size), desc="features (real images)", dynamic_ncols=True,
                            disable=not progress)]
    return merge_features(parts, extractor), f"{len(files)} images of {folder}"


def _npz_reference(extractor: FeatureExtractor, npz: NpzImages, num_real: int, batch_size: int,
                   progress: bool) -> tuple[Features, str]:
    """The first ``num_real`` images of an ADM reference batch (already at the samples' size: the
    evaluator's ``VIRTUAL_imagenet256_labeled.npz`` is 256 x 256), streamed."""
    from tqdm.auto import tqdm

    from lantern.eval.metrics import extract_features

    count = min(num_real, npz.count)
    parts = []
    with tqdm(total=count, desc="features (real images)", unit="img", dynamic_ncols=True, disable=not progress) as bar:
        for lo, images in npz.batches(batch_size):
            if lo >= count:
                break
            images = grey_as_stored(images[: count - lo], extractor)
            parts.append(extract_features(extractor, images, arg="real images"))
            bar.update(min(len(images), count - lo))
    return merge_features(parts, extractor), f"{count} images of {npz.path}"


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
