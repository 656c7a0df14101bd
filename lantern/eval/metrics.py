"""Offline image-quality metrics: FID, KID, precision/recall and class accuracy in a feature space.

**These are not Inception FIDs.** By default the feature space is the embedding of a small CNN
classifier that lantern trained on the real training images of the same data set
(:mod:`lantern.train.features`; each preset ships one in ``lantern/presets/NAME/features``).
Values rank image sets *within one data set and one feature network*; they are not comparable with
published FID/KID numbers, nor across feature networks. When Inception or CLIP weights are on
disk, the same functions run in those feature spaces instead (``torchscript:PATH``, ``clip:DIR``).

Images everywhere are lantern's float tensors ``[N, C, H, W]`` in ``[-1, 1]`` (the data sets'
``pixel / 127.5 - 1``, which is also what the tokenizer decodes to).

Features are extracted once per image set (:func:`extract_features`) and every metric is computed
from them: FID and KID use torchmetrics' own math (``FrechetInceptionDistance`` /
``KernelInceptionDistance`` fed the precomputed float64 features through a pass-through
``feature`` module), precision/recall (Kynkäänniemi et al. 2019) and class accuracy are computed
here. torchmetrics is an optional dependency: ``pip install 'lantern-ar[bench]'``.

Typical use from a benchmark::

    extractor = load_feature_extractor("photos")
    real, _ = reference_images("photos", num_samples=500)      # see its docstring for photos
    real_features = extract_features(extractor, real)          # once, reused for every method
    m = quality_metrics(real_features, fake_images, fake_labels, extractor)
    print(m.summary())
"""

from __future__ import annotations

import math
import os
import warnings
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lantern.errors import LanternError, check

NetT = TypeVar("NetT", bound=nn.Module)
NOT_INCEPTION = ("feature-space metrics of a lantern-trained network unless stated otherwise; "
                 "not comparable with published (Inception) FID/KID")
BENCH_HINT = "pip install 'lantern-ar[bench]'"
FEATURES_DIR = "features"  # a stack's feature net: STACK/features
DEFAULT_K = 3  # Kynkäänniemi et al. use k = 3
DEFAULT_KID_SUBSETS = 100
MAX_KID_SUBSET = 1000  # torchmetrics' default subset size, capped at the set sizes
# OpenAI CLIP preprocessing constants, used when a CLIP folder has no preprocessor_config.json.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


# ----------------------------------------------------------------------------------------------
# Feature extractors
# ----------------------------------------------------------------------------------------------


class FeatureExtractor(nn.Module, ABC):
    """Images ``[N, C, H, W]`` in ``[-1, 1]`` -> features ``[N, dim]``.

    ``name`` describes the feature space for printing next to the numbers. ``in_channels`` /
    ``image_size`` are ``None`` where any value is accepted (the extractor adapts the images).
    Extractors with a classifier head also give class logits from their features.
    """

    name: str
    dim: int
    in_channels: int | None = None
    image_size: int | None = None
    num_classes: int | None = None

    @abstractmethod
    def _extract(self, images: Tensor) -> Tensor:
        """Validated images (on the extractor's device) -> features ``[N, dim]``."""

    def classify_features(self, features: Tensor) -> Tensor | None:
        """Class logits ``[N, num_classes]`` from this extractor's features, or None (no head)."""
        return None

    @property
    def has_classifier(self) -> bool:
        return self.num_classes is not None

    @property
    def device(self) -> torch.device:
        p = next(iter(self.parameters()), None)
        return p.device if p is not None else torch.device("cpu")

    def check_images(self, images: Tensor, arg: str = "images") -> None:
        """Raise :class:`LanternError` (naming ``arg``) unless ``images`` fits this extractor."""
        check(isinstance(images, Tensor), f"{arg} must be a tensor, got {type(images).__name__}")
        check(images.dim() == 4, f"{arg} must be [N, C, H, W], got shape {tuple(images.shape)}")
        check(images.is_floating_point(), f"{arg} must be a float tensor in [-1, 1], got {images.dtype}")
        c, h, w = images.shape[1:]
        if self.in_channels is None:
            check(c in (1, 3), f"{arg} must have 1 or 3 channels, got {c} (shape {tuple(images.shape)})")
        else:
            check(c == self.in_channels,
                  f"{arg} have {c} channels but {self.name} takes {self.in_channels}-channel images")
        if self.image_size is not None:
            check(h == w == self.image_size,
                  f"{arg} are {h}x{w} but {self.name} was trained on {self.image_size}x{self.image_size} images")

    def forward(self, images: Tensor) -> Tensor:
        self.check_images(images)
        # Clipped to [-1, 1] as when saving a PNG: decoders can overshoot slightly.
        return self._extract(images.to(self.device, torch.float32).clamp(-1, 1))


class LanternFeatureExtractor(FeatureExtractor):
    """The embedding of a lantern feature net (:class:`lantern.models.features.FeatureNet`)."""

    def __init__(self, net: Any, name: str | None = None, metrics: dict[str, float] | None = None) -> None:
        super().__init__()
        cfg = net.config
        self.net = net.eval()
        self.dim, self.in_channels, self.image_size = cfg.feature_dim, cfg.in_channels, cfg.image_size
        self.num_classes = cfg.num_classes
        self.metrics = dict(metrics or {})  # the training run's final metrics (provenance.json)
        shown = (("test_accuracy", "test acc"), ("fresh_crops_accuracy", "fresh-crop acc"))
        acc = "".join(f", {label} {self.metrics[key]:.3f}" for key, label in shown if key in self.metrics)
        self.name = f"lantern feature net {name or 'folder'} ({self.dim}-d{acc})"

    @classmethod
    def from_folder(cls, folder: str | os.PathLike[str], label: str | None = None) -> LanternFeatureExtractor:
        """Load a folder written by ``lantern train-features`` (its provenance.json gives the accuracy)."""
        from lantern.io import read_json_object
        from lantern.models.features import FeatureNet

        folder = Path(folder)
        metrics = None
        if (folder / "provenance.json").is_file():
            metrics = read_json_object(folder / "provenance.json", "feature net provenance").get("metrics")
        return cls(FeatureNet.from_pretrained(folder), label or str(folder), metrics)

    def _extract(self, images: Tensor) -> Tensor:
        return self.net.features(images)

    def classify_features(self, features: Tensor) -> Tensor:
        return self.net.classify_features(features.to(self.device, torch.float32))


def _to_rgb(images: Tensor) -> Tensor:
    return images.expand(-1, 3, -1, -1) if images.shape[1] == 1 else images


def _resize(images: Tensor, size: int, mode: str) -> Tensor:
    if images.shape[-2:] == (size, size):
        return images
    # Antialias matters only when shrinking; it is a no-op when enlarging small images.
    return F.interpolate(images, size=(size, size), mode=mode, align_corners=False, antialias=True)


def _require_trust(path: Path, trust: bool | None) -> None:
    """A TorchScript file is a program: its ``forward()`` runs whatever its author wrote (a loop
    that never ends hangs ``bench``; it can read and write files). Like a pickle that is more than
    tensors, it is loaded only when the user vouches for it (``--trust-checkpoint``, or
    ``trust_checkpoint=True`` in Python), and then after a warning."""
    from lantern.io import TRUST_FLAG, LanternWarning, checkpoints_trusted

    if not (checkpoints_trusted() if trust is None else trust):
        raise LanternError(f"--feature-net torchscript:{path}: a TorchScript file runs its own code, so lantern "
                           f"loads it only with {TRUST_FLAG} (trust_checkpoint=True in Python)")
    warnings.warn(f"--feature-net torchscript:{path}: running the file's TorchScript code ({TRUST_FLAG})",
                  LanternWarning, stacklevel=4)


class TorchScriptFeatureExtractor(FeatureExtractor):
    """A TorchScript feature network, e.g. clean-fid's ``inception-2015-12-05.pt``.

    Images are repeated to 3 channels if grey, resized (bilinear) to ``input_size`` and mapped
    to ``0..255`` floats, the input convention of that file (2048-d pool features). If the
    script's ``forward`` has a ``return_features`` argument (the StyleGAN2-ADA export) it is set.
    The resize differs from clean-fid's PIL resize, so values are close to, not equal to, its FIDs.
    """

    def __init__(self, path: str | os.PathLike[str], input_size: int = 299, *, trust: bool | None = None) -> None:
        super().__init__()
        path = Path(path)
        check(path.is_file(), f"torchscript feature network not found: {path}")
        _require_trust(path, trust)
        try:
            with warnings.catch_warnings():  # torch >= 2.9 deprecates TorchScript; these files are TorchScript
                warnings.filterwarnings("ignore", category=DeprecationWarning)
                module = torch.jit.load(str(path), map_location="cpu")
        except Exception as e:  # a TorchScript deserialisation error is not actionable as is
            raise LanternError(f"torchscript:{path} is not a TorchScript file: {e}") from None
        self.module = module.eval()
        check(isinstance(input_size, int) and input_size >= 1, f"input_size must be >= 1, got {input_size!r}")
        self.input_size = input_size
        schema = getattr(getattr(module, "forward", None), "schema", None)
        self._return_features = schema is not None and any(a.name == "return_features" for a in schema.arguments)
        self.name = f"torchscript {path.name}"
        with torch.no_grad():
            self.dim = int(self._extract(torch.zeros(1, 3, input_size, input_size)).shape[1])
        self.name = f"torchscript {path.name} ({self.dim}-d, {input_size}px)"

    @property
    def device(self) -> torch.device:
        p = next(iter(self.module.parameters()), None)
        return p.device if p is not None else torch.device("cpu")

    def _extract(self, images: Tensor) -> Tensor:
        x = (_resize(_to_rgb(images), self.input_size, "bilinear").clamp(-1, 1) + 1) * 127.5
        out = self.module(x, return_features=True) if self._return_features else self.module(x)
        check(isinstance(out, Tensor) and out.dim() >= 2 and out.shape[0] == x.shape[0],
              f"{self.name} must return features [N, d], "
              f"got {getattr(out, 'shape', type(out))}")
        return out.reshape(out.shape[0], -1).float()


class Vgg16FeatureExtractor(FeatureExtractor):
    """VGG16's fc2 activations (4096-d, before their ReLU), the features of the improved precision
    and recall (Kynkäänniemi et al. 2019) as LANTERN's ``eval_prec_recall.py`` computes them:
    torchvision's ImageNet VGG16 (``vgg16-397923af.pth``, or its safetensors;
    :class:`lantern.models.metric_nets.Vgg16`), images resized to 224 x 224 (bilinear) and
    normalised with ImageNet's mean and std. The file is a plain state dict, read without running
    code. The resize is torch's, not PIL's, so values are close to, not equal to, that script's."""

    mean: Tensor  # buffers [1, 3, 1, 1] (register_buffer)
    std: Tensor
    input_size = 224

    def __init__(self, path: str | os.PathLike[str]) -> None:
        super().__init__()
        from lantern.models.metric_nets import IMAGENET_MEAN, IMAGENET_STD, Vgg16

        path = Path(path)
        check(path.is_file(), f"--feature-net vgg16:{path}: no such file (torchvision's vgg16-397923af.pth)")
        self.net = _load_net(Vgg16(), path, f"--feature-net vgg16:{path}", "torchvision's vgg16-397923af.pth",
                             "torchvision's VGG16")
        self.register_buffer("mean", torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(IMAGENET_STD).view(1, 3, 1, 1), persistent=False)
        self.dim = 4096
        self.name = f"VGG16 fc2 {path.name} (4096-d, 224px)"

    def _extract(self, images: Tensor) -> Tensor:
        x = (_resize(_to_rgb(images), self.input_size, "bilinear") + 1) / 2
        return self.net.fc2_features((x - self.mean) / self.std)


def _load_net(net: NetT, path: Path, what: str, expected: str, model: str) -> NetT:
    """``net`` with the plain state dict of ``path`` (pickled, read without running code, or
    safetensors), strictly; batch-norm counters an older save left out are the net's own."""
    from lantern.io import load_checkpoint, load_safetensors, load_state_dict_strict

    state = load_safetensors(path, what) if path.suffix == ".safetensors" else load_checkpoint(path, what)
    check(isinstance(state, dict) and all(isinstance(v, Tensor) for v in state.values()),
          f"{what}: expected a state dict of tensors ({expected}), got {type(state).__name__}")
    load_state_dict_strict(net, state, f"{what} ({model})", own=("num_batches_tracked",))
    net.eval()
    return net


class InceptionFeatureExtractor(FeatureExtractor):
    """The FID Inception network (TensorFlow's 2015-12-05 graph) as pytorch-fid runs it
    (:class:`lantern.models.metric_nets.FidInceptionV3`): its
    ``pt_inception-2015-12-05-6726825d.pth``, a plain state dict read without running code, and
    the 2048-d pool features of images in [0, 1] resized to 299 x 299 (bilinear, no antialias)
    and scaled to [-1, 1]. FIDs in this space are pytorch-fid's (and torchmetrics'), close to
    TensorFlow's; torchvision's own Inception weights are another network."""

    input_size = 299

    def __init__(self, path: str | os.PathLike[str]) -> None:
        super().__init__()
        from lantern.models.metric_nets import FidInceptionV3

        path = Path(path)
        check(path.is_file(), f"--feature-net inception:{path}: no such file (pytorch-fid's "
                              "pt_inception-2015-12-05-6726825d.pth)")
        self.net = _load_net(FidInceptionV3(), path, f"--feature-net inception:{path}",
                             "pytorch-fid's pt_inception-2015-12-05-6726825d.pth", "the FID Inception")
        self.dim = 2048
        self.name = f"FID Inception {path.name} (2048-d, 299px)"

    def _extract(self, images: Tensor) -> Tensor:
        x = F.interpolate((_to_rgb(images) + 1) / 2, size=(self.input_size, self.input_size), mode="bilinear",
                          align_corners=False)
        return self.net.pool_features(2 * x - 1)


class ClipFeatureExtractor(FeatureExtractor):
    """``image_embeds`` of a local Hugging Face CLIP vision folder (``CLIPVisionModelWithProjection``).

    Grey images are repeated to 3 channels, resized (bicubic) to the model's ``image_size`` and
    normalised with the folder's ``preprocessor_config.json`` mean/std (OpenAI's if absent). The
    projected embeddings are used unnormalised.
    """

    mean: Tensor  # buffers [1, 3, 1, 1] (register_buffer)
    std: Tensor

    def __init__(self, folder: str | os.PathLike[str], model: Any = None) -> None:
        """``model``: a vision tower already built (HPS's weights on the folder's config); else the folder's."""
        super().__init__()
        try:
            from transformers import CLIPVisionModelWithProjection
        except ImportError as e:
            raise LanternError("clip: feature extraction needs the 'transformers' package: pip install transformers") \
                from e
        from lantern.io import read_json_object

        folder = Path(folder)
        check(folder.is_dir(), f"clip: no such CLIP folder {folder}")
        try:
            self.model = (model if model is not None else
                          CLIPVisionModelWithProjection.from_pretrained(str(folder), local_files_only=True)).eval()
        except (OSError, ValueError) as e:
            raise LanternError(f"clip:{folder} is not a CLIP vision model folder: {e}") from None
        mean, std = CLIP_MEAN, CLIP_STD
        if (folder / "preprocessor_config.json").is_file():
            pre = read_json_object(folder / "preprocessor_config.json", "CLIP preprocessor config")
            mean, std = tuple(pre.get("image_mean", mean)), tuple(pre.get("image_std", std))
        self.register_buffer("mean", torch.tensor(mean).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(std).view(1, 3, 1, 1), persistent=False)
        self.input_size = int(self.model.config.image_size)
        self.dim = int(self.model.config.projection_dim)
        self.name = f"CLIP vision {folder.name} ({self.dim}-d, {self.input_size}px)"

    def _extract(self, images: Tensor) -> Tensor:
        x = (_resize(_to_rgb(images), self.input_size, "bicubic").clamp(-1, 1) + 1) / 2
        return self.model(pixel_values=(x - self.mean) / self.std).image_embeds.float()


class ClipScorer:
    """CLIP score of images against their prompts: ``100 * max(cos(image, text), 0)`` of CLIP's
    projected embeddings, per image (Hessel et al. 2021, as torchmetrics' ``CLIPScore`` defines it,
    by default without a prefix). ``folder``: a local Hugging Face CLIP folder with both towers and
    its tokenizer (openai/clip-vit-base-patch32). Images are preprocessed as
    :class:`ClipFeatureExtractor` does; ``prefix`` + each prompt is cut at the text tower's length
    (77 tokens). LANTERN's evaluation ([LANTERN code] eval_fid_clip.py) reports the plain mean
    cosine with ViT-B/32 and the prefix "A photo depicts ": this score / 100 with that prefix,
    where no cosine is negative."""

    def __init__(self, folder: str | os.PathLike[str], device: torch.device | str = "cpu", prefix: str = "") -> None:
        try:
            from transformers import AutoTokenizer, CLIPTextModelWithProjection
        except ImportError as e:
            raise LanternError("--clip-score needs the 'transformers' package: pip install transformers") from e
        folder = Path(folder)
        check(folder.is_dir(), f"--clip-score: no such CLIP folder {folder}")
        try:
            self.text = CLIPTextModelWithProjection.from_pretrained(str(folder), local_files_only=True).eval()
            self.tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        except (OSError, ValueError, RuntimeError) as e:  # RuntimeError: transformers' weights that do not fit
            raise LanternError(f"--clip-score: {folder} is not a CLIP folder with a text tower and a tokenizer: "
                               f"{str(e).splitlines()[0]}") from None
        self.vision = ClipFeatureExtractor(folder)
        self.text.to(device)
        self.vision.to(device)
        self.max_length = int(self.text.config.max_position_embeddings)
        self.prefix = prefix
        self.name = f"CLIP score, {folder.name}" + (f", prompts after {prefix!r}" if prefix else "")

    def scores(self, images: Tensor, prompts: Sequence[str], batch_size: int = 64) -> Tensor:
        """[N] CLIP scores of ``images`` [N, C, H, W] in [-1, 1] against ``prompts`` (one each)."""
        return 100 * self.cosines(images, prompts, batch_size).clamp(min=0)

    @torch.no_grad()
    def cosines(self, images: Tensor, prompts: Sequence[str], batch_size: int = 64) -> Tensor:
        """[N] cosines of each image's and its prompt's projected embeddings."""
        check(len(prompts) == images.shape[0], f"CLIP score: {images.shape[0]} images, {len(prompts)} prompts")
        out = []
        for lo in range(0, len(prompts), batch_size):
            device = self.vision.mean.device
            image = self.vision._extract(images[lo : lo + batch_size].to(device))
            texts = [self.prefix + p for p in prompts[lo : lo + batch_size]]
            tokens = self.tokenizer(texts, padding=True, truncation=True, max_length=self.max_length,
                                    return_tensors="pt").to(device)
            text = self.text(input_ids=tokens["input_ids"], attention_mask=tokens["attention_mask"]).text_embeds
            out.append(F.cosine_similarity(image, text.float(), dim=-1))
        return torch.cat(out).cpu()


def folder_images(folder: str | os.PathLike[str], size: int | tuple[int, int], limit: int,
                  what: str = "--reference-images") -> Tensor:
    """The first ``limit`` images of ``folder`` (file-name order) as ``[N, 3, H, W]`` in [-1, 1] for
    ``size`` = (H, W) (an int: square): each centre-cropped to that aspect and resized with Lanczos
    (as clean-fid and LANTERN's evaluation resize), so that real photos of any size meet generated
    images at their size and shape."""
    from lantern.images import IMAGE_SUFFIXES, fitted_image

    folder = Path(folder)
    check(folder.is_dir(), f"{what}: no such folder {folder}")
    files = sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)[:limit]
    check(len(files) >= 2, f"{what}: {folder} holds {len(files)} images ({', '.join(IMAGE_SUFFIXES)}); FID needs 2")
    shape = (size, size) if isinstance(size, int) else size
    out = torch.empty(len(files), 3, *shape)
    for i, path in enumerate(files):
        out[i] = fitted_image(path, shape, what)
    return out


def feature_net_dir(model: str | os.PathLike[str]) -> Path:
    """The lantern feature net folder of a preset name or stack folder (``STACK/features``)."""
    from lantern.targets.llamagen_stack import resolve_model_dir

    root = resolve_model_dir(model)
    folder = root / FEATURES_DIR
    check(folder.is_dir(), f"{root} has no {FEATURES_DIR}/ feature net; train one with `lantern train-features` "
                           f"(scripts/train_features.sh)")
    return folder


def default_feature_net(root: str | os.PathLike[str], speed_only: str = "--no-quality") -> str:
    """The feature net quality is scored with when none is named: the model folder's
    ``features/`` (the presets have one). A folder without one (a downloaded Janus, Emu3 or
    Chameleon model) is refused in one line saying what to pass; it used to be taken as a feature
    net itself and refused for its model_type. ``speed_only``: the command's flag for no quality."""
    folder = Path(root)
    check((folder / FEATURES_DIR).is_dir(),
          f"--model {folder} has no {FEATURES_DIR}/ feature net to score quality with: pass --feature-net (a "
          f"lantern feature net folder, made by `lantern train-features`; inception:PATH; clip:DIR; "
          f"torchscript:PATH; or vgg16:PATH), or {speed_only} to measure speed only")
    return str(folder)


def load_feature_extractor(spec: str | os.PathLike[str], *, device: str | torch.device = "cpu",
                           input_size: int = 299, trust_checkpoint: bool | None = None) -> FeatureExtractor:
    """A feature extractor from ``spec``:

    - ``digits`` / ``photos`` or a stack folder: its lantern feature net (``STACK/features``);
    - a lantern feature net folder (``config.json`` with ``model_type`` ``lantern-feature-net``);
    - ``torchscript:PATH``: a TorchScript file such as clean-fid's ``inception-2015-12-05.pt``
      (resized to ``input_size``); it runs the file's code, so only with ``trust_checkpoint=True``
      (None: ``--trust-checkpoint``'s setting, :func:`lantern.io.trusted_checkpoints`);
    - ``clip:DIR``: a local Hugging Face CLIP folder (needs ``transformers``);
    - ``vgg16:PATH``: torchvision's ImageNet VGG16 weights, whose fc2 features LANTERN's precision
      and recall use (:class:`Vgg16FeatureExtractor`);
    - ``inception:PATH``: pytorch-fid's FID Inception weights (:class:`InceptionFeatureExtractor`).
    """
    text = str(spec)
    check(bool(text), "feature extractor spec must not be empty")
    if text.startswith("torchscript:"):
        extractor: FeatureExtractor = TorchScriptFeatureExtractor(text[len("torchscript:"):], input_size,
                                                                trust=trust_checkpoint)
    elif text.startswith("vgg16:"):
        extractor = Vgg16FeatureExtractor(text[len("vgg16:"):])
    elif text.startswith("inception:"):
        extractor = InceptionFeatureExtractor(text[len("inception:"):])
    elif text.startswith("clip:"):
        extractor = ClipFeatureExtractor(text[len("clip:"):])
    else:
        extractor = _load_lantern_extractor(text)
    return extractor.to(device).eval()


def _load_lantern_extractor(text: str) -> FeatureExtractor:
    from lantern.io import read_json_object
    from lantern.models.features import MODEL_TYPE
    from lantern.targets.base import PRESETS

    if text in PRESETS:
        return LanternFeatureExtractor.from_folder(feature_net_dir(text), text)
    path = Path(text)
    if not path.exists():
        raise LanternError(f"feature extractor {text!r}: no such file or folder; expected a preset "
                           f"({', '.join(PRESETS)}), a stack or feature net folder, torchscript:PATH, clip:DIR, "
                           "vgg16:PATH or inception:PATH")
    if path.is_dir() and (path / FEATURES_DIR).is_dir():
        return LanternFeatureExtractor.from_folder(path / FEATURES_DIR, str(path))
    if path.is_dir() and (path / "config.json").is_file():
        model_type = read_json_object(path / "config.json", "model config").get("model_type")
        if model_type == MODEL_TYPE:
            return LanternFeatureExtractor.from_folder(path)
        raise LanternError(f"feature extractor {text!r} holds model_type {model_type!r}, not a lantern feature net; "
                           "for a CLIP folder write clip:DIR")
    raise LanternError(f"feature extractor {text!r} is neither a stack folder with {FEATURES_DIR}/ nor a feature net "
                       "folder; for a TorchScript file write torchscript:PATH")


# ----------------------------------------------------------------------------------------------
# Features
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Features:
    """Features of one image set: extract once, reuse for every metric and every comparison."""

    features: Tensor  # float64 [N, d]
    logits: Tensor | None  # float32 [N, classes] for extractors with a classifier head
    extractor: str  # the extractor's name

    def __len__(self) -> int:
        return int(self.features.shape[0])


@torch.no_grad()
def extract_features(extractor: FeatureExtractor, images: Tensor, *, batch_size: int = 100,
                     progress: bool = False, arg: str = "images") -> Features:
    """Run ``extractor`` over ``images`` (``[N, C, H, W]`` in ``[-1, 1]``) in batches."""
    from tqdm.auto import tqdm

    check(isinstance(batch_size, int) and batch_size >= 1, f"batch_size must be an integer >= 1, got {batch_size!r}")
    extractor.check_images(images, arg)
    extractor.eval()
    feats, logits = [], []
    for lo in tqdm(range(0, images.shape[0], batch_size), desc=f"features ({arg})", disable=not progress,
                   dynamic_ncols=True):
        f = extractor(images[lo : lo + batch_size])
        feats.append(f.double().cpu())
        if extractor.has_classifier:
            scores = extractor.classify_features(f)
            assert scores is not None  # an extractor with classes has a head (LanternFeatureExtractor)
            logits.append(scores.float().cpu())
    if not feats:
        return Features(torch.empty(0, extractor.dim, dtype=torch.float64), None, extractor.name)
    out = torch.cat(feats)
    check(bool(torch.isfinite(out).all()), f"{extractor.name} returned non-finite features for {arg}")
    return Features(out, torch.cat(logits) if logits else None, extractor.name)


# ----------------------------------------------------------------------------------------------
# FID and KID (torchmetrics' math on precomputed features)
# ----------------------------------------------------------------------------------------------


def _torchmetrics_image() -> Any:
    try:
        from torchmetrics.image.fid import FrechetInceptionDistance
        from torchmetrics.image.kid import KernelInceptionDistance
    except ImportError as e:
        raise LanternError(f"FID/KID need the 'torchmetrics' package, which is not installed: {BENCH_HINT}") from e
    return FrechetInceptionDistance, KernelInceptionDistance


class _Precomputed(nn.Module):
    """torchmetrics ``feature`` module whose "images" are already features: identity, in float64.

    torchmetrics takes the feature size from ``num_features`` (no dummy forward), accumulates in
    float64 and returns FID in the features' dtype, so float64 features give a float64 FID.
    """

    def __init__(self, num_features: int) -> None:
        super().__init__()
        self.num_features = num_features

    def forward(self, x: Tensor) -> Tensor:
        return x.double()


def _check_feature_pair(real: Tensor, fake: Tensor, minimum: int = 2) -> None:
    for arg, f in (("real", real), ("fake", fake)):
        check(isinstance(f, Tensor) and f.dim() == 2, f"{arg} features must be [N, d], got "
              f"{tuple(f.shape) if isinstance(f, Tensor) else type(f).__name__}")
        check(f.shape[0] >= minimum, f"{arg}: need at least {minimum} images, got {f.shape[0]}")
    check(real.shape[1] == fake.shape[1],
          f"real and fake features differ in size ({real.shape[1]} vs {fake.shape[1]}): use one extractor for both")


def frechet_distance(real: Tensor, fake: Tensor) -> float:
    """FID between feature sets ``[N, d]`` / ``[M, d]`` (torchmetrics' formula, float64)."""
    _check_feature_pair(real, fake)
    fid_cls, _ = _torchmetrics_image()
    # The feature sets are complete in this process: no sync with the other ranks of a job
    # (torchmetrics would otherwise wait at a barrier for ranks that compute no metrics).
    metric = fid_cls(feature=_Precomputed(real.shape[1]), sync_on_compute=False)
    metric.update(real.double(), real=True)
    metric.update(fake.double(), real=False)
    return float(metric.compute())


def default_kid_subset_size(num_real: int, num_fake: int) -> int:
    """``min(1000, N // 2)`` with ``N = min(num_real, num_fake)``: 1000 is torchmetrics' default;
    half the set keeps the random subsets different from each other, so the std means something
    (subsets of all N images would all be the same set)."""
    return max(2, min(MAX_KID_SUBSET, min(num_real, num_fake) // 2))


def kernel_distance(real: Tensor, fake: Tensor, *, subset_size: int | None = None,
                    subsets: int = DEFAULT_KID_SUBSETS, seed: int = 0) -> tuple[float, float]:
    """KID (mean, std over ``subsets`` random subsets of ``subset_size``) between feature sets.

    torchmetrics' estimator (cubic polynomial kernel, unbiased MMD^2); its subsets come from
    torch's global RNG, which is forked and seeded with ``seed`` here so results are
    reproducible. Default ``subset_size``: :func:`default_kid_subset_size`. The estimator is
    unbiased for *independent* samples; for a set against itself with ``subset_size = N`` it is
    exactly ``-2 (mean k(x, x) - mean_{x != y} k(x, y)) / N``, slightly below 0.
    """
    _check_feature_pair(real, fake)
    limit = min(real.shape[0], fake.shape[0])
    if subset_size is None:
        subset_size = default_kid_subset_size(real.shape[0], fake.shape[0])
    check(isinstance(subset_size, int) and subset_size >= 2,
          f"kid_subset_size must be an integer >= 2, got {subset_size!r}")
    check(subset_size <= limit,
          f"kid_subset_size {subset_size} is larger than the smaller image set ({real.shape[0]} real, "
          f"{fake.shape[0]} fake)")
    check(isinstance(subsets, int) and subsets >= 1, f"kid_subsets must be an integer >= 1, got {subsets!r}")
    _, kid_cls = _torchmetrics_image()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*will save all extracted features.*")
        metric = kid_cls(feature=_Precomputed(real.shape[1]), subsets=subsets, subset_size=subset_size,
                         sync_on_compute=False)  # complete sets here, as in frechet_distance
    metric.update(real.double(), real=True)
    metric.update(fake.double(), real=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        mean, std = metric.compute()
    return float(mean), float(std)


# ----------------------------------------------------------------------------------------------
# Precision / recall (Kynkäänniemi et al. 2019)
# ----------------------------------------------------------------------------------------------


def _squared_distances(a: Tensor, b: Tensor) -> Tensor:
    """Pairwise squared distances in float64 (``|a|^2 + |b|^2 - 2ab``, clamped at 0)."""
    return (a.pow(2).sum(1, keepdim=True) + b.pow(2).sum(1)[None] - 2 * a @ b.T).clamp_min_(0)


def knn_radii(features: Tensor, k: int = DEFAULT_K, batch_size: int = 1024) -> Tensor:
    """Squared distance of each point to its k-th nearest *other* point of the same set ``[N]``."""
    n = features.shape[0]
    check(n >= k + 1, f"precision/recall with k={k} needs at least {k + 1} images per set, got {n}")
    f = features.double()
    out = []
    for lo in range(0, n, batch_size):
        d2 = _squared_distances(f[lo : lo + batch_size], f)
        # The point itself is among the k + 1 smallest (distance 0), so the (k+1)-th is the k-th other.
        out.append(d2.topk(k + 1, dim=1, largest=False).values[:, k])
    return torch.cat(out)


def manifold_coverage(points: Tensor, centers: Tensor, radii: Tensor, batch_size: int = 1024) -> float:
    """Fraction of ``points`` inside the union of balls around ``centers`` (squared ``radii``)."""
    p, c = points.double(), centers.double()
    sq_c = c.pow(2).sum(1)
    inside = 0
    for lo in range(0, p.shape[0], batch_size):
        block = p[lo : lo + batch_size]
        d2 = _squared_distances(block, c)
        # Rounding slack of the expansion above, so that a point equal to a center is inside even
        # when that center's radius is 0 (duplicates).
        tol = 1e-12 * (block.pow(2).sum(1, keepdim=True) + sq_c[None])
        inside += int((d2 <= radii[None] + tol).any(1).sum())
    return inside / p.shape[0]


def _check_k(k: int, num_real: int, num_fake: int) -> None:
    check(isinstance(k, int) and k >= 1, f"k must be an integer >= 1, got {k!r}")
    check(min(num_real, num_fake) >= k + 1, f"precision/recall with k={k} needs at least {k + 1} images per set, "
                                            f"got {num_real} real and {num_fake} fake")


def precision_recall(real: Tensor, fake: Tensor, *, k: int = DEFAULT_K, batch_size: int = 1024) -> tuple[float, float]:
    """Improved precision and recall (Kynkäänniemi et al. 2019) of feature sets ``[N, d]`` / ``[M, d]``.

    The real manifold is the union of balls around each real feature with radius = its distance
    to its k-th nearest real neighbour; precision = fraction of fake features inside it. Recall
    swaps the roles. Memory is ``batch_size x max(N, M)`` float64 at a time.
    """
    _check_feature_pair(real, fake)
    _check_k(k, real.shape[0], fake.shape[0])
    precision = manifold_coverage(fake, real, knn_radii(real, k, batch_size), batch_size)
    recall = manifold_coverage(real, fake, knn_radii(fake, k, batch_size), batch_size)
    return precision, recall


# ----------------------------------------------------------------------------------------------
# Class accuracy
# ----------------------------------------------------------------------------------------------


def _check_labels(labels: Tensor, n: int, num_classes: int | None, arg: str = "fake_labels") -> Tensor:
    labels = torch.as_tensor(labels)
    check(labels.dim() == 1 and labels.shape[0] == n,
          f"{arg} must be a 1-D tensor with one label per image ({n}), got shape {tuple(labels.shape)}")
    check(not labels.is_floating_point() and labels.dtype != torch.bool, f"{arg} must be integers, got {labels.dtype}")
    if num_classes is not None and n:
        lo, hi = int(labels.min()), int(labels.max())
        check(lo >= 0 and hi < num_classes, f"{arg} must be in [0, {num_classes}), got values in [{lo}, {hi}]")
    return labels.long()


def class_accuracy(logits: Tensor, labels: Tensor) -> float:
    """Fraction of rows whose arg-max class equals ``labels`` (the requested class)."""
    check(logits.dim() == 2, f"logits must be [N, classes], got {tuple(logits.shape)}")
    labels = _check_labels(labels, logits.shape[0], logits.shape[1], "labels")
    check(logits.shape[0] >= 1, "class accuracy needs at least one image")
    return float((logits.argmax(1).cpu() == labels.cpu()).double().mean())


# ----------------------------------------------------------------------------------------------
# One entry point
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class QualityMetrics:
    """Quality of ``fake`` against ``real`` in one feature space (not Inception: see ``note``)."""

    fid: float
    kid_mean: float
    kid_std: float
    precision: float
    recall: float
    class_accuracy: float | None  # None without labels or without a classifier head
    num_real: int
    num_fake: int
    feature_net: str
    k: int = DEFAULT_K
    kid_subset_size: int = 0
    note: str = NOT_INCEPTION

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        acc = "-" if self.class_accuracy is None else f"{self.class_accuracy:.3f}"
        return (f"FID {self.fid:.3f}  KID {self.kid_mean:.5f} ± {self.kid_std:.5f}  precision {self.precision:.3f}  "
                f"recall {self.recall:.3f}  class acc {acc}  ({self.num_fake} vs {self.num_real} real; "
                f"{self.feature_net}; {self.note})")


def _as_features(x: Tensor | Features, extractor: FeatureExtractor | None, arg: str, batch_size: int,
                 progress: bool) -> Features:
    if isinstance(x, Features):
        check(extractor is None or x.extractor == extractor.name,
              f"{arg} features come from {x.extractor!r}, not from the extractor given "
              f"({extractor.name if extractor is not None else ''})")
        return x
    check(extractor is not None, f"{arg} are images: pass an extractor (or precomputed Features)")
    assert extractor is not None
    return extract_features(extractor, x, batch_size=batch_size, progress=progress, arg=arg)


def quality_metrics(
    real: Tensor | Features,
    fake: Tensor | Features,
    fake_labels: Tensor | None = None,
    extractor: FeatureExtractor | None = None,
    *,
    kid_subset_size: int | None = None,
    kid_subsets: int = DEFAULT_KID_SUBSETS,
    k: int = DEFAULT_K,
    seed: int = 0,
    batch_size: int = 100,
    progress: bool = False,
) -> QualityMetrics:
    """FID, KID, precision/recall (k-NN, ``k``) and class accuracy of ``fake`` against ``real``.

    ``real`` / ``fake``: images ``[N, C, H, W]`` in ``[-1, 1]`` or :class:`Features` from
    :func:`extract_features` (pass the reference set's features to avoid recomputing them for every
    method). ``fake_labels``: the class each fake image was generated for; class accuracy needs
    them and an extractor with a classifier head. Every metric uses the same extracted features.
    """
    if isinstance(real, Tensor) and isinstance(fake, Tensor):
        check(real.dim() == fake.dim() == 4 and real.shape[1:] == fake.shape[1:],
              f"real and fake images differ in shape: {tuple(real.shape)} vs {tuple(fake.shape)} ([N, C, H, W])")
    rf = _as_features(real, extractor, "real", batch_size, progress)
    ff = _as_features(fake, extractor, "fake", batch_size, progress)
    check(rf.extractor == ff.extractor, f"real and fake features come from different extractors: "
                                        f"{rf.extractor!r} vs {ff.extractor!r}")
    _check_feature_pair(rf.features, ff.features)
    _check_k(k, len(rf), len(ff))
    subset = default_kid_subset_size(len(rf), len(ff)) if kid_subset_size is None else kid_subset_size
    kid_mean, kid_std = kernel_distance(rf.features, ff.features, subset_size=subset, subsets=kid_subsets, seed=seed)
    precision, recall = precision_recall(rf.features, ff.features, k=k)
    accuracy = None
    if fake_labels is not None:
        num_classes = None if ff.logits is None else ff.logits.shape[1]
        labels = _check_labels(fake_labels, len(ff), num_classes)
        if ff.logits is not None:
            accuracy = class_accuracy(ff.logits, labels)
    fid = frechet_distance(rf.features, ff.features)
    check(math.isfinite(fid), f"FID is not finite ({fid}); are the features degenerate?")
    return QualityMetrics(fid=fid, kid_mean=kid_mean, kid_std=kid_std, precision=precision, recall=recall,
                          class_accuracy=accuracy, num_real=len(rf), num_fake=len(ff), feature_net=rf.extractor,
                          k=k, kid_subset_size=subset)


# ----------------------------------------------------------------------------------------------
# Reference images
# ----------------------------------------------------------------------------------------------


def reference_images(model: Any, num_samples: int | None = None, *, split: str | None = None,
                     seed: int | None = None) -> tuple[Tensor, Tensor]:
    """Real images ``[N, C, S, S]`` in ``[-1, 1]`` and labels ``[N]`` to compare a stack's samples with.

    ``model``: a :class:`~lantern.targets.llamagen_stack.ModelStack`, a preset name or a stack folder; its
    ``data.json`` names the data set the stack was trained on. The first ``num_samples`` items are
    returned (classes stay balanced). By default (``split=None``) this is a sample of the
    *training distribution* that the generator did not train on:

    - digits and image folders: the held-out test split (digits: 500 images);
    - photos: fresh random crops of the training regions (the data set's seed + 1). The photos
      test split crops *other regions* of the photos, with other content (the cat photo's test
      region is a blurred wall); a perfect generator would score far from it (FID ~4 in the
      photos feature space, where two real samples of one distribution score ~0.1).

    ``split`` / ``seed`` override this (``seed`` only changes photo crops).
    """
    from lantern.data import batch_images, load_dataset
    from lantern.data.datasets import DATA_FILE
    from lantern.io import read_json_object
    from lantern.targets.llamagen_stack import resolve_model_dir

    root = model.root if hasattr(model, "root") else resolve_model_dir(model)
    spec = read_json_object(Path(root) / DATA_FILE, "stack data description")
    if split is None:
        fresh_crops = spec.get("source") == "photos"
        split = "train" if fresh_crops else "test"
        if fresh_crops and seed is None:
            seed = int(spec.get("seed", 0)) + 1
    spec["split"] = split
    if num_samples is not None:
        spec["num_samples"] = num_samples
    if seed is not None:
        spec["seed"] = seed
    data = load_dataset(**spec)
    return batch_images(data, list(range(len(data))))
